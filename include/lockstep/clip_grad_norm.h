#pragma once

// Gradient clipping by the norm of every rank's gradients together, for
// gradients that are sharded across the ranks (each rank holds some of the
// parameters, or a slice of each): torch::nn::utils::clip_grad_norm_ over
// one rank's shard would clip by that shard's norm alone, and each rank by
// a different factor. Under plain DDP every rank holds every averaged
// gradient, and torch's own function is the right one.

#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <lockstep/world.h>

namespace lockstep {

struct ClipGradNormOptions {
  /// The p of the p-norm: any finite p > 0, or infinity for the largest
  /// magnitude. (torch::nn::utils::clip_grad_norm_ also takes 0, which
  /// counts the gradients, and negative p; refused here with UsageError.)
  TORCH_ARG(double, norm_type) = 2.0;
  /// Raise (c10::Error, on every rank alike) instead of clipping when the
  /// total norm is infinite or NaN.
  TORCH_ARG(bool, error_if_nonfinite) = false;
};

/// Collective: every rank of `world` calls it, each with the parameters of
/// its own shard (none is allowed). Computes the norm of all ranks'
/// gradients together, scales every gradient by max_norm / (norm + 1e-6)
/// where that is below 1, and returns the total norm, the same on every
/// rank: what torch::nn::utils::clip_grad_norm_ does on one process holding
/// every gradient: within float64 rounding for float64 gradients; for
/// float32 ones the total is summed in float64, where torch combines the
/// norms in float32, so the two differ at float32 rounding. Parameters
/// without a gradient are skipped, as there. A failure on one rank (a
/// sparse gradient's largest magnitude, say) raises on every rank.
double clip_grad_norm_(const std::vector<at::Tensor>& parameters,
                       double max_norm,
                       World& world,
                       const ClipGradNormOptions& options = {});

} // namespace lockstep
