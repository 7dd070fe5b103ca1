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
      "statistics, broadcast with the buffers) under fault tolerance.");
  LOCKSTEP_ENFORCE(
      !state.options.shard_gradients(), UsageError, "lockstep::FaultTolerance cannot take "
      "DdpOptions::shard_gradients: a failed rank takes its shard of the gradients and of "
      "the optimizer's state with it. Use ZeRO-1 (shard_gradients off) under fault "
      "tolerance.");
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
  // The old buckets live in the old world's memory: they go first, with
  // the gradients that are views into them (the step they belonged to is
  // over: committed and stepped, or dropped), so that a change of world
  // never holds the gradients twice (once more the model's size, on every
  // rank) while the old world is let go of.
  {
    at::NoGradGuard no_grad;
    for (size_t index = 0; index < state.layout.bucket_of.size() && !state.layout.buckets.empty();
         ++index) {
      auto& grad = state.params[index].mutable_grad();
      if (!state.sparse[index] &&
          state.layout.buckets[state.layout.bucket_of[index]].holds(state.layout.slot_of[index],
                                                                    grad)) {
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
  // Buckets live in the world's memory (the shared segment of its ranks);
  // laid out as at construction, they follow the first iteration's order
  // again, the same on every rank.
  state.layout.rebuilt = false;
  state.layout_buckets(state.dense_only(state.reverse_registration_order()));
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
