#pragma once

// The optimizer inside the reduction: DistributedDataParallel::step_in_backward
// steps each bucket's parameters as soon as that bucket's average is
// written back, instead of one optimizer.step() over every parameter after
// backward. PyTorch's counterpart is the Python-only, experimental
// `_apply_optimizer_in_backward` / `DDP._register_fused_optim`. See
// docs/ddp.md.

#include <functional>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace lockstep {
namespace amp {
class GradScaler;
} // namespace amp

/// The per-parameter seam: steps `parameters`, whose .grad now holds the
/// average over ranks (after clipping, when asked). Called on the thread
/// that runs backward, once per bucket in bucket order, then once for the
/// parameters outside buckets (sparse ones, ones that began to require grad),
/// on every rank with the same parameters in the same order: a step that
/// communicates (ZeroRedundancyOptimizer's) may do so. Only on synchronised
/// backward passes (never under no_sync()).
using ParameterStep = std::function<void(const std::vector<at::Tensor>& parameters)>;

/// How step_in_backward steps.
struct StepInBackwardOptions {
  /// Clip the averaged gradients to this total 2-norm
  /// (torch::nn::utils::clip_grad_norm_ over every parameter of the
  /// module) before any parameter steps. Clipping needs the norm of every
  /// gradient, so every bucket's average is awaited first and the steps no
  /// longer overlap the reduction of later buckets. Unset: no clipping.
  TORCH_ARG(std::optional<double>, max_grad_norm) = std::nullopt;

 public:
  /// Loss scaling (grad_scaler.h): the averaged gradients are unscaled, and
  /// when any of them holds an inf or a NaN no parameter steps, on any rank
  /// (every rank reads the same averages). The loop scales the loss and
  /// calls scaler.update() after each synchronised backward. As with
  /// clipping, every bucket's average is awaited before the first step.
  /// Unset: no scaling.
  StepInBackwardOptions& grad_scaler(amp::GradScaler* scaler) {
    grad_scaler_ = scaler;
    return *this;
  }
  amp::GradScaler* grad_scaler() const {
    return grad_scaler_;
  }

 private:
  amp::GradScaler* grad_scaler_ = nullptr;
};

/// Steps only `parameters` of `optimizer` (its other parameters' gradients
/// are hidden from it meanwhile). For optimizers that treat each parameter
/// on its own, as every one in torch::optim but LBFGS does, this is exactly
/// what a full optimizer.step() does to those parameters.
void step_parameters(torch::optim::Optimizer& optimizer,
                     const std::vector<at::Tensor>& parameters);

} // namespace lockstep
