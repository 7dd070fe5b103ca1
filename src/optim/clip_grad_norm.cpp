#include <lockstep/clip_grad_norm.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <exception>

#include <lockstep/error.h>

namespace lockstep {

double clip_grad_norm_(const std::vector<at::Tensor>& parameters,
                       double max_norm,
                       World& world,
                       const ClipGradNormOptions& options) {
  double p = options.norm_type();
  bool largest = std::isinf(p) && p > 0;
  // Checked before the collective, alike on every rank that passes the same
  // options: none is left waiting for one that raised.
  LOCKSTEP_ENFORCE(largest || (std::isfinite(p) && p > 0), UsageError,
                   "clip_grad_norm_: norm_type ", p, " is not supported; a finite p > 0, or "
                   "infinity (the largest magnitude).");
  std::vector<at::Tensor> grads;
  for (const auto& param : parameters) {
    // An empty slice (a parameter of fewer rows than ranks) adds nothing,
    // and its largest magnitude is undefined.
    if (param.grad().defined() && param.grad().numel() > 0) {
      grads.push_back(param.grad());
    }
  }
  // This rank's share: the largest magnitude, or the sum of |g|^p, each
  // gradient's norm taken as torch takes it and the sum in float64. A NaN
  // travels beside it as a flag (a maximum may drop it, where a sum keeps
  // it), and so does a failure here, so that every rank leaves the
  // all-reduce and raises, not only this one.
  double share = 0;
  double nan = 0;
  double failed = 0;
  std::exception_ptr failure;
  try {
    for (const auto& grad : grads) {
      double norm = (largest ? grad.data().abs().max() : grad.data().norm(p))
                        .item<double>();
      if (std::isnan(norm)) {
        nan = 1;
      }
      share = largest ? std::max(share, norm) : share + std::pow(norm, p);
    }
  } catch (...) {
    failure = std::current_exception();
    failed = 1;
  }
  auto total = at::tensor({share, nan, failed}, at::kDouble);
  world.all_reduce(total, largest ? ReduceOp::Max : ReduceOp::Sum);
  if (failure) {
    std::rethrow_exception(failure);
  }
  LOCKSTEP_ENFORCE(total[2].item<double>() == 0, UsageError, "rank ", world.rank(),
                   ": clip_grad_norm_ stopped: another rank could not take the norm of its "
                   "gradients (its own error says why).");
  double norm = total[1].item<double>() > 0 ? std::nan("")
      : largest                             ? total[0].item<double>()
                                            : std::pow(total[0].item<double>(), 1.0 / p);
  // The same text as torch's, raised on every rank alike.
  TORCH_CHECK(!options.error_if_nonfinite() || std::isfinite(norm), "The total norm of order ",
              p, " for gradients from `parameters` is non-finite, so it cannot be clipped. "
              "To disable this error and scale the gradients with the non-finite norm anyway, "
              "set `error_if_nonfinite=false`");
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
