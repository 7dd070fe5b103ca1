#pragma once

// The numerical-equivalence pattern: a model trained by DistributedDataParallel
// on N shards beside a reference trained in one process on the whole batch,
// compared after every step; and replicas compared bit for bit across ranks.

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

namespace lockstep::testing {

enum class OptimizerKind { Sgd, Adam };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(
    OptimizerKind kind, std::vector<torch::Tensor> params);

/// The global batch of `step`: `samples` inputs shaped `input_shape` and
/// targets of width 5, the same on every rank.
std::pair<torch::Tensor, torch::Tensor> global_batch(
    int64_t step, int64_t samples, const std::vector<int64_t>& input_shape);

/// All of `tensors`, flattened into one float64 tensor.
torch::Tensor flatten(const std::vector<torch::Tensor>& tensors);

/// Expects `tensor` to be bitwise equal on every rank.
void expect_same_on_every_rank(
    World& world, const torch::Tensor& tensor, const std::string& what);

/// Expects every parameter of `actual` to be allclose to `reference`'s.
void expect_close_parameters(
    torch::nn::Module& actual,
    torch::nn::Module& reference,
    double tolerance,
    const std::string& context);

/// The tolerance of a float64 comparison. Two summation orders of the same
/// float64 gradient differ by about 1e-13 here (a few units of 2^-53 times
/// the sum of the magnitudes of at most a few thousand terms of size <= 1).
/// SGD passes such differences on unamplified; Adam divides them by
/// sqrt(v), which amplifies only gradients that are themselves near zero,
/// and those are rare. 1e-10 keeps a margin of three orders of magnitude on
/// any CPU, while a real mistake (a gradient left out, not averaged, or
/// averaged twice) moves a parameter by about lr x gradient, 1e-3 or more.
constexpr double kFloat64Tolerance = 1e-10;

struct SideBySide {
  int steps = 5;
  int64_t per_rank = 4;
  std::vector<int64_t> input_shape{20};
  OptimizerKind optimizer = OptimizerKind::Sgd;
  /// The dtype that models and data are converted to; unset, the models
  /// keep their own dtypes (mixed precision). Float64 makes the comparison
  /// exact in kind, with `tolerance`. In any other case the reference that
  /// decides is a third model trained in float64 (expect_as_close_to_exact).
  std::optional<torch::Dtype> dtype = torch::kDouble;
  double tolerance = kFloat64Tolerance;
  /// The forward depends on the rank (a head chosen by rank): the reference
  /// then runs each shard with its rank's forward and averages the losses,
  /// instead of one forward over the concatenated batch.
  bool rank_dependent = false;
  /// Where the models and the data live.
  torch::Device device = torch::kCPU;
};

/// The comparison below float64, whose tolerance comes from the computation
/// rather than from a machine: the DDP model and the one-process reference
/// are the same computation in two summation orders, so each is as far from
/// the exact (float64) trajectory as the other, give or take the luck of
/// rounding. Per dtype of `actual`'s parameters, the DDP model must be
/// within 8 times the one-process model's distance from `exact` (max over
/// those parameters), plus 2 units of that dtype's precision times the
/// largest of them, for a distance that happens to be zero. Luck makes the
/// two distances differ by a small factor (up to 2 in the runs we made);
/// a real mistake puts the DDP model a hundred times further or more.
void expect_as_close_to_exact(
    torch::nn::Module& actual,
    torch::nn::Module& reference,
    torch::nn::Module& exact,
    const std::string& context);

/// The forward of train_side_by_side for a model whose forward takes the
/// input alone.
inline constexpr auto plain_forward = [](auto& model, torch::Tensor x, int64_t, int) {
  return model(x);
};

/// Trains `make_model()` wrapped in DDP beside an unwrapped reference built
/// with the same seed, and checks both after every step. `forward(model, x,
/// step, rank)` runs either; rank is -1 for the reference's whole batch.
/// Returns the DDP's stats after the last step.
template <typename ModelType, typename Forward>
DdpStats train_side_by_side(
    World& world,
    const std::function<ModelType()>& make_model,
    const DdpOptions& options,
    const SideBySide& setup,
    Forward forward) {
  auto build = [&](std::optional<torch::Dtype> dtype) {
    torch::manual_seed(42);
    ModelType built = make_model();
    if (dtype) {
      built->to(*dtype);
    }
    built->to(setup.device);
    return built;
  };
  ModelType model = build(setup.dtype);
  ModelType reference = build(setup.dtype);
  bool against_exact = setup.dtype != torch::kDouble;
  ModelType exact = against_exact ? build(torch::kDouble) : ModelType{nullptr};
  if (world.rank() != 0) {
    // Replicas that start apart: construction must bring them to rank 0's.
    torch::NoGradGuard no_grad;
    for (auto& param : model->parameters()) {
      param.add_(0.5 * world.rank());
    }
  }
  DDP<ModelType> ddp(model, world, options);
  auto optimizer = make_optimizer(setup.optimizer, model->parameters());
  auto reference_optimizer =
      make_optimizer(setup.optimizer, reference->parameters());
  auto exact_optimizer = against_exact
      ? make_optimizer(setup.optimizer, exact->parameters())
      : nullptr;
  int n = world.size();
  for (int step = 0; step < setup.steps; ++step) {
    auto [x, y] = global_batch(step, setup.per_rank * n, setup.input_shape);
    if (setup.dtype) {
      x = x.to(*setup.dtype);
      y = y.to(*setup.dtype);
    }
    x = x.to(setup.device);
    y = y.to(setup.device);
    auto shard = [&](const torch::Tensor& t, int rank) {
      return t.narrow(0, rank * setup.per_rank, setup.per_rank);
    };

    optimizer->zero_grad();
    auto loss = torch::mse_loss(
        forward(ddp, shard(x, world.rank()), step, world.rank()),
        shard(y, world.rank()));
    loss.backward();
    optimizer->step();

    auto one_process_step = [&](ModelType& one, torch::optim::Optimizer& one_optimizer,
                                const torch::Tensor& xs, const torch::Tensor& ys) {
      one_optimizer.zero_grad();
      torch::Tensor one_loss;
      if (setup.rank_dependent) {
        one_loss = torch::zeros({}, xs.options());
        for (int rank = 0; rank < n; ++rank) {
          one_loss = one_loss +
              torch::mse_loss(forward(one, shard(xs, rank), step, rank),
                              shard(ys, rank)) /
                  n;
        }
      } else {
        one_loss = torch::mse_loss(forward(one, xs, step, -1), ys);
      }
      one_loss.backward();
      one_optimizer.step();
    };
    one_process_step(reference, *reference_optimizer, x, y);

    std::string context = "after step " + std::to_string(step);
    if (against_exact) {
      one_process_step(exact, *exact_optimizer, x.to(torch::kDouble), y.to(torch::kDouble));
      expect_as_close_to_exact(*model, *reference, *exact, context);
    } else {
      expect_close_parameters(*model, *reference, setup.tolerance, context);
    }
    expect_same_on_every_rank(world, flatten(model->parameters()),
                              "parameters " + context);
  }
  return ddp.stats();
}

} // namespace lockstep::testing
