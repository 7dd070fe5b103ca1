#pragma once

// BatchNorm over the global batch: in training, the mean and variance of
// each channel come from every rank's batch (one all-reduce of three
// numbers per channel in forward, one of two in backward), so that small
// per-rank batches normalise as one large batch would. PyTorch's
// counterpart is torch.nn.SyncBatchNorm. See docs/ddp.md.

#include <optional>
#include <ostream>

#include <torch/nn/cloneable.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <lockstep/world.h>

namespace lockstep {

/// Takes inputs of any BatchNorm: (N, C), (N, C, L), (N, C, H, W) or
/// (N, C, D, H, W). Its parameters and buffers carry the names of
/// torch::nn::BatchNorm's (weight, bias, running_mean, running_var,
/// num_batches_tracked), so checkpoints move between the two. In eval mode
/// it uses the running statistics and communicates nothing.
class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  /// Not bound to a world yet: the DistributedDataParallel that wraps the
  /// model binds it to its own, so that a model declares its BatchNorms as
  /// typed fields (`lockstep::SyncBatchNorm bn{nullptr};`,
  /// `bn = register_module("bn", lockstep::SyncBatchNorm(64));`) with no
  /// world in its constructors. Until then (in a program of one process,
  /// say) it normalises this rank's batch alone, as BatchNorm does.
  explicit SyncBatchNormImpl(const torch::nn::BatchNormOptions& options);
  /// Collective in training: every rank of `world` must run each forward
  /// and backward of it, with batches of any size (an empty one included).
  SyncBatchNormImpl(const torch::nn::BatchNormOptions& options, World world);
  /// Takes over `batch_norm` (a torch::nn::BatchNorm1d/2d/3d): its options
  /// and its very parameter and buffer tensors, so that an optimizer built
  /// on them keeps working. What convert_sync_batchnorm does.
  SyncBatchNormImpl(const torch::nn::Module& batch_norm, World world);

  void reset() override;
  void reset_running_stats();
  void reset_parameters();
  torch::Tensor forward(const torch::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  torch::nn::BatchNormOptions options;
  torch::Tensor weight;
  torch::Tensor bias;
  torch::Tensor running_mean;
  torch::Tensor running_var;
  torch::Tensor num_batches_tracked;
  /// The ranks whose batches it normalises over; none until bound (see the
  /// first constructor).
  std::optional<World> world;

 private:
  /// Registers `source`'s tensors under BatchNorm's names, or new ones.
  void register_state(const torch::nn::Module* source);
};
TORCH_MODULE(SyncBatchNorm);

/// Whether `module` is a torch::nn::BatchNorm1d, 2d or 3d.
bool is_batch_norm(const torch::nn::Module& module);

/// Replaces, in place, every torch::nn::BatchNorm1d/2d/3d in `module`'s
/// tree by a SyncBatchNorm over `world` with the same options, weights,
/// biases, running statistics and num_batches_tracked. A BatchNorm must sit
/// in a torch::nn::Sequential, ModuleList or ModuleDict, whose entries can
/// be replaced: one held in a field of another module (`BatchNorm2d bn;`)
/// would keep running as the field points to it, so it is refused with a
/// lockstep::UsageError naming it, before anything changes. Returns how
/// many were replaced.
int convert_sync_batchnorm(torch::nn::Module& module, const World& world);

} // namespace lockstep
