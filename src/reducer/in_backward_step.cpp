// ddp.step_in_backward: the optimizer steps each bucket's parameters once
// that bucket's average is written back (bucket_reduction.cpp waits for
// them in turn), while the later buckets' reductions go on. What steps is a
// ParameterStep: any torch::optim optimizer through step_parameters, or a
// ZeroRedundancyOptimizer's shard step, which also brings the new
// parameters to every rank. The reducer does not know which.

#include <unordered_set>

#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/optimizer.h>

#include <lockstep/grad_scaler.h>
#include <lockstep/zero_redundancy_optimizer.h>

#include "reducer/reducer_state.h"

namespace lockstep::detail {

void Reducer::step_in_backward(ParameterStep step, const StepInBackwardOptions& options) {
  LOCKSTEP_ENFORCE(!state_->options.shard_gradients(), UsageError, "under DdpOptions::"
                   "shard_gradients no rank holds a whole gradient to give a ParameterStep: "
                   "call step_in_backward with the ZeroRedundancyOptimizer that keeps the "
                   "shards.");
  state_->set_step_in_backward(std::move(step), options);
}

void Reducer::State::set_step_in_backward(ParameterStep step,
                                          const StepInBackwardOptions& options) {
  auto& state = *this;
  std::lock_guard<std::mutex> lock(state.mutex);
  LOCKSTEP_ENFORCE(step != nullptr, UsageError, "step_in_backward needs an optimizer or a "
                   "ParameterStep that steps the parameters it is given.");
  state.require_before_first_forward(
      "step_in_backward", "every rank must step its parameters in the same iterations");
  LOCKSTEP_ENFORCE(
      !state.tolerating, UsageError, "step_in_backward cannot be used under "
      "lockstep::FaultTolerance: a step whose reduction fails on another rank must leave the "
      "parameters untouched, and these would have stepped already. Call optimizer.step() when "
      "ft.commit() returns true instead.");
  LOCKSTEP_ENFORCE(!state.in_backward_step, UsageError, "an optimizer already steps inside "
                   "backward for this DistributedDataParallel; registering a second would "
                   "step every parameter twice. Register one, once.");
  LOCKSTEP_ENFORCE(!options.max_grad_norm() || *options.max_grad_norm() > 0, UsageError,
                   "StepInBackwardOptions::max_grad_norm must be positive, not ",
                   *options.max_grad_norm(), ".");
  state.in_backward_step = State::InBackwardStep{std::move(step), options, {}, {}, {}};
}

void Reducer::step_in_backward(torch::optim::Optimizer& optimizer,
                               const StepInBackwardOptions& options) {
  if (state_->options.shard_gradients()) {
    LOCKSTEP_ENFORCE(
        !options.max_grad_norm() && options.grad_scaler() == nullptr, UsageError, "under "
        "DdpOptions::shard_gradients, step_in_backward does not clip or unscale yet: each "
        "rank holds its slice of the gradients only. Step after backward instead, with "
        "lockstep::clip_grad_norm_ over the optimizer's shard (optimizer.local_optimizer()'s "
        "parameters) and the world.");
    bool registered = false;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      registered = state_->gradient_shards.has_value();
      LOCKSTEP_ENFORCE(!registered || state_->gradient_shards->owner ==
                                          dynamic_cast<GradientShardOwner*>(&optimizer),
                       UsageError, "the optimizer given to step_in_backward is not the one "
                       "that keeps the gradient shards (shard_gradients_with): under "
                       "DdpOptions::shard_gradients it is the one that steps them.");
    }
    if (!registered) {
      shard_gradients_with(optimizer);
    }
  }
  std::unordered_set<const c10::TensorImpl*> mine;
  for (const auto& entry : state_->all_params) {
    mine.insert(entry.tensor.unsafeGetTensorImpl());
  }
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& param : group.params()) {
      LOCKSTEP_ENFORCE(
          mine.count(param.unsafeGetTensorImpl()) > 0,
          UsageError, "the optimizer given to step_in_backward holds a ", param.sizes(),
          " tensor that is not a parameter of the wrapped module: stepping inside backward "
          "steps the module's parameters as their buckets are averaged, and this one would "
          "never step. Give that tensor an optimizer of its own.");
    }
  }
  std::unordered_set<const c10::TensorImpl*> held;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& param : group.params()) {
      held.insert(param.unsafeGetTensorImpl());
    }
  }
  if (auto* sharded = dynamic_cast<ShardedOptimizer*>(&optimizer)) {
    sharded->steps_in_backward();
    state_->set_step_in_backward([sharded](const std::vector<at::Tensor>& params) {
      sharded->step_parameters(params);
    }, options);
  } else {
    state_->set_step_in_backward([&optimizer](const std::vector<at::Tensor>& params) {
      lockstep::step_parameters(optimizer, params);
    }, options);
  }
  // A parameter that another optimizer steps keeps its gradient.
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->in_backward_step->freed = std::move(held);
}

bool Reducer::State::steps_each_bucket() const {
  return in_backward_step && !comm_hook && !in_backward_step->options.max_grad_norm() &&
         in_backward_step->options.grad_scaler() == nullptr;
}

bool Reducer::State::steps_when_shadowing() const {
  if (in_backward_step) {
    return true;
  }
  if (joining) {
    for (auto* optimizer : joining->options.optimizers()) {
      if (dynamic_cast<ShardedOptimizer*>(optimizer) != nullptr) {
        return true;
      }
    }
  }
  return false;
}

void Reducer::State::step_parameters_of(const std::vector<size_t>& indices) {
  auto& stepping = *in_backward_step;
  stepping.stepped.resize(params.size(), 0);
  std::vector<at::Tensor> chosen;
  for (size_t index : indices) {
    if (!stepping.stepped[index]) {
      stepping.stepped[index] = 1;
      chosen.push_back(params[index]);
    }
  }
  if (!chosen.empty()) {
    auto start = Clock::now();
    stepping.step(chosen);
    stats.last.step_ms += ms_between(start, Clock::now());
    // Stepped: their gradients go, as PyTorch's _apply_optimizer_in_backward
    // frees them. A stray optimizer.step() after backward then finds none
    // and changes nothing (at the end of a loop no next forward would tell
    // of it), and the memory is free until the next backward.
    for (auto& param : chosen) {
      if (stepping.freed.empty() || stepping.freed.count(param.unsafeGetTensorImpl()) > 0) {
        param.mutable_grad().reset();
      }
    }
  }
}

void Reducer::State::finish_steps() {
  auto& stepping = *in_backward_step;
  stepping.stepped.resize(params.size(), 0);
  auto* scaler = stepping.options.grad_scaler();
  if (scaler == nullptr || !unscale_found_inf(*scaler)) {
    step_all_parameters();
  }
  // A rank that ran out of batches (join.cpp) has no loop left to call
  // update(): it updates here, as the others do after this backward, so
  // that its scale stays theirs.
  if (scaler != nullptr && backward.shadowing) {
    scaler->update();
  }
}

bool Reducer::State::unscale_found_inf(amp::GradScaler& scaler) {
  // Every rank reads the same averages, so every rank finds the same inf
  // and skips alike, without a collective. Only what this optimizer steps
  // is unscaled: another optimizer's parameters are its scaler.step's.
  const auto& freed = in_backward_step->freed;
  std::vector<at::Tensor> stepped_here;
  for (const auto& param : params) {
    if (freed.empty() || freed.count(param.unsafeGetTensorImpl()) > 0) {
      stepped_here.push_back(param);
    }
  }
  if (!scaler.unscale_for_step_in_backward(stepped_here)) {
    return false;
  }
  // Skipped: the inf goes with the gradients, as they would have gone once
  // stepped, so that the next backward does not add to it.
  for (auto& param : stepped_here) {
    param.mutable_grad().reset();
  }
  note_parameter_versions();
  return true;
}

void Reducer::State::step_all_parameters() {
  auto& stepping = *in_backward_step;
  if (stepping.options.max_grad_norm()) {
    torch::nn::utils::clip_grad_norm_(params, *stepping.options.max_grad_norm());
  }
  for (const auto& bucket : layout.buckets) {
    step_parameters_of(bucket.members());
  }
  // Sparse parameters, and those taken in at this iteration's end.
  std::vector<size_t> rest;
  for (size_t index = 0; index < params.size(); ++index) {
    rest.push_back(index);
  }
  step_parameters_of(rest);
  stepping.stepped.assign(params.size(), 0);
  note_parameter_versions();
}

void Reducer::State::check_no_step_outside() const {
  const auto& versions = in_backward_step->versions;
  for (size_t index = 0; index < versions.size() && index < params.size(); ++index) {
    LOCKSTEP_ENFORCE(
        params[index]._version() == versions[index], UsageError, "rank ", world.rank(),
        ": parameter '", names[index], "' changed in place after the step inside backward "
        "of iteration ", iteration, ": optimizer.step() was called although "
        "ddp.step_in_backward(optimizer) already stepped every parameter (a second step "
        "with the same gradients). Remove the call to optimizer.step(). (Anything else that "
        "writes the parameters in place between iterations is taken for such a step: do it "
        "before the first forward.)");
  }
}

void Reducer::State::note_parameter_versions() {
  auto& versions = in_backward_step->versions;
  versions.clear();
  for (const auto& param : params) {
    versions.push_back(param._version());
  }
}

} // namespace lockstep::detail
