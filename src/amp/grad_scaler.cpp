// lockstep::amp::GradScaler (grad_scaler.h): PyTorch's GradScaler, step for
// step. The scale is a float32, as PyTorch keeps it (a float32 tensor), and
// updated as at::_amp_update_scale_ does: its product with a double
// factor, stored back in float32. Gradients are multiplied by the
// reciprocal computed in double and rounded to float32, as unscale_ does;
// a gradient with an inf or a NaN is multiplied all the same.

#include <lockstep/grad_scaler.h>

#include <cmath>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <lockstep/error.h>
#include <lockstep/zero_redundancy_optimizer.h>

#include "fault/scaler_registry.h"
#include "optim/gradient_placement.h"

namespace lockstep::amp {

GradScaler::GradScaler(GradScalerOptions options)
    : options_(options), scale_(static_cast<float>(options.init_scale())) {
  LOCKSTEP_ENFORCE(options.init_scale() > 0 && std::isfinite(options.init_scale()), ConfigError,
                   "GradScalerOptions::init_scale must be positive and finite, not ",
                   options.init_scale(), ".");
  LOCKSTEP_ENFORCE(options.growth_factor() > 1.0, ConfigError,
                   "GradScalerOptions::growth_factor should be > 1, not ",
                   options.growth_factor(), ".");
  LOCKSTEP_ENFORCE(options.backoff_factor() < 1.0 && options.backoff_factor() > 0, ConfigError,
                   "GradScalerOptions::backoff_factor should be within (0, 1), not ",
                   options.backoff_factor(), ".");
  LOCKSTEP_ENFORCE(options.growth_interval() > 0, ConfigError,
                   "GradScalerOptions::growth_interval should be positive, not ",
                   options.growth_interval(), ".");
}

at::Tensor GradScaler::scale(const at::Tensor& outputs) const {
  if (!options_.enabled()) {
    return outputs;
  }
  // A 0-dim float32 tensor, as PyTorch's: a float16 loss (0-dim) becomes a
  // float32 one, float16 outputs with dimensions stay float16.
  return outputs * at::scalar_tensor(scale_, outputs.options().dtype(at::kFloat));
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    return;
  }
  auto& state = per_optimizer_[&optimizer];
  LOCKSTEP_ENFORCE(state.stage != Stage::Unscaled, UsageError,
                   "unscale_() has already been called on this optimizer since the last "
                   "update().");
  LOCKSTEP_ENFORCE(state.stage != Stage::Stepped, UsageError,
                   "unscale_() is being called after step().");
  // Ranks that each hold a shard of the gradients (ZeRO, ZeRO-2, FSDP) must
  // skip alike, whatever inf or NaN their own shard holds.
  auto placement = detail::gradient_placement(optimizer);
  auto flag = unscale_gradients(placement.holders);
  if (placement.sharded_across) {
    placement.sharded_across->all_reduce(flag, ReduceOp::Max);
  }
  state.found_inf = flag.item<float>() > 0;
  state.stage = Stage::Unscaled;
}

at::Tensor GradScaler::unscale_gradients(const std::vector<at::Tensor>& parameters) const {
  auto inverse = static_cast<float>(1.0 / static_cast<double>(scale_));
  // Whether any gradient holds an inf or a NaN, kept on the gradients'
  // device and read once by the caller: no host sync per parameter, as
  // PyTorch's _amp_foreach_non_finite_check_and_unscale_.
  at::Tensor nonfinite;
  auto note = [&nonfinite](const at::Tensor& values) {
    auto here = at::logical_not(at::isfinite(values)).any();
    nonfinite = nonfinite.defined() ? at::logical_or(nonfinite, here.to(nonfinite.device()))
                                    : here;
  };
  at::NoGradGuard no_grad;
  for (auto parameter : parameters) {
    auto& grad = parameter.mutable_grad();
    if (!grad.defined()) {
      continue;
    }
    LOCKSTEP_ENFORCE(grad.scalar_type() != at::kHalf, UsageError,
                     "Attempting to unscale FP16 gradients: keep the parameters in float32 "
                     "(autocast, or DDP's mixed-precision policy, computes in 16 bits).");
    if (grad.is_sparse()) {
      grad = grad.coalesce();
      note(grad._values());
      grad._values().mul_(inverse);
      continue;
    }
    note(grad);
    grad.mul_(at::scalar_tensor(inverse, grad.options().dtype(at::kFloat)));
  }
  // A float32 flag on the CPU, where every transport reduces it.
  return nonfinite.defined() ? nonfinite.to(at::kCPU, at::kFloat).reshape({1})
                             : at::zeros({1}, at::kFloat);
}

bool GradScaler::unscale_for_step_in_backward(const std::vector<at::Tensor>& parameters) {
  if (!options_.enabled()) {
    return false;
  }
  auto& state = per_optimizer_[nullptr];
  LOCKSTEP_ENFORCE(state.stage == Stage::Ready, UsageError,
                   "a second synchronised backward stepped inside backward without "
                   "scaler.update() in between: call scaler.update() after each backward "
                   "whose optimizer steps inside it (StepInBackwardOptions::grad_scaler).");
  state.found_inf = unscale_gradients(parameters).item<float>() > 0;
  state.stage = Stage::Stepped;
  return state.found_inf;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return true;
  }
  detail::require_scaler_carried(optimizer, *this);
  auto& state = per_optimizer_[&optimizer];
  LOCKSTEP_ENFORCE(state.stage != Stage::Stepped, UsageError,
                   "step() has already been called since the last update().");
  if (state.stage == Stage::Ready) {
    unscale_(optimizer);
  }
  auto& after = per_optimizer_[&optimizer];
  bool steps = !after.found_inf;
  if (steps) {
    optimizer.step();
  } else if (auto* sharded = dynamic_cast<detail::ShardedOptimizer*>(&optimizer)) {
    if (sharded->gradients_sharded()) {
      sharded->discard_gradients(); // skipped: the inf goes with them
    }
  }
  after.stage = Stage::Stepped;
  return steps;
}

void GradScaler::update() {
  if (!options_.enabled()) {
    return;
  }
  LOCKSTEP_ENFORCE(!per_optimizer_.empty(), UsageError,
                   "No inf checks were recorded prior to update(): call step() (or "
                   "unscale_()) on an optimizer before update().");
  bool found = false;
  for (const auto& [optimizer, state] : per_optimizer_) {
    found = found || state.found_inf;
  }
  if (found) {
    scale_ = static_cast<float>(scale_ * options_.backoff_factor());
    growth_tracker_ = 0;
  } else if (growth_tracker_ + 1 == options_.growth_interval()) {
    auto grown = static_cast<float>(scale_ * options_.growth_factor());
    if (std::isfinite(grown)) {
      scale_ = grown;
    }
    growth_tracker_ = 0;
  } else {
    ++growth_tracker_;
  }
  per_optimizer_.clear();
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled()) {
    return;
  }
  scale_ = static_cast<float>(new_scale);
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  return options_.enabled() ? static_cast<double>(scale_) : 1.0;
}

int64_t GradScaler::growth_tracker() const {
  return growth_tracker_;
}

void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("scale", at::scalar_tensor(scale_, at::kFloat));
  archive.write("growth_factor", at::scalar_tensor(options_.growth_factor(), at::kDouble));
  archive.write("backoff_factor", at::scalar_tensor(options_.backoff_factor(), at::kDouble));
  archive.write("growth_interval", at::scalar_tensor(options_.growth_interval(), at::kLong));
  archive.write("_growth_tracker", at::scalar_tensor(growth_tracker_, at::kLong));
}

void GradScaler::load(torch::serialize::InputArchive& archive) {
  // A fresh tensor per value: InputArchive::read into a defined tensor
  // sets that tensor's storage, whatever its type.
  auto value = [&archive](const char* key) {
    at::Tensor read;
    archive.read(key, read);
    return read;
  };
  scale_ = value("scale").item<float>();
  options_.growth_factor(value("growth_factor").item<double>());
  options_.backoff_factor(value("backoff_factor").item<double>());
  options_.growth_interval(value("growth_interval").item<int64_t>());
  growth_tracker_ = value("_growth_tracker").item<int64_t>();
  per_optimizer_.clear();
}

} // namespace lockstep::amp
