#pragma once

// Loss scaling for float16 gradients, as Python's torch.amp.GradScaler: the
// loss is multiplied by a scale before backward so that small gradients do
// not flush to zero in 16 bits; before the step they are divided back, and
// a step whose gradients hold an inf or a NaN is skipped while the scale
// backs off. Same defaults, same arithmetic, same skips.
//
//   lockstep::amp::GradScaler scaler;
//   for (auto& batch : *loader) {
//     optimizer.zero_grad();
//     torch::Tensor loss;
//     {
//       lockstep::amp::Autocast autocast(at::kCUDA);
//       loss = torch::nll_loss(ddp(batch.data), batch.target);
//     }
//     scaler.scale(loss).backward();
//     scaler.step(optimizer);       // unscales, then steps unless inf/NaN
//     scaler.update();
//   }
//
// Every rank skips the same steps: under DistributedDataParallel every rank
// unscales the same averaged gradients; the ranks that hold shards of them
// (a ZeroRedundancyOptimizer's, ZeRO-2's, an optimizer over
// FullyShardedDataParallel's pieces) agree on found-inf by a collective of
// those ranks (docs/ddp.md, "Mixed precision").

#include <cstdint>
#include <map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

namespace torch::optim {
class Optimizer;
} // namespace torch::optim
namespace torch::serialize {
class OutputArchive;
class InputArchive;
} // namespace torch::serialize

namespace lockstep::amp {

struct GradScalerOptions {
  /// The first scale.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// The scale is multiplied by it after growth_interval steps in a row
  /// without inf or NaN.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// ... and by this after a step that had one.
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// False: every call passes through (scale() returns the loss, step()
  /// steps), so one loop serves both.
  TORCH_ARG(bool, enabled) = true;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  /// `outputs` times the scale (a float32 scalar on their device).
  at::Tensor scale(const at::Tensor& outputs) const;
  /// Divides the gradients of `optimizer`'s parameters by the scale, in
  /// place, and notes whether any is inf or NaN: call it before reading
  /// them (clipping). At most once per optimizer between two update()s.
  void unscale_(torch::optim::Optimizer& optimizer);
  /// Unscales if unscale_ was not called, then steps `optimizer` unless a
  /// gradient was inf or NaN. Returns whether it stepped.
  bool step(torch::optim::Optimizer& optimizer);
  /// After the step(s) of an iteration: backs the scale off if any step
  /// found inf or NaN, or grows it after growth_interval clean ones.
  void update();
  /// Sets the scale instead.
  void update(double new_scale);

  /// For DistributedDataParallel::step_in_backward
  /// (StepInBackwardOptions::grad_scaler): unscales the gradients of
  /// `parameters` and returns whether any is inf or NaN. update() counts it
  /// as one optimizer's step, taken or skipped; a second one before
  /// update() is a UsageError.
  bool unscale_for_step_in_backward(const std::vector<at::Tensor>& parameters);

  double get_scale() const;
  int64_t growth_tracker() const;
  bool is_enabled() const {
    return options_.enabled();
  }
  const GradScalerOptions& options() const {
    return options_;
  }

  /// Its state (scale, factors, interval, tracker), as PyTorch's state_dict:
  /// for checkpoints and FaultTolerance::register_state.
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  enum class Stage { Ready, Unscaled, Stepped };
  struct PerOptimizer {
    Stage stage = Stage::Ready;
    bool found_inf = false;
  };
  /// Divides the gradients by the scale; whether one was inf or NaN, as a
  /// float32 tensor of one element (1 or 0) on the CPU.
  at::Tensor unscale_gradients(const std::vector<at::Tensor>& parameters) const;

  GradScalerOptions options_;
  float scale_;
  int64_t growth_tracker_ = 0;
  // By optimizer; nullptr for the steps inside backward.
  std::map<const torch::optim::Optimizer*, PerOptimizer> per_optimizer_;
};

} // namespace lockstep::amp
