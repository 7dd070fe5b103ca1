#include <lockstep/world.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <atomic>
#include <exception>
#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>

#include "compat/c10d.h"
#include "timeline/recorder.h"
#include "transport/local_transport.h"
#include "transport/process_group_transport.h"
#include "world/epoch_world.h"
#include "world/rendezvous.h"
#include "world/transport_choice.h"
#include "world/world_impl.h"

namespace lockstep {

World::Impl::~Impl() {
  close();
  if (abandoned) {
    // A peer that stopped (SIGSTOP) leaves Gloo's threads blocked in it
    // until Gloo's own timeout, and destroying the group joins them: the
    // abandoned world's transports and groups are destroyed on a thread of
    // their own, which ends with them (at once when the peer died, since
    // its connections closed).
    std::thread([cpu_transport = std::move(cpu_transport), cpu_group = std::move(cpu_group),
                 cpu_backend = std::move(cpu_backend), cuda_transport = std::move(cuda_transport),
                 cuda_group = std::move(cuda_group),
                 cuda_backend = std::move(cuda_backend)]() mutable {
      cpu_transport.reset();
      cuda_transport.reset();
      cpu_group.reset();
      cuda_group.reset();
      cpu_backend.reset();
      cuda_backend.reset();
    }).detach();
  }
  // A program may end without running static destructors (_exit, a
  // fatal signal later): what the timeline holds should reach the file.
  detail::timeline::flush();
}

namespace {

constexpr auto kWaitSlice = std::chrono::milliseconds(100);
// How long a collective that failed in its transport waits for a peer's
// explanation before it says what the transport said.
constexpr auto kExplainGrace = std::chrono::seconds(1);

// An average of 16-bit floats is divided before it is summed: a backend
// that adds them in their own format (Gloo's float16) would otherwise
// overflow at 65504 where the average does not.
bool divides_first(const at::Tensor& tensor) {
  return tensor.scalar_type() == at::kHalf || tensor.scalar_type() == at::kBFloat16;
}

// The tensor a collective moves in place of `tensor`: itself, or a dense
// copy of a strided view (transports move data_ptr and numel). A tensor
// whose elements share memory has no one place for each result.
at::Tensor dense(const at::Tensor& tensor, const std::string& operation, int rank) {
  LOCKSTEP_ENFORCE(
      at::has_internal_overlap(tensor) != at::MemOverlap::Yes, UsageError, "rank ", rank, ": ",
      operation, " is refused: elements of this tensor share memory (an expand(), or a "
      "stride of 0), so there is no one place for each element's result; pass a "
      ".contiguous() or .clone() of it.");
  return tensor.is_contiguous() ? tensor : tensor.contiguous();
}

std::string describe(const at::Tensor& tensor) {
  std::ostringstream out;
  out << tensor.scalar_type() << " " << tensor.sizes();
  return out.str();
}

// Waits for one collective and turns the transport's failures into errors
// that name the rank, the operation and, for a timeout, the ranks that never
// reached it.
void complete_or_explain(
    World::Impl& impl,
    uint64_t seq,
    const std::string& operation,
    detail::TransportWork& work) {
  const auto& config = impl.config;
  std::string what = detail::str(operation, " #", seq);
  auto timed_out = [&](const std::string& cause) {
    LOCKSTEP_FAIL(
        TimeoutError, "rank ", config.rank, ": ", what,
        " did not complete within ", detail::seconds(config.timeout), ": ",
        impl.ledger ? impl.ledger->attendance(seq) : std::string("a peer is not taking part"),
        ". A rank that stopped, or runs a different collective, leaves the "
        "others waiting; raise the limit with LOCKSTEP_TIMEOUT (seconds) "
        "if it is only slow.\n  cause: ", cause);
  };
  auto start = std::chrono::steady_clock::now();
  auto deadline = start + config.timeout;
  bool hang_reported = false;
  try {
    // In slices, so that a peer that closed its world or died is named
    // within a slice instead of at the timeout.
    while (!work.wait_for(kWaitSlice)) {
      LOCKSTEP_ENFORCE(!impl.abandoned, CollectiveError, "rank ", config.rank, ": ", what,
                       " was abandoned: ", impl.broken_because(), ".");
      if (impl.ledger) {
        impl.ledger->check_peers(seq, operation);
        if (impl.on_hang && !hang_reported &&
            std::chrono::steady_clock::now() - start >= impl.hang_timeout) {
          hang_reported = true;
          auto missing = impl.ledger->missing(seq);
          if (!missing.empty()) {
            impl.on_hang(missing, what);
          }
        }
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        timed_out(work.stall());
      }
    }
    impl.completed(seq);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    std::string cause = detail::describe_exception(e);
    if (cause.find("imed out") != std::string::npos) {
      timed_out(cause); // the backend's own limit, which is the world's
    }
    if (impl.ledger) {
      // A closed connection arrives before the word of the peer that saw
      // why (a rank beside the one that died, on another host): a peer
      // that closes within the grace says more than the backend.
      auto until = std::chrono::steady_clock::now() + kExplainGrace;
      while (true) {
        impl.ledger->check_peers(seq, operation);
        if (std::chrono::steady_clock::now() >= until) {
          break;
        }
        std::this_thread::sleep_for(kWaitSlice);
      }
    }
    LOCKSTEP_FAIL(
        CollectiveError, "rank ", config.rank, ": ", what, " failed: ",
        impl.ledger ? impl.ledger->attendance(seq, /*failed=*/true)
                    : std::string("a closed connection means that another rank exited"),
        ".\n  cause: ", cause);
  }
}

// complete_or_explain; a collective that fails leaves the world unusable.
void complete(
    World::Impl& impl,
    uint64_t seq,
    const std::string& operation,
    detail::TransportWork& work) {
  try {
    complete_or_explain(impl, seq, operation, work);
  } catch (...) {
    impl.break_at(seq, operation);
    throw;
  }
}

// Starts a collective with `start` once this rank's arrival is recorded,
// and completes it.
template <typename Start>
void run_collective(World::Impl& impl, const std::string& operation, Start start) {
  auto begin = detail::timeline::Clock::now();
  uint64_t seq = 0;
  std::unique_ptr<detail::TransportWork> work;
  {
    std::lock_guard<std::mutex> lock(impl.issue_mutex);
    seq = impl.begin(operation);
    work = start();
  }
  complete(impl, seq, operation, *work);
  if (detail::timeline::enabled()) {
    detail::timeline::record(detail::timeline::kLoopTrack, operation, begin,
                             detail::timeline::Clock::now());
  }
}


} // namespace

struct PendingCollective::State {
  std::shared_ptr<World::Impl> world;
  uint64_t seq = 0;
  std::string what;
  std::unique_ptr<detail::TransportWork> work;
  at::Tensor tensor;
  ReduceOp op = ReduceOp::Sum;
  bool done = false;
  // A failed wait fails again: the data were never reduced.
  std::exception_ptr failure;
  int64_t completed_ns = 0;
  // Where the result belongs when `tensor` is a copy of a strided view.
  at::Tensor view;
};

PendingCollective::PendingCollective(std::shared_ptr<State> state)
    : state_(std::move(state)) {}

std::chrono::steady_clock::time_point PendingCollective::completed_at() const {
  return std::chrono::steady_clock::time_point(std::chrono::nanoseconds(state_->completed_ns));
}

void PendingCollective::wait() {
  auto& state = *state_;
  if (state.failure) {
    std::rethrow_exception(state.failure);
  }
  if (state.done) {
    return;
  }
  try {
    complete(*state.world, state.seq, state.what, *state.work);
  } catch (...) {
    state.failure = std::current_exception();
    throw;
  }
  state.done = true;
  state.completed_ns = state.work->completed_ns();
  if (state.completed_ns == 0) {
    state.completed_ns = detail::steady_now_ns();
  }
  if (state.op == ReduceOp::Average && !divides_first(state.tensor)) {
    int size = state.world->config.size;
    if (at::isIntegralType(state.tensor.scalar_type(), /*includeBool=*/true)) {
      state.tensor.div_(size, "floor");
    } else {
      state.tensor.div_(size);
    }
  }
  if (state.view.defined()) {
    state.view.copy_(state.tensor);
  }
}

World::World(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

int World::rank() const {
  return impl_->config.rank;
}
int World::size() const {
  return impl_->config.size;
}
int World::local_rank() const {
  return impl_->config.local_rank;
}
int World::local_size() const {
  return impl_->config.local_size;
}
const std::string& World::source() const {
  return impl_->config.source;
}
std::chrono::milliseconds World::timeout() const {
  return impl_->config.timeout;
}
DebugLevel World::debug() const {
  return impl_->config.debug;
}
void World::set_debug(DebugLevel level) {
  impl_->config.debug = level;
  if (impl_->ledger) {
    impl_->ledger->set_compare(level == DebugLevel::Detail);
  }
}

const std::string& World::transport() const {
  return impl_->transport_description;
}

c10::intrusive_ptr<c10d::Store> World::store() const {
  return impl_->store;
}

c10::intrusive_ptr<c10d::ProcessGroup> World::process_group(
    const at::Device& device) const {
  std::lock_guard<std::mutex> lock(impl_->group_mutex);
  if (device.is_cpu()) {
    impl_->start_gloo_backend();
    if (!impl_->cpu_group) {
      impl_->cpu_group = detail::as_process_group(impl_->cpu_backend, impl_->gloo_store,
                                                  impl_->group_options(), /*cuda=*/false);
    }
    return impl_->cpu_group;
  }
  impl_->start_cuda_backend(device);
  if (!impl_->cuda_group) {
    impl_->cuda_group = detail::as_process_group(impl_->cuda_backend, impl_->nccl_store,
                                                 impl_->group_options(), /*cuda=*/true);
  }
  return impl_->cuda_group;
}

void World::Impl::start_gloo_backend() {
  if (!cpu_backend) {
    gloo_store = c10::make_intrusive<c10d::PrefixStore>("gloo/", store);
    cpu_backend = detail::make_gloo_backend(gloo_store, group_options());
  }
}

void World::Impl::start_cuda_backend(const at::Device& device) {
  LOCKSTEP_ENFORCE(
      device.is_cuda(), CollectiveError, "tensors on ", device,
      " are not supported; lockstep reduces CPU and CUDA tensors.");
  if (!cuda_backend) {
    nccl_store = c10::make_intrusive<c10d::PrefixStore>("nccl/", store);
    cuda_backend = detail::make_nccl_backend(nccl_store, group_options());
    cuda_transport = std::make_shared<detail::ProcessGroupTransport>(cuda_backend, "NCCL");
  }
}

detail::Transport& World::Impl::transport_for(const at::Tensor& tensor) {
  if (tensor.device().is_cpu()) {
    return *cpu_transport;
  }
  std::lock_guard<std::mutex> lock(group_mutex);
  start_cuda_backend(tensor.device());
  return *cuda_transport;
}

void World::barrier() {
  run_collective(*impl_, "barrier", [&] { return impl_->cpu_transport->barrier(); });
}

void World::broadcast(at::Tensor& tensor, int root, const std::string& description) {
  LOCKSTEP_ENFORCE(
      root >= 0 && root < size(), CollectiveError, "broadcast root ", root,
      " is not a rank of this world of size ", size(), ".");
  std::string operation = description.empty()
      ? detail::str("broadcast from rank ", root, " of ", describe(tensor))
      : description;
  auto travelling = dense(tensor, operation, rank());
  run_collective(*impl_, operation,
                 [&] { return impl_->transport_for(tensor).broadcast(travelling, root); });
  if (!travelling.is_same(tensor)) {
    tensor.copy_(travelling);
  }
}

void World::all_reduce(at::Tensor& tensor, ReduceOp op) {
  auto begin = detail::timeline::Clock::now();
  std::string operation = detail::str("all_reduce of ", describe(tensor));
  all_reduce_async(tensor, op, operation).wait();
  if (detail::timeline::enabled()) {
    detail::timeline::record(detail::timeline::kLoopTrack, operation, begin,
                             detail::timeline::Clock::now());
  }
}

PendingCollective World::all_reduce_async(
    at::Tensor tensor, ReduceOp op, std::string description) {
  auto state = std::make_shared<PendingCollective::State>();
  state->world = impl_;
  state->what = description;
  state->tensor = dense(tensor, description, rank());
  if (!state->tensor.is_same(tensor)) {
    state->view = tensor;
  }
  state->op = op;
  std::lock_guard<std::mutex> lock(impl_->issue_mutex);
  state->seq = impl_->begin(description);
  // Once the collective may start: a world that refuses it leaves the
  // tensor as it was.
  if (op == ReduceOp::Average && divides_first(tensor)) {
    state->tensor.div_(size());
  }
  state->work = impl_->transport_for(tensor).all_reduce(
      state->tensor, op == ReduceOp::Average ? ReduceOp::Sum : op);
  return PendingCollective(std::move(state));
}

std::vector<at::Tensor> World::all_gather(const at::Tensor& tensor) {
  std::vector<at::Tensor> outputs;
  for (int rank = 0; rank < size(); ++rank) {
    outputs.push_back(at::empty_like(tensor, at::MemoryFormat::Contiguous));
  }
  auto input = tensor.contiguous();
  run_collective(*impl_, detail::str("all_gather of ", describe(tensor)), [&] {
    return impl_->transport_for(tensor).all_gather(outputs, input);
  });
  return outputs;
}

namespace detail {
namespace {

// The slices of an all_gather_into's output that each rank's input lands in.
std::vector<at::Tensor> slices_per_rank(const at::Tensor& output, int64_t each, int ranks) {
  std::vector<at::Tensor> slices;
  for (int rank = 0; rank < ranks; ++rank) {
    slices.push_back(output.narrow(0, rank * each, each));
  }
  return slices;
}

// A collective that runs while the caller goes on: issued in this world's
// order, its transport work started by `start`; `result` is what it writes.
template <typename Start>
PendingCollective issue_pending(const std::shared_ptr<World::Impl>& impl,
                                const std::string& description, const at::Tensor& result,
                                Start start) {
  auto state = std::make_shared<PendingCollective::State>();
  state->world = impl;
  state->what = description;
  state->tensor = result;
  std::lock_guard<std::mutex> lock(impl->issue_mutex);
  state->seq = impl->begin(description);
  start(*state);
  return PendingCollective(std::move(state));
}

} // namespace

void WorldAccess::all_gather_into(const World& world, const at::Tensor& output,
                                  const at::Tensor& input, const std::string& description) {
  auto& impl = *world.impl_;
  auto outputs = slices_per_rank(output, input.numel(), world.size());
  run_collective(impl, description.empty() ? str("all_gather_into of ", describe(input))
                                           : description, [&] {
    return impl.transport_for(input).all_gather(outputs, input);
  });
}

PendingCollective WorldAccess::all_gather_into_async(const World& world,
                                                     const at::Tensor& output,
                                                     const at::Tensor& input,
                                                     const std::string& description) {
  auto outputs = slices_per_rank(output, input.numel(), world.size());
  return issue_pending(world.impl_, description, output, [&](PendingCollective::State& state) {
    state.work = world.impl_->transport_for(input).all_gather(outputs, input);
  });
}

PendingCollective WorldAccess::reduce_scatter_async(const World& world,
                                                    const at::Tensor& output,
                                                    const at::Tensor& input,
                                                    int64_t unpadded,
                                                    const std::string& description) {
  return issue_pending(world.impl_, description, output, [&](PendingCollective::State& state) {
    auto& transport = world.impl_->transport_for(input);
    state.work = transport.reduce_scatter(output, input, ReduceOp::Sum);
    if (!state.work) {
      state.tensor = input.narrow(0, world.rank() * output.numel(), output.numel());
      state.view = output; // where wait() copies the slice
      state.work = transport.all_reduce(input.narrow(0, 0, unpadded), ReduceOp::Sum);
    }
  });
}

void WorldAccess::reduce_scatter(const World& world, const at::Tensor& output,
                                 const at::Tensor& input, ReduceOp op,
                                 const std::string& description) {
  auto& impl = *world.impl_;
  int size = world.size();
  bool average = op == ReduceOp::Average;
  ReduceOp reduce = average ? ReduceOp::Sum : op;
  auto source = average && divides_first(input) ? input / size : input;
  // Where the transport has no reduce-scatter of its own: an all-reduce of
  // a copy, of which this rank keeps its slice.
  at::Tensor reduced;
  run_collective(impl, description.empty() ? str("reduce_scatter of ", describe(input))
                                           : description, [&] {
    auto& transport = impl.transport_for(input);
    if (auto work = transport.reduce_scatter(output, source, reduce)) {
      return work;
    }
    reduced = source.is_same(input) ? input.clone() : source;
    return transport.all_reduce(reduced, reduce);
  });
  if (reduced.defined()) {
    output.copy_(reduced.narrow(0, world.rank() * output.numel(), output.numel()));
  }
  if (average && !divides_first(input)) {
    if (at::isIntegralType(output.scalar_type(), /*includeBool=*/true)) {
      output.div_(size, "floor");
    } else {
      output.div_(size);
    }
  }
}

} // namespace detail

at::Tensor World::allocate(int64_t numel, at::ScalarType dtype) {
  return impl_->cpu_transport->allocate(numel, dtype);
}

std::vector<std::string> World::all_gather_strings(const std::string& value) {
  uint64_t round = ++impl_->string_gather_count;
  auto key = [](uint64_t r, int rank) {
    return detail::str("strings/", r, "/", rank);
  };
  auto& store = *impl_->store;
  std::string operation = detail::str("all_gather_strings #", round);
  uint64_t seq = impl_->begin(operation);
  detail::store_set(store, key(round, rank()), value);
  // Having reached this round, every rank finished reading round - 2: our
  // key from then is no longer needed.
  if (round > 2) {
    store.deleteKey(key(round - 2, rank()));
  }
  std::vector<std::string> values;
  auto deadline = std::chrono::steady_clock::now() + timeout();
  for (int rank = 0; rank < size(); ++rank) {
    auto arrived = [&] {
      LOCKSTEP_ENFORCE(!impl_->abandoned, CollectiveError, "rank ", this->rank(), ": ",
                       operation, " was abandoned: ", impl_->broken_because(), ".");
      return store.check({key(round, rank)});
    };
    bool came = impl_->ledger
        ? impl_->ledger->wait_until(arrived, deadline, seq, operation)
        : arrived();
    LOCKSTEP_ENFORCE(
        came, TimeoutError, "rank ", this->rank(), ": ", operation,
        " did not receive rank ", rank, "'s value within ",
        detail::seconds(timeout()), "; that rank is not taking part.");
    auto bytes = store.get(key(round, rank));
    values.emplace_back(bytes.begin(), bytes.end());
  }
  impl_->completed(seq);
  return values;
}

std::shared_ptr<detail::Liveness> World::Impl::start_liveness() {
  if (!liveness) {
    liveness = std::make_shared<detail::Liveness>(
        job_store->endpoint().value(), config.timeout,
        detail::Liveness::Process{replica, config.incarnation, detail::this_process().to_record()},
        detail::kHeartbeatSilence);
  }
  return liveness;
}

void World::Impl::connect(const std::string& scope) {
  std::vector<detail::ProcessIdentity> peers{detail::this_process()};
  if (config.size > 1) {
    peers = detail::join(store, config, job_store->nonce());
    bool across_hosts = std::any_of(peers.begin(), peers.end(), [&](const auto& peer) {
      return peer.machine != peers[config.rank].machine;
    });
    if (across_hosts) {
      start_liveness();
    }
    ledger = std::make_unique<detail::Ledger>(
        job_store->ledger_board(scope, store, config.rank, config.size), config.rank, peers,
        config.timeout, /*compare=*/config.debug == DebugLevel::Detail, liveness);
  }
  if (config.size == 1) {
    cpu_transport = std::make_shared<detail::LocalTransport>();
  } else {
    start_gloo_backend();
    cpu_transport =
        detail::choose_transport(config, store, peers, cpu_backend, group_options());
  }
  transport_description = cpu_transport->describe();
}

World init(const WorldOptions& options) {
  auto impl = std::make_shared<World::Impl>();
  impl->config = detail::resolve_world(options, detail::process_environment());
  impl->replica = impl->config.rank;
  impl->slots = impl->config.size;
  impl->slots_per_host = impl->config.local_size;
  detail::timeline::start(impl->config.rank);
  impl->job_store = detail::connect_job_store(impl->config);
  impl->store = impl->job_store->store();
  if (impl->config.standby) {
    // Restarted alone: the others are mid-training, and this process meets
    // them through lockstep::FaultTolerance, from a world of its own.
    impl->config.source = detail::str("restarted alone (incarnation ", impl->config.incarnation,
                                      " of rank ", impl->replica, ")");
    impl->config.rank = 0;
    impl->config.size = 1;
    impl->config.local_rank = 0;
    impl->config.local_size = 1;
  }
  impl->connect("");
  if (impl->config.debug != DebugLevel::Off) {
    std::cerr << "lockstep INFO rank " << impl->config.rank << ": collectives of CPU tensors go "
              << "through " << impl->transport_description << std::endl;
  }
  return World(std::move(impl));
}

} // namespace lockstep
