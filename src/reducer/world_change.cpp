// What lockstep::FaultTolerance asks of the reducer: to end an iteration
// quietly when a rank fails in it, and to go on in the world that the
// survivors form. The reducer learns only "this iteration did not commit";
// who failed and how the world re-forms is world/'s and fault/'s.

#include "fault/guarded.h"
#include "reducer/reducer_state.h"

namespace lockstep::detail {

void Reducer::tolerate_failures() {
  auto& state = *state_;
  std::lock_guard<std::mutex> lock(state.mutex);
  LOCKSTEP_ENFORCE(
      !state.in_backward_step, UsageError, "lockstep::FaultTolerance cannot take a wrapper "
      "that steps inside backward (ddp.step_in_backward): a step whose reduction fails on "
      "another rank must leave the parameters untouched, and these would have stepped "
      "already. Call optimizer.step() when ft.commit() returns true instead.");
  LOCKSTEP_ENFORCE(
      !state.joining, UsageError, "lockstep::FaultTolerance cannot run inside a join guard: "
      "it gives each step's batch to the ranks that take part (lockstep::StepSampler), so "
      "no rank runs out of data before the others.");
  LOCKSTEP_ENFORCE(
      !state.communicates_in_forward, UsageError, "lockstep::FaultTolerance cannot take a "
      "model with SyncBatchNorm: its statistics are reduced in forward, in the world the "
      "module was converted with, which a failure replaces. Use BatchNorm (each rank's "
      "statistics, broadcast with the buffers) under fault tolerance, or SyncBatchNorm "
      "inside replica groups (FaultTolerance(replica_groups(world, k), ...), the DDP over "
      "groups.replica): a group fails and returns whole.");
  LOCKSTEP_ENFORCE(
      !state.options.shard_gradients(), UsageError, "lockstep::FaultTolerance cannot take "
      "DdpOptions::shard_gradients: a failed rank takes its shard of the gradients and of "
      "the optimizer's state with it. Shard inside replica groups instead "
      "(FaultTolerance(replica_groups(world, k), ...), the DDP and the "
      "ZeroRedundancyOptimizer over groups.replica): the other groups hold each shard.");
  state.tolerating = true;
}

std::string Reducer::take_failure() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return std::exchange(state_->failure, std::string());
}

int64_t Reducer::synchronised_backwards() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->iteration;
}

World Reducer::world() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->world;
}

void Reducer::adopt_world(World world) {
  auto& state = *state_;
  std::lock_guard<std::mutex> lock(state.mutex);
  TORCH_INTERNAL_ASSERT(!state.backward.open, "a world is adopted between iterations");
  // The old buckets live in the old world's memory: they go first, so
  // that a change of world never holds them twice (once more the model's
  // size, on every rank) while the old world is let go of. The gradients
  // of the step that is over (committed and stepped, or dropped) become
  // views into the new buckets, zeroed: the views into the old ones, and
  // those a dropped backward left apart from them (autograd's own, which
  // would otherwise live on beside the new buckets until the next
  // backward replaced them). The next backward accumulates into them in
  // place, as in any step.
  std::vector<char> had_view(state.params.size(), 0);
  {
    at::NoGradGuard no_grad;
    for (size_t index = 0; index < state.layout.bucket_of.size() && !state.layout.buckets.empty();
         ++index) {
      auto& grad = state.params[index].mutable_grad();
      bool as_view = state.options.gradient_as_bucket_view() &&
          state.params[index].is_contiguous();
      if (!state.sparse[index] && grad.defined() &&
          (as_view || state.layout.buckets[state.layout.bucket_of[index]].holds(
                          state.layout.slot_of[index], grad))) {
        had_view[index] = 1;
        grad = at::Tensor();
      }
    }
    state.layout.buckets.clear();
  }
  state.world = std::move(world);
  state.adopted_unchecked = true;
  state.backward = State::Backward{};
  state.active_ranks = state.world.size();
  state.buffer_root = 0;
  state.failure.clear();
  // Buckets live in the world's memory (the shared segment of its ranks).
  // In the order an earlier world's first backward taught, where a rank
  // knows it: laid out once, not again after the first backward here,
  // which would hold the gradients twice for a moment. Otherwise as at
  // construction, to follow this world's first backward, the same on
  // every rank.
  if (!state.adopt_learned_order()) {
    state.layout.rebuilt = false;
    state.layout_buckets(state.dense_only(state.reverse_registration_order()));
  }
  at::NoGradGuard no_grad;
  state.layout.zeroed_by_world_change.assign(state.params.size(), 0);
  for (size_t index = 0; index < had_view.size() && !state.layout.buckets.empty(); ++index) {
    auto& bucket = state.layout.buckets[state.layout.bucket_of[index]];
    auto k = state.layout.slot_of[index];
    if (had_view[index] && k < bucket.members().size() && bucket.members()[k] == index) {
      auto slot = bucket.slot(k);
      slot.zero_();
      state.params[index].mutable_grad() = slot;
      state.layout.zeroed_by_world_change[index] = 1;
    }
  }
}

bool Reducer::State::adopt_learned_order() {
  if (options.shard_gradients()) {
    return false;
  }
  bool learned = layout.learned.size() == params.size();
  auto knows = at::full({1}, learned ? int64_t{world.rank()} : int64_t{-1}, at::kLong);
  world.all_reduce(knows, ReduceOp::Max);
  auto source = knows.item<int64_t>();
  if (source < 0) {
    return false;
  }
  // As rebuild_buckets() sends it: the order, then the bucket cap in bytes.
  auto order = at::empty({static_cast<int64_t>(params.size()) + 1}, at::kLong);
  if (world.rank() == source) {
    auto* data = order.data_ptr<int64_t>();
    for (size_t k = 0; k < params.size(); ++k) {
      data[k] = static_cast<int64_t>(layout.learned[k]);
    }
    data[params.size()] = static_cast<int64_t>(*options.bucket_cap_mb() * (1 << 20));
  }
  lay_out_agreed_order(order, static_cast<int>(source));
  return true;
}

std::vector<at::Tensor> Reducer::replica_tensors(bool buffers_only) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  std::vector<at::Tensor> tensors;
  for (const auto& entry : state_->all_params) {
    if (!buffers_only) {
      tensors.push_back(entry.tensor);
    }
  }
  for (const auto& entry : state_->named_buffers) {
    tensors.push_back(entry.tensor);
  }
  return tensors;
}

} // namespace lockstep::detail

namespace lockstep::detail {
namespace {

class GuardedReducer final : public Guarded {
 public:
  explicit GuardedReducer(std::shared_ptr<Reducer> reducer) : reducer_(std::move(reducer)) {}
  World world() const override {
    return reducer_->world();
  }
  void tolerate_failures() override {
    reducer_->tolerate_failures();
  }
  std::string take_failure() override {
    return reducer_->take_failure();
  }
  int64_t synchronisations() const override {
    return reducer_->synchronised_backwards();
  }
  void adopt_world(World world) override {
    reducer_->adopt_world(std::move(world));
  }
  std::vector<at::Tensor> replica_tensors(bool buffers_only) const override {
    return reducer_->replica_tensors(buffers_only);
  }

 private:
  std::shared_ptr<Reducer> reducer_;
};

} // namespace

std::shared_ptr<Guarded> guard(std::shared_ptr<Reducer> reducer) {
  return std::make_shared<GuardedReducer>(std::move(reducer));
}

} // namespace lockstep::detail
