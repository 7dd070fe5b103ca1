#include <lockstep/clip_grad_norm.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include <lockstep/error.h>

namespace lockstep {

double clip_grad_norm_(const std::vector<at::Tensor>& parameters,
                       double max_norm,
                       World& world,
                       const ClipGradNormOptions& options) {
  double p = options.norm_type();
  bool largest = std::isinf(p) && p > 0;
  // Checked before the collective, and alike on every rank (the options are
  // the program's): no rank is left waiting for one that raised.
  LOCKSTEP_ENFORCE(largest || (std::isfinite(p) && p > 0), UsageError,
                   "clip_grad_norm_: norm_type ", p, " is not supported; a finite p > 0, or "
                   "infinity (the largest magnitude).");
  std::vector<at::Tensor> grads;
  for (const auto& param : parameters) {
    if (param.grad().defined()) {
      grads.push_back(param.grad());
    }
  }
  // This rank's share: the largest magnitude, or the sum of |g|^p, each
  // gradient's norm taken as torch takes it and the sum in float64, so that
  // the order in which the ranks add does not show at float32.
  // A NaN travels beside the largest magnitude as a flag: a maximum may
  // drop it, where a sum keeps it.
  double share = 0;
  double nan = 0;
  for (const auto& grad : grads) {
    double norm = (largest ? grad.data().abs().max() : grad.data().norm(p))
                      .item<double>();
    if (std::isnan(norm)) {
      nan = 1;
    }
    share = largest ? std::max(share, norm) : share + std::pow(norm, p);
  }
  auto total = at::tensor({share, nan}, at::kDouble);
  world.all_reduce(total, largest ? ReduceOp::Max : ReduceOp::Sum);
  double norm = total[1].item<double>() > 0 ? std::nan("")
      : largest                             ? total[0].item<double>()
                                            : std::pow(total[0].item<double>(), 1.0 / p);
  // The same text as torch's, raised on every rank alike.
  TORCH_CHECK(!options.error_if_nonfinite() || std::isfinite(norm), "The total norm of order ",
              p, " for gradients from `parameters` is non-finite, so it cannot be clipped. "
              "To disable this error and scale the gradients with the non-finite norm anyway, "
              "set error_if_nonfinite(false)");
  // Multiplied by 1 when within max_norm, and by NaN when the norm is NaN,
  // as torch's clamp does.
  double coefficient = std::min(max_norm / (norm + 1e-6), 1.0);
  for (auto& grad : grads) {
    // Through .data(), as torch does: a graph that saved the gradient
    // (create_graph) is not told of the write.
    grad.data().mul_(coefficient);
  }
  return norm;
}

} // namespace lockstep
