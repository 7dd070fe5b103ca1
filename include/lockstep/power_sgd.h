#pragma once

// PowerSGD (Vogels et al., NeurIPS 2019) as a communication hook: each
// gradient matrix M (n x m) travels as two thin matrices, P = M Q (n x r)
// and Q = M^T P (m x r), all-reduced one after the other, instead of M;
// the error of the approximation is carried into the next step. PyTorch's
// powerSGD_hook and PowerSGDState, with the same options and semantics.
// See docs/ddp.md.

#include <cstdint>
#include <memory>

#include <torch/arg.h>

#include <lockstep/comm_hook.h>

namespace torch::serialize {
class InputArchive;
class OutputArchive;
} // namespace torch::serialize

namespace lockstep {

struct PowerSGDOptions {
  /// r: the rank of the approximation of each matrix. Higher is more exact
  /// and sends more: (n + m) r values per n x m matrix.
  TORCH_ARG(int64_t, matrix_approximation_rank) = 1;
  /// Iterations of plain all-reduce before compression starts (the first
  /// iterations move fast, and the buckets are laid out again after the
  /// first). At least 2 with error feedback or warm start, as in PyTorch.
  TORCH_ARG(int64_t, start_powerSGD_iter) = 1000;
  /// A matrix is compressed only when n m > min_compression_rate (n + m) r;
  /// others (biases, small layers) are all-reduced as they are.
  TORCH_ARG(double, min_compression_rate) = 2.0;
  /// Add the last step's approximation error to this step's gradient.
  TORCH_ARG(bool, use_error_feedback) = true;
  /// Start each step's power iteration from the last step's Q.
  TORCH_ARG(bool, warm_start) = true;
  /// Added to each column's norm in the Gram-Schmidt step (0: none).
  TORCH_ARG(double, orthogonalization_epsilon) = 0.0;
  /// Seeds the random initial Q, the same on every rank.
  TORCH_ARG(uint64_t, random_seed) = 0;
  /// PyTorch computes matrices of one shape as one batch; the numbers are
  /// the same either way, and lockstep computes them one by one.
  TORCH_ARG(bool, batch_tensors_with_same_shape) = false;
};

/// The state of PowerSGD (iteration count, each rank's error feedback, the
/// warm-start Q and P of each bucket) and its hook. Save it with the model
/// (CheckpointItems::hook_state) for an exact resume.
class PowerSGD {
 public:
  explicit PowerSGD(PowerSGDOptions options = {});

  /// The hook to register: `ddp.register_comm_hook(power_sgd.hook());`. It
  /// shares this state.
  CommHook hook() const;

  const PowerSGDOptions& options() const;
  /// Synchronised backward passes seen (bucket by bucket, counted at the
  /// last).
  int64_t iteration() const;
  /// Values per iteration without compression, and what was sent instead,
  /// over the last iteration.
  int64_t values_before_compression() const;
  int64_t values_after_compression() const;

  /// This rank's state, for a checkpoint.
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);
  /// Forgets this rank's error feedback (what a resume at another world
  /// size does: the saved errors belong to other ranks' shards).
  void reset_error_feedback();

  struct State;
  struct Compression;

 private:
  std::shared_ptr<State> state_;
};

} // namespace lockstep
