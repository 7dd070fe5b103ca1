#include <lockstep/detail/reducer.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>

#include "reducer/bucket.h"
#include "reducer/graph_walk.h"
#include "reducer/model_state.h"

namespace lockstep::detail {
namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

std::string mib(int64_t bytes) {
  std::ostringstream out;
  out.precision(bytes < (1 << 20) ? 3 : 1);
  out << std::fixed << static_cast<double>(bytes) / (1 << 20) << " MiB";
  return out.str();
}

// Sparse gradients cannot go into dense buckets; they come from embeddings
// built with sparse(true), which is known before any backward.
void reject_sparse_gradients(torch::nn::Module& module) {
  for (const auto& item : module.named_modules()) {
    bool sparse = false;
    if (auto* embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(item.value().get())) {
      sparse = embedding->options.sparse();
    } else if (auto* bag = dynamic_cast<torch::nn::EmbeddingBagImpl*>(item.value().get())) {
      sparse = bag->options.sparse();
    }
    LOCKSTEP_ENFORCE(
        !sparse, UsageError, "module '",
        item.key().empty() ? std::string("(root)") : item.key(), "' (",
        item.value()->name(), ") produces sparse gradients, which "
        "DistributedDataParallel does not average. Build it with "
        ".sparse(false).");
  }
}

} // namespace

struct Reducer::State : std::enable_shared_from_this<State> {
  State(World world_in, DdpOptions options_in)
      : world(std::move(world_in)), options(options_in) {}

  World world;
  DdpOptions options;

  // Trainable parameters, each once, in registration order.
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  // Kept alive: a parameter only holds a weak reference to its accumulator,
  // and a new one, without our hook, would replace it.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::unordered_map<const torch::autograd::Node*, size_t> accumulator_index;
  std::vector<at::Tensor> buffers;
  std::vector<int64_t> buffer_versions; // as of the last broadcast

  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of;
  std::vector<size_t> slot_of;

  mutable std::mutex mutex;
  bool sync_enabled = true;

  // Set by a forward through the wrapper, consumed by the next backward.
  bool forward_seen = false;
  bool sync_at_forward = true;
  std::optional<std::vector<size_t>> unused_at_forward;
  Clock::time_point forward_start;
  Clock::time_point forward_end;

  // The backward in progress.
  bool iteration_open = false;
  bool iteration_sync = false;
  Clock::time_point first_gradient;
  std::vector<char> ready;
  std::vector<char> used_now;
  std::vector<size_t> ready_order;
  std::vector<size_t> pending;
  size_t next_launch = 0;
  std::vector<std::optional<PendingCollective>> in_flight;
  std::vector<double> launch_ms;
  std::vector<std::string> problems;

  // Across iterations.
  std::vector<char> used_since_sync;
  bool buffers_need_broadcast = false;
  bool rebuilt = false;
  std::optional<std::vector<char>> static_used;
  bool warned_bypass = false;
  int64_t iteration = 0; // synchronised backward passes begun
  DdpStats stats;

  void install_hooks();
  void layout_buckets(const std::vector<size_t>& order);
  std::vector<size_t> reverse_registration_order() const;

  void on_gradient(size_t index);
  void open_iteration();
  void mark_ready(size_t index, bool used);
  void launch_ready_buckets(bool include_last);
  void finalize();
  void raise_problems_everywhere(int64_t ranks_with_problems);
  void write_back(const std::vector<double>& global_flags);
  void rebuild_buckets();
  bool buffers_changed_locally() const;
  void broadcast_buffers();
  std::string describe_bucket(size_t bucket) const;
};

Reducer::Reducer(torch::nn::Module& module, World world, DdpOptions options)
    : state_(std::make_shared<State>(std::move(world), options)) {
  auto& state = *state_;
  LOCKSTEP_ENFORCE(
      options.bucket_cap_mb() >= 0 && options.first_bucket_cap_mb() >= 0,
      ConfigError, "bucket caps must not be negative (bucket_cap_mb=",
      options.bucket_cap_mb(), ", first_bucket_cap_mb=",
      options.first_bucket_cap_mb(), ").");
  reject_sparse_gradients(module);

  std::vector<NamedTensor> all_params;
  std::vector<NamedTensor> all_buffers;
  named_state(module, all_params, all_buffers);
  std::vector<at::Tensor> module_state;
  for (const auto& entry : all_params) {
    module_state.push_back(entry.tensor);
    if (entry.tensor.requires_grad()) {
      state.names.push_back(entry.name);
      state.params.push_back(entry.tensor);
    }
  }
  for (const auto& entry : all_buffers) {
    module_state.push_back(entry.tensor);
    state.buffers.push_back(entry.tensor);
  }

  check_same_model(state.world, all_params, all_buffers);
  broadcast_from_rank0(state.world, module_state);
  for (const auto& buffer : state.buffers) {
    state.buffer_versions.push_back(buffer._version());
  }

  state.used_since_sync.assign(state.params.size(), 0);
  state.layout_buckets(state.reverse_registration_order());
  state.install_hooks();
}

Reducer::~Reducer() = default;

std::vector<size_t> Reducer::State::reverse_registration_order() const {
  std::vector<size_t> order(params.size());
  for (size_t i = 0; i < order.size(); ++i) {
    order[i] = order.size() - 1 - i;
  }
  return order;
}

void Reducer::State::install_hooks() {
  std::weak_ptr<State> weak = shared_from_this();
  for (size_t index = 0; index < params.size(); ++index) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params[index]);
    accumulator_index[accumulator.get()] = index;
    accumulator->add_post_hook(
        std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [weak, index](
                const torch::autograd::variable_list& outputs,
                const torch::autograd::variable_list& /*inputs*/) {
              if (auto state = weak.lock()) {
                state->on_gradient(index);
              }
              return outputs;
            }));
    accumulators.push_back(std::move(accumulator));
  }
}

void Reducer::State::layout_buckets(const std::vector<size_t>& order) {
  auto plan = plan_buckets(
      params, order, options.first_bucket_cap_mb(), options.bucket_cap_mb());
  std::vector<Bucket> fresh;
  std::vector<size_t> fresh_bucket_of(params.size(), 0);
  std::vector<size_t> fresh_slot_of(params.size(), 0);
  for (size_t b = 0; b < plan.size(); ++b) {
    fresh.emplace_back(plan[b], params, /*with_extras=*/b + 1 == plan.size());
    for (size_t k = 0; k < plan[b].size(); ++k) {
      fresh_bucket_of[plan[b][k]] = b;
      fresh_slot_of[plan[b][k]] = k;
    }
  }
  // Gradients kept as views into the old buckets move to the new ones.
  at::NoGradGuard no_grad;
  for (size_t index = 0; index < params.size() && !buckets.empty(); ++index) {
    auto& grad = params[index].mutable_grad();
    if (buckets[bucket_of[index]].holds(slot_of[index], grad)) {
      auto slot = fresh[fresh_bucket_of[index]].slot(fresh_slot_of[index]);
      slot.copy_(grad);
      grad = slot;
    }
  }
  buckets = std::move(fresh);
  bucket_of = std::move(fresh_bucket_of);
  slot_of = std::move(fresh_slot_of);

  stats.bucket_bytes.clear();
  stats.bucket_parameters.clear();
  for (const auto& bucket : buckets) {
    stats.bucket_bytes.push_back(bucket.bytes());
    std::vector<std::string> members;
    for (size_t index : bucket.members()) {
      members.push_back(names[index]);
    }
    stats.bucket_parameters.push_back(std::move(members));
  }
}

std::string Reducer::State::describe_bucket(size_t b) const {
  std::ostringstream out;
  out << "bucket " << b << " of iteration " << iteration << " (";
  const auto& members = buckets[b].members();
  for (size_t k = 0; k < members.size() && k < 3; ++k) {
    out << (k == 0 ? "" : ", ") << names[members[k]];
  }
  if (members.size() > 3) {
    out << " and " << members.size() - 3 << " more";
  }
  out << "; " << mib(buckets[b].bytes()) << ")";
  return out.str();
}

void Reducer::before_forward() {
  auto& state = *state_;
  std::lock_guard<std::mutex> lock(state.mutex);
  state.stats.last = IterationStats{};
  state.forward_start = Clock::now();
  state.forward_seen = true;
  state.sync_at_forward = state.sync_enabled;
  state.unused_at_forward.reset();
  bool broadcast = false;
  switch (state.options.broadcast_buffers()) {
    case BufferSync::Always:
      broadcast = true;
      break;
    case BufferSync::Never:
      break;
    case BufferSync::WhenChanged:
      // Learned from every rank at the last synchronised backward, so every
      // rank decides alike. Without buckets there is nothing to learn from.
      broadcast = state.buffers_need_broadcast || state.buckets.empty();
      break;
  }
  if (broadcast && !state.buffers.empty()) {
    state.broadcast_buffers();
  }
  state.buffers_need_broadcast = false;
}

void Reducer::State::broadcast_buffers() {
  broadcast_from_rank0(world, buffers);
  for (size_t i = 0; i < buffers.size(); ++i) {
    buffer_versions[i] = buffers[i]._version();
  }
  stats.last.buffer_broadcasts += 1;
  stats.total.buffer_broadcasts += 1;
}

bool Reducer::State::buffers_changed_locally() const {
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (buffers[i]._version() != buffer_versions[i]) {
      return true;
    }
  }
  return false;
}

void Reducer::after_forward(const std::vector<at::Tensor>& outputs) {
  auto& state = *state_;
  std::lock_guard<std::mutex> lock(state.mutex);
  state.forward_end = Clock::now();
  double forward_ms = ms_between(state.forward_start, state.forward_end);
  state.stats.last.forward_ms = forward_ms;
  state.stats.total.forward_ms += forward_ms;
  bool walkable = !outputs.empty() &&
      std::all_of(outputs.begin(), outputs.end(),
                  [](const at::Tensor& t) { return t.defined(); });
  if (!state.options.find_unused_parameters() || !state.sync_at_forward ||
      !walkable || !at::GradMode::is_enabled()) {
    return;
  }
  auto reachable = reachable_nodes(outputs);
  std::vector<size_t> unused;
  for (size_t index = 0; index < state.params.size(); ++index) {
    if (reachable.count(state.accumulators[index].get()) == 0) {
      unused.push_back(index);
    }
  }
  state.unused_at_forward = std::move(unused);
}

void Reducer::set_sync_enabled(bool enabled) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->sync_enabled = enabled;
}

bool Reducer::sync_enabled() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->sync_enabled;
}

DdpStats Reducer::stats() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->stats;
}

void Reducer::State::on_gradient(size_t index) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!iteration_open) {
    open_iteration();
  }
  used_now[index] = 1;
  if (!iteration_sync) {
    used_since_sync[index] = 1;
    return;
  }
  const auto& grad = params[index].grad();
  if (grad.defined() && grad.is_sparse()) {
    problems.push_back(str("parameter '", names[index], "' got a sparse "
                           "gradient, which DistributedDataParallel does not "
                           "average."));
  }
  if (static_used && !(*static_used)[index]) {
    problems.push_back(str(
        "parameter '", names[index], "' got a gradient in iteration ",
        iteration, " but not in the first one, which static_graph froze."));
  }
  if (ready[index]) {
    // The graph walk of find_unused_parameters judged it unused, yet the
    // loss reached it. While its bucket has not left, the gradient still
    // gets in; once it has, that is a problem to report.
    if (next_launch > bucket_of[index]) {
      problems.push_back(str(
          "parameter '", names[index], "' got a gradient after "
          "find_unused_parameters judged it unused: the loss reaches it "
          "through a tensor that is not among the forward's outputs. Return "
          "that tensor from forward, or turn find_unused_parameters off."));
      return;
    }
    ready[index] = 0;
    ++pending[bucket_of[index]];
  }
  ready_order.push_back(index);
  mark_ready(index, /*used=*/true);
}

void Reducer::State::open_iteration() {
  bool bypassed = !forward_seen;
  if (bypassed && options.bypass() == Bypass::Error) {
    LOCKSTEP_FAIL(
        UsageError, "rank ", world.rank(), ": backward reached the "
        "parameters of the module wrapped in DistributedDataParallel "
        "without a forward through the wrapper: the loss was computed on "
        "ddp.module() (or another path to the same module). Call ddp(input) "
        "instead, or choose DdpOptions().bypass(Bypass::SyncAndWarn) to "
        "average such gradients anyway.");
  }
  if (bypassed && options.bypass() == Bypass::SyncAndWarn && !warned_bypass) {
    warned_bypass = true;
    TORCH_WARN(
        "lockstep: rank ", world.rank(), ": backward reached the parameters "
        "of the module wrapped in DistributedDataParallel without a forward "
        "through the wrapper (the loss was computed on ddp.module()?). The "
        "gradients are averaged across ranks anyway. Call ddp(input) "
        "instead, or set DdpOptions().bypass(Bypass::Ignore) to keep such "
        "gradients local or Bypass::Error to make this an error. Shown once.");
  }
  iteration_open = true;
  if (bypassed) {
    iteration_sync = options.bypass() != Bypass::Ignore && sync_enabled;
  } else {
    iteration_sync = sync_at_forward;
  }
  std::weak_ptr<State> weak = shared_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto state = weak.lock()) {
      state->finalize();
    }
  });
  used_now.assign(params.size(), 0);
  if (!iteration_sync) {
    return;
  }
  ++iteration;
  if (bypassed) {
    stats.last = IterationStats{};
  }
  first_gradient = Clock::now();
  ready.assign(params.size(), 0);
  ready_order.clear();
  problems.clear();
  pending.clear();
  for (const auto& bucket : buckets) {
    pending.push_back(bucket.members().size());
  }
  next_launch = 0;
  in_flight.assign(buckets.size(), std::nullopt);
  launch_ms.assign(buckets.size(), 0.0);
  if (unused_at_forward && !bypassed) {
    for (size_t index : *unused_at_forward) {
      mark_ready(index, /*used=*/false);
    }
  }
}

void Reducer::State::mark_ready(size_t index, bool used) {
  ready[index] = 1;
  auto& bucket = buckets[bucket_of[index]];
  size_t k = slot_of[index];
  bool contributes = used || used_since_sync[index];
  auto& grad = params[index].mutable_grad();
  at::NoGradGuard no_grad;
  if (!grad.defined()) {
    bucket.slot(k).zero_();
  } else if (!bucket.holds(k, grad)) {
    bucket.slot(k).copy_(grad);
  } else if (!contributes) {
    // The slot will hold the sum over ranks; if no rank used the parameter,
    // its gradient must stay exactly as it was, so it leaves the bucket.
    grad = grad.clone();
  }
  bucket.flags()[static_cast<int64_t>(k)].fill_(contributes ? 1 : 0);
  if (--pending[bucket_of[index]] == 0) {
    launch_ready_buckets(/*include_last=*/false);
  }
}

void Reducer::State::launch_ready_buckets(bool include_last) {
  // Strictly in bucket order, so that every rank issues the same sequence
  // of collectives. The last bucket waits for the end of backward, when this
  // rank's extras (problems, buffer changes) are known.
  while (next_launch < buckets.size() && pending[next_launch] == 0 &&
         (include_last || next_launch + 1 < buckets.size())) {
    auto& bucket = buckets[next_launch];
    if (next_launch + 1 == buckets.size()) {
      auto extras = bucket.extras();
      extras[kBuffersChanged].fill_(buffers_changed_locally() ? 1 : 0);
      extras[kProblems].fill_(problems.empty() ? 0 : 1);
    }
    launch_ms[next_launch] = ms_between(first_gradient, Clock::now());
    in_flight[next_launch] = world.all_reduce_async(
        bucket.buffer(), ReduceOp::Sum,
        str("all_reduce of ", describe_bucket(next_launch)));
    stats.last.bytes_reduced += bucket.bytes();
    ++next_launch;
  }
}

void Reducer::State::finalize() {
  std::lock_guard<std::mutex> lock(mutex);
  struct CloseIteration {
    State& state;
    ~CloseIteration() {
      state.iteration_open = false;
      state.forward_seen = false;
      state.unused_at_forward.reset();
    }
  } close{*this};
  if (!iteration_sync) {
    return;
  }
  auto backward_end = Clock::now();

  for (size_t index = 0; index < params.size(); ++index) {
    if (ready[index]) {
      continue;
    }
    if (static_used && (*static_used)[index]) {
      problems.push_back(str(
          "parameter '", names[index], "' got no gradient in iteration ",
          iteration, " but did in the first one, which static_graph froze."));
    }
    mark_ready(index, /*used=*/false);
  }
  launch_ready_buckets(/*include_last=*/true);
  TORCH_INTERNAL_ASSERT(next_launch == buckets.size(), "a bucket was not launched");

  auto wait_start = Clock::now();
  for (auto& work : in_flight) {
    work->wait();
  }
  auto wait_end = Clock::now();

  std::vector<double> global_flags;
  int64_t ranks_with_problems = 0;
  bool buffers_changed = false;
  for (const auto& bucket : buckets) {
    auto flags = bucket.flags().to(at::kDouble);
    auto* data = flags.data_ptr<double>();
    global_flags.insert(global_flags.end(), data, data + flags.numel());
  }
  if (!buckets.empty()) {
    auto extras = buckets.back().extras().to(at::kDouble);
    buffers_changed = extras[kBuffersChanged].item<double>() > 0;
    ranks_with_problems = static_cast<int64_t>(extras[kProblems].item<double>());
  }
  if (ranks_with_problems > 0) {
    raise_problems_everywhere(ranks_with_problems);
  }
  buffers_need_broadcast = buffers_need_broadcast || buffers_changed;
  write_back(global_flags);
  used_since_sync.assign(params.size(), 0);

  stats.unused_parameters.clear();
  for (size_t index = 0; index < params.size(); ++index) {
    if (!used_now[index]) {
      stats.unused_parameters.push_back(names[index]);
    }
  }
  if (!rebuilt) {
    rebuild_buckets();
  }
  if (options.static_graph() && !static_used) {
    static_used = used_now;
  }

  stats.iterations += 1;
  auto backward_start = forward_seen ? forward_end : first_gradient;
  stats.last.backward_ms = ms_between(backward_start, Clock::now());
  stats.last.comm_wait_ms = ms_between(wait_start, wait_end);
  stats.total.backward_ms += stats.last.backward_ms;
  stats.total.comm_wait_ms += stats.last.comm_wait_ms;
  stats.total.bytes_reduced += stats.last.bytes_reduced;
  stats.bucket_launch_ms = launch_ms;
  stats.backward_end_ms = ms_between(first_gradient, backward_end);
}

void Reducer::State::raise_problems_everywhere(int64_t ranks_with_problems) {
  // Every rank learned the count from the same all-reduce, so every rank
  // is here: gathering the texts is safe, and every rank raises the same.
  std::string mine;
  for (const auto& problem : problems) {
    mine += (mine.empty() ? "" : "\n    ") + problem;
  }
  auto texts = world.all_gather_strings(mine);
  std::ostringstream message;
  message << "iteration " << iteration << " broke a rule on "
          << ranks_with_problems << " rank(s):";
  for (size_t rank = 0; rank < texts.size(); ++rank) {
    if (!texts[rank].empty()) {
      message << "\n  rank " << rank << ": " << texts[rank];
    }
  }
  LOCKSTEP_FAIL(UsageError, message.str());
}

void Reducer::State::write_back(const std::vector<double>& global_flags) {
  at::NoGradGuard no_grad;
  size_t flag = 0;
  for (auto& bucket : buckets) {
    bucket.gradients().div_(world.size());
    for (size_t k = 0; k < bucket.members().size(); ++k, ++flag) {
      if (global_flags[flag] == 0) {
        continue; // used by no rank: its gradient stays as it was
      }
      size_t index = bucket.members()[k];
      auto& grad = params[index].mutable_grad();
      auto slot = bucket.slot(k);
      bool as_view = options.gradient_as_bucket_view() &&
          params[index].is_contiguous();
      if (bucket.holds(k, grad)) {
        continue;
      } else if (as_view) {
        grad = slot;
      } else if (grad.defined()) {
        grad.copy_(slot);
      } else {
        grad = slot.clone();
      }
    }
  }
}

void Reducer::State::rebuild_buckets() {
  // Rank 0's ready order, so that every rank lays out the same buckets;
  // parameters that were not ready there go last.
  rebuilt = true;
  stats.buckets_rebuilt = true;
  auto order = at::empty({static_cast<int64_t>(params.size())}, at::kLong);
  if (world.rank() == 0) {
    std::vector<char> placed(params.size(), 0);
    int64_t position = 0;
    auto* data = order.data_ptr<int64_t>();
    for (size_t index : ready_order) {
      if (!placed[index]) {
        placed[index] = 1;
        data[position++] = static_cast<int64_t>(index);
      }
    }
    for (size_t index : reverse_registration_order()) {
      if (!placed[index]) {
        data[position++] = static_cast<int64_t>(index);
      }
    }
  }
  world.broadcast(order, 0);
  std::vector<size_t> agreed(order.data_ptr<int64_t>(),
                             order.data_ptr<int64_t>() + order.numel());
  layout_buckets(agreed);
}

} // namespace lockstep::detail
