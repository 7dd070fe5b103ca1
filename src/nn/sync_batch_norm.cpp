// SyncBatchNorm's forward and backward. The statistics travel in float64 as
// each rank's (count, mean, M2), computed from its batch by ATen's var_mean
// in float64, and are merged with Chan et al.'s formula, so that ranks with
// different batch sizes weigh exactly by their counts, an empty batch adds
// nothing, and a mean large against the spread loses no precision. The backward needs the global sums of dy and dy * (x - mean)
// per channel; the weight and bias gradients stay local, and
// DistributedDataParallel averages them like any other.

#include <lockstep/sync_batch_norm.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/functional/batchnorm.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/batchnorm.h>

#include <lockstep/error.h>

namespace lockstep {
namespace {

using torch::autograd::variable_list;

// The shape that broadcasts a per-channel tensor over an input of `dim`
// dimensions.
std::vector<int64_t> channel_shape(int64_t dim, int64_t channels) {
  std::vector<int64_t> shape(static_cast<size_t>(dim), 1);
  shape[1] = channels;
  return shape;
}

// Every dimension but the channels'.
std::vector<int64_t> reduced_dims(int64_t dim) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < dim; ++d) {
    dims.push_back(d);
  }
  return dims;
}

struct GlobalStatistics {
  at::Tensor mean; // float64, per channel
  at::Tensor var;  // biased, float64
  int64_t count = 0;
};

GlobalStatistics gather_statistics(World& world, const at::Tensor& input) {
  int64_t channels = input.size(1);
  int64_t count = channels > 0 ? input.numel() / channels : 0;
  // This rank's (count, mean, M2 = count x biased variance), from its values
  // in float64, on the input's device.
  auto mine = at::zeros({2 * channels + 1}, input.options().dtype(at::kDouble));
  mine.narrow(0, 0, 1).fill_(static_cast<double>(count));
  if (count > 0) {
    auto [var, mean] = at::var_mean(input.to(at::kDouble), reduced_dims(input.dim()),
                                    /*unbiased=*/false);
    mine.narrow(0, 1, channels).copy_(mean);
    mine.narrow(0, 1 + channels, channels).copy_(var * static_cast<double>(count));
  }
  auto parts = at::stack(world.all_gather(mine));
  // Merged as Chan et al. combine partitions, the same on every rank: the
  // global mean weighs the ranks' means by their counts, and M2 adds each
  // rank's M2 and its count times its mean's squared distance to the
  // global mean. A mean large against the spread costs nothing, where
  // E[x^2] - mean^2 would cancel it away. The one host read is the count.
  auto counts = parts.select(1, 0).unsqueeze(1);
  auto means = parts.narrow(1, 1, channels);
  double total = counts.sum().item<double>();
  GlobalStatistics global;
  global.count = static_cast<int64_t>(total);
  LOCKSTEP_ENFORCE(
      global.count > 1, UsageError, "SyncBatchNorm needs more than one value per channel "
      "across all ranks in training, got ", global.count, " (input of this rank: ",
      input.sizes(), ").");
  global.mean = (means * (counts / total)).sum(0);
  auto distance = means - global.mean;
  auto m2 = parts.narrow(1, 1 + channels, channels).sum(0) +
      (counts * distance * distance).sum(0);
  global.var = m2 / total;
  return global;
}

// The input gradient of the global normalisation, per channel c with
// s = invstd, w the weight, m1 = mean of dy and m2 = mean of dy * (x - mean)
// over the global batch:
//   dx = dy * w s - w s m1 - (x - mean) * w s^3 m2
// computed in two fused passes: BatchNorm's own eval-mode kernel applied to
// x gives the last two terms (an affine map of x per channel), and addcmul
// adds the first. The local sums come from BatchNorm's backward kernel,
// which, handed the global mean and invstd, returns sum(dy * (x - mean)) * s
// and sum(dy) in one pass.
class SyncBatchNormBackward : public torch::autograd::Node {
 public:
  SyncBatchNormBackward(World world, at::Tensor input, at::Tensor weight, at::Tensor mean,
                        at::Tensor var, at::Tensor invstd, int64_t count, double eps)
      : world_(std::move(world)),
        input_(std::move(input)),
        weight_(std::move(weight)),
        mean_(std::move(mean)),
        var_(std::move(var)),
        invstd_(std::move(invstd)),
        count_(count),
        eps_(eps) {}

  variable_list apply(variable_list&& grads) override {
    at::NoGradGuard no_grad;
    int64_t channels = input_.size(1);
    // In the statistics' dtype: the weight's where the input is 16-bit and
    // the weight kept in full precision (DDP's mixed-precision policy).
    // ATen's backward kernel has no mixed-type path (1.13 and 2.6 assert),
    // so a 16-bit input and its gradient are widened for this node only,
    // and the input's gradient is narrowed back to the input's dtype.
    auto dtype = mean_.scalar_type();
    auto input = input_.to(dtype);
    auto dy = grads[0].defined() ? grads[0].contiguous().to(dtype) : at::zeros_like(input);
    at::Tensor dy_xhat = at::zeros({channels}, mean_.options());
    at::Tensor sum_dy = at::zeros({channels}, mean_.options());
    if (input.numel() > 0) { // the kernel divides by the batch's size
      std::tie(std::ignore, dy_xhat, sum_dy) = at::native_batch_norm_backward(
          dy, input, weight_, c10::nullopt, c10::nullopt, mean_, invstd_, /*train=*/true, eps_,
          {false, true, true});
    }
    // Every rank runs this all-reduce, whatever it needs: the ranks' graphs
    // are alike, and the next collective must be the same everywhere.
    auto sums = at::cat({sum_dy, dy_xhat / invstd_}).to(at::kDouble);
    world_.all_reduce_async(sums, ReduceOp::Sum,
                            detail::str("SyncBatchNorm gradient sums of ", channels,
                                        " channels"))
        .wait();
    variable_list out(3);
    if (should_compute_output(0)) {
      auto mean_dy = (sums.narrow(0, 0, channels) / count_).to(dtype);
      auto mean_dy_xmu = (sums.narrow(0, channels, channels) / count_).to(dtype);
      auto scale = weight_.defined() ? invstd_ * weight_ : invstd_;
      auto dx = at::batch_norm(input, -scale * invstd_ * mean_dy_xmu, -scale * mean_dy, mean_,
                               var_, /*training=*/false, 0.0, eps_, /*cudnn_enabled=*/false);
      out[0] = dx.addcmul_(dy, scale.view(channel_shape(input.dim(), channels)))
                   .to(input_.scalar_type());
    }
    if (should_compute_output(1)) {
      out[1] = dy_xhat;
    }
    if (should_compute_output(2)) {
      out[2] = sum_dy;
    }
    return out;
  }

  void release_variables() override {
    input_.reset();
    weight_.reset();
  }

 private:
  World world_;
  at::Tensor input_;
  at::Tensor weight_;
  at::Tensor mean_;
  at::Tensor var_;
  at::Tensor invstd_;
  int64_t count_;
  double eps_;
};

} // namespace

const torch::nn::BatchNormOptions* batch_norm_options(const torch::nn::Module& module) {
  if (const auto* bn = dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&module)) {
    return &bn->options;
  }
  if (const auto* bn = dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&module)) {
    return &bn->options;
  }
  if (const auto* bn = dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&module)) {
    return &bn->options;
  }
  return nullptr;
}

bool is_batch_norm(const torch::nn::Module& module) {
  return batch_norm_options(module) != nullptr;
}

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options_in)
    : options(options_in) {
  reset();
}

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options_in, World world_in)
    : options(options_in), world(std::move(world_in)) {
  reset();
}

namespace {

torch::nn::BatchNormOptions options_to_take_over(const torch::nn::Module& batch_norm) {
  const auto* source = batch_norm_options(batch_norm);
  LOCKSTEP_ENFORCE(source != nullptr, UsageError, "SyncBatchNorm takes over a "
                   "torch::nn::BatchNorm1d, 2d or 3d, not a ", batch_norm.name(), ".");
  return *source;
}

} // namespace

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::Module& batch_norm, World world_in)
    : options(options_to_take_over(batch_norm)), world(std::move(world_in)) {
  register_state(&batch_norm);
}

void SyncBatchNormImpl::reset() {
  register_state(nullptr);
  reset_parameters();
}

void SyncBatchNormImpl::register_state(const torch::nn::Module* source) {
  // torch::nn::BatchNorm's registrations, under the same names.
  int64_t features = options.num_features();
  auto parameter = [&](const char* name, bool defined) {
    if (source != nullptr) {
      // Undefined ones (affine(false)) are not listed.
      const auto* tensor = source->named_parameters(/*recurse=*/false).find(name);
      return tensor ? register_parameter(name, *tensor, tensor->requires_grad())
                    : register_parameter(name, torch::Tensor(), /*requires_grad=*/false);
    }
    return defined ? register_parameter(name, torch::empty({features}))
                   : register_parameter(name, torch::Tensor(), /*requires_grad=*/false);
  };
  auto buffer = [&](const char* name, torch::Tensor fresh) {
    if (source != nullptr) {
      const auto* tensor = source->named_buffers(/*recurse=*/false).find(name);
      return register_buffer(name, tensor ? *tensor : torch::Tensor());
    }
    return register_buffer(name, std::move(fresh));
  };
  bool affine = options.affine();
  bool tracking = options.track_running_stats();
  weight = parameter("weight", affine);
  bias = parameter("bias", affine);
  running_mean = buffer("running_mean", tracking ? torch::zeros({features}) : torch::Tensor());
  running_var = buffer("running_var", tracking ? torch::ones({features}) : torch::Tensor());
  num_batches_tracked = buffer(
      "num_batches_tracked",
      tracking ? torch::tensor(0, torch::dtype(torch::kLong)) : torch::Tensor());
}

void SyncBatchNormImpl::reset_running_stats() {
  if (options.track_running_stats()) {
    running_mean.zero_();
    running_var.fill_(1);
    num_batches_tracked.zero_();
  }
}

void SyncBatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (options.affine()) {
    torch::nn::init::ones_(weight);
    torch::nn::init::zeros_(bias);
  }
}

torch::Tensor SyncBatchNormImpl::forward(const torch::Tensor& input) {
  LOCKSTEP_ENFORCE(input.dim() >= 2, UsageError, "SyncBatchNorm expects an input of at least "
                   "2 dimensions (N, C, ...), got ", input.sizes(), ".");
  LOCKSTEP_ENFORCE(input.size(1) == options.num_features(), UsageError, "SyncBatchNorm of ",
                   options.num_features(), " features got an input with ", input.size(1),
                   " channels (", input.sizes(), ").");
  bool tracking = options.track_running_stats();
  if (!is_training() || !world) {
    // In eval mode, the running statistics (or without them this rank's
    // batch), as BatchNorm does and PyTorch's SyncBatchNorm: nothing to
    // agree on. Not bound (no DistributedDataParallel wraps it): what
    // BatchNorm's forward does, on this rank's batch, its checks included.
    double factor = options.momentum().value_or(0.0);
    if (is_training() && tracking) {
      at::NoGradGuard no_grad;
      num_batches_tracked += 1;
      if (!options.momentum().has_value()) {
        factor = 1.0 / num_batches_tracked.item<double>();
      }
    }
    return torch::nn::functional::detail::batch_norm(
        input, running_mean, running_var, weight, bias, is_training() || !tracking, factor,
        options.eps());
  }
  GlobalStatistics global = gather_statistics(*world, input);
  if (tracking) {
    at::NoGradGuard no_grad;
    num_batches_tracked += 1;
    auto unbiased = global.var * (static_cast<double>(global.count) / (global.count - 1));
    if (options.momentum().has_value()) {
      double factor = *options.momentum();
      running_mean.mul_(1 - factor).add_(global.mean.to(running_mean.scalar_type()), factor);
      running_var.mul_(1 - factor).add_(unbiased.to(running_var.scalar_type()), factor);
    } else {
      // A cumulative average, its factor computed where the count lives
      // (no host read of a device buffer).
      auto factor = num_batches_tracked.to(at::kDouble).reciprocal();
      running_mean.copy_(running_mean + (global.mean - running_mean) * factor);
      running_var.copy_(running_var + (unbiased - running_var) * factor);
    }
  }
  // The statistics in the weight's dtype: a 16-bit input with float32
  // weights (BatchNorm kept in full precision under DDP's mixed-precision
  // policy) takes ATen's mixed-type kernels, which return 16 bits.
  auto dtype = weight.defined() ? weight.scalar_type() : input.scalar_type();
  auto mean = global.mean.to(dtype);
  auto var = global.var.to(dtype);
  auto invstd = (global.var + options.eps()).rsqrt().to(dtype);
  at::Tensor output;
  {
    // BatchNorm's fused eval-mode kernel, with the global statistics.
    at::NoGradGuard no_grad;
    output = at::batch_norm(input, weight, bias, mean, var, /*training=*/false, 0.0,
                            options.eps(), /*cudnn_enabled=*/false);
  }
  if (at::GradMode::is_enabled() &&
      torch::autograd::compute_requires_grad(input, weight, bias)) {
    auto node = std::shared_ptr<SyncBatchNormBackward>(
        new SyncBatchNormBackward(*world, input.detach(),
                                  weight.defined() ? weight.detach() : at::Tensor(), mean, var,
                                  invstd, global.count, options.eps()),
        torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(input, weight, bias));
    torch::autograd::set_history(output, node);
  }
  return output;
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "lockstep::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=";
  if (options.momentum().has_value()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << options.affine()
         << ", track_running_stats=" << options.track_running_stats() << ")";
}

} // namespace lockstep
