// Uneven inputs. Inside a join guard every forward begins with an agreement
// (an all-reduce of one flag per rank, plus the count of ranks whose
// backward will synchronise). A rank that ran out of batches keeps taking
// part in it, and in what follows it on the others: the buffer agreement and
// broadcast, and, when a synchronised backward follows, the very iteration
// the others run (the same finalize, the same buckets in the same order),
// with zero gradients. So every rank issues the same collectives, and the
// ranks still training need not know who ran out, except to divide.

#include <sstream>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/optimizer.h>

#include <lockstep/zero_redundancy_optimizer.h>

#include "optim/optimizer_bytes.h"
#include "reducer/reducer_state.h"
#include "world/broadcast_bytes.h"
#include "world/rendezvous.h"

namespace lockstep::detail {
namespace {

std::string ranks_named(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + rank_list(ranks);
}

// Overwrites `optimizer`'s state with rank `root`'s.
void broadcast_optimizer(World& world, int root, torch::optim::Optimizer& optimizer,
                         size_t index) {
  std::string bytes = world.rank() == root ? optimizer_bytes(optimizer) : std::string();
  broadcast_bytes(world, root, bytes,
                  str("rank ", root, "'s state of optimizer ", index, " at the end of the join"));
  if (world.rank() != root) {
    load_optimizer_bytes(optimizer, bytes);
  }
}

} // namespace

bool Reducer::State::agree_on_join(bool training_here, bool backward_follows) {
  int n = world.size();
  auto flags = at::zeros({n + 1}, at::kInt);
  if (training_here) {
    flags[world.rank()] = 1;
    flags[n] = backward_follows ? 1 : 0;
  }
  world.all_reduce_async(flags, ReduceOp::Sum, str("join agreement before forward ", forwards + 1))
      .wait();
  stats.last.join_agreements += 1;
  stats.total.join_agreements += 1;
  const auto* agreed = flags.data_ptr<int>();
  std::vector<int> training;
  std::vector<int> out;
  for (int rank = 0; rank < n; ++rank) {
    (agreed[rank] > 0 ? training : out).push_back(rank);
  }
  if (training.empty()) {
    return false;
  }
  LOCKSTEP_ENFORCE(
      agreed[n] == 0 || agreed[n] == static_cast<int>(training.size()), UsageError,
      "rank ", world.rank(), ": before forward ", forwards + 1, ", ", agreed[n], " of the ",
      training.size(), " ranks still training will synchronise gradients in backward and "
      "the others will not (no_sync() or NoGradGuard on some ranks only): every rank must "
      "run the same kind of iteration.");
  LOCKSTEP_ENFORCE(
      out.empty() || !joining->options.throw_on_early_termination(), UsageError,
      "rank ", world.rank(), ": ", ranks_named(out), " ran out of batches before forward ",
      forwards + 1, " while ", ranks_named(training), " still had some. "
      "JoinOptions::throw_on_early_termination asks for this error on every rank at the same "
      "forward; without it, the ranks that ran out would run the others' iterations with zero "
      "gradients until every rank had finished.");
  joining->last_active = training;
  joining->backward_follows = agreed[n] > 0;
  active_ranks = static_cast<int>(training.size());
  buffer_root = training.front();
  return true;
}

int Reducer::State::gradient_divisor() const {
  bool by_active = joining && !joining->options.divide_by_initial_world_size();
  return by_active ? active_ranks : world.size();
}

void Reducer::enter_join(const JoinOptions& options) {
  auto& state = *state_;
  std::lock_guard<std::mutex> lock(state.mutex);
  LOCKSTEP_ENFORCE(
      !state.communicates_in_forward, UsageError, "a join guard cannot keep a model with "
      "SyncBatchNorm in step: SyncBatchNorm communicates in every forward and backward, and a "
      "rank that ran out of batches has no forward to run (with PyTorch, such a job hangs). "
      "Give every rank the same number of batches, or use BatchNorm, whose buffers the guard "
      "keeps in step.");
  LOCKSTEP_ENFORCE(!state.options.shard_gradients(), UsageError, "a join guard cannot keep "
                   "DdpOptions::shard_gradients in step yet: a rank that ran out of batches "
                   "would have to step its shard with the others'. Give every rank the same "
                   "number of batches (DistributedSampler's drop_last), or leave "
                   "shard_gradients off.");
  LOCKSTEP_ENFORCE(!state.joining, UsageError,
                   "a join guard is already active for this DistributedDataParallel; "
                   "one guard around the training loop is enough.");
  LOCKSTEP_ENFORCE(
      options.divide_by_initial_world_size() || !state.comm_hook, UsageError,
      "JoinOptions::divide_by_initial_world_size(false) divides by the ranks still training, "
      "which a communication hook does not know (nor a 16-bit reduce_dtype of the "
      "mixed-precision policy, which travels through one): it divides by the world size. "
      "Keep the default, or do without the hook.");
  state.joining = State::Joining{options, {}, false};
}

void Reducer::leave_join() {
  auto& state = *state_;
  std::lock_guard<std::mutex> lock(state.mutex);
  state.joining.reset();
  state.active_ranks = state.world.size();
  state.buffer_root = 0;
}

void Reducer::finish_join() {
  auto& state = *state_;
  struct Leave {
    Reducer& reducer;
    ~Leave() {
      reducer.leave_join();
    }
  } leave{*this};
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    if (!state.joining) {
      return;
    }
  }
  while (true) {
    {
      std::lock_guard<std::mutex> lock(state.mutex);
      if (!state.agree_on_join(/*training_here=*/false, /*backward_follows=*/false)) {
        break;
      }
      // The others' forward: its buffer sync, then its backward's iteration.
      state.sync_buffers_as_configured();
      ++state.forwards;
      if (!state.joining->backward_follows) {
        continue;
      }
      state.backward.shadowing = true;
      state.open_iteration(state.forwards, /*sync=*/true);
    }
    state.finalize();
    if (!state.in_backward_step) {
      // A sharded optimizer's step is collective: this rank steps its shard
      // with the others' average, as they do.
      for (auto* optimizer : state.joining->options.optimizers()) {
        if (auto* sharded = dynamic_cast<ShardedOptimizer*>(optimizer)) {
          sharded->step();
        }
      }
    }
  }
  std::lock_guard<std::mutex> lock(state.mutex);
  const auto& last = state.joining->last_active;
  if (last.empty()) {
    return; // no rank ran a forward inside the guard: nothing diverged
  }
  // The last ranks to finish trained on every iteration and agree; the
  // others lag by the iterations they shadowed.
  int root = last.front();
  std::vector<at::Tensor> model;
  for (const auto& entry : state.all_params) {
    model.push_back(entry.tensor);
  }
  model.insert(model.end(), state.buffers.begin(), state.buffers.end());
  broadcast_from(state.world, root, model,
                 str("rank ", root, "'s parameters and buffers at the end of the join"));
  for (size_t i = 0; i < state.buffers.size(); ++i) {
    state.buffer_versions[i] = state.buffers[i]._version();
  }
  if (state.in_backward_step) {
    state.note_parameter_versions();
  }
  // A sharded optimizer stepped along on every rank: each shard is current.
  const auto& optimizers = state.joining->options.optimizers();
  for (size_t i = 0; i < optimizers.size(); ++i) {
    if (dynamic_cast<ShardedOptimizer*>(optimizers[i]) == nullptr) {
      broadcast_optimizer(state.world, root, *optimizers[i], i);
    }
  }
}

} // namespace lockstep

namespace lockstep {

JoinGuard::JoinGuard(std::shared_ptr<detail::Reducer> reducer, const JoinOptions& options)
    : reducer_(std::move(reducer)), exceptions_at_start_(std::uncaught_exceptions()) {
  reducer_->enter_join(options);
}

JoinGuard::JoinGuard(JoinGuard&& other) noexcept
    : reducer_(std::move(other.reducer_)), exceptions_at_start_(other.exceptions_at_start_) {}

JoinGuard::~JoinGuard() noexcept(false) {
  if (!reducer_) {
    return;
  }
  if (std::uncaught_exceptions() > exceptions_at_start_) {
    reducer_->leave_join();
    return;
  }
  finish();
}

void JoinGuard::finish() {
  if (auto reducer = std::move(reducer_)) {
    reducer->finish_join();
  }
}

} // namespace lockstep
