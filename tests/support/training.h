#pragma once

// The numerical-equivalence pattern: a model trained by DistributedDataParallel
// on N shards beside a reference trained in one process on the whole batch,
// compared after every step; and replicas compared bit for bit across ranks.

#include <functional>
#include <memory>
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

struct SideBySide {
  int steps = 5;
  int64_t per_rank = 4;
  std::vector<int64_t> input_shape{20};
  OptimizerKind optimizer = OptimizerKind::Sgd;
  double tolerance = 1e-5;
  /// The forward depends on the rank (a head chosen by rank): the reference
  /// then runs each shard with its rank's forward and averages the losses,
  /// instead of one forward over the concatenated batch.
  bool rank_dependent = false;
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
  torch::manual_seed(42);
  ModelType model = make_model();
  torch::manual_seed(42);
  ModelType reference = make_model();
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
  int n = world.size();
  for (int step = 0; step < setup.steps; ++step) {
    auto [x, y] = global_batch(step, setup.per_rank * n, setup.input_shape);
    auto shard = [&](const torch::Tensor& t, int rank) {
      return t.narrow(0, rank * setup.per_rank, setup.per_rank);
    };

    optimizer->zero_grad();
    auto loss = torch::mse_loss(
        forward(ddp, shard(x, world.rank()), step, world.rank()),
        shard(y, world.rank()));
    loss.backward();
    optimizer->step();

    reference_optimizer->zero_grad();
    torch::Tensor reference_loss;
    if (setup.rank_dependent) {
      reference_loss = torch::zeros({});
      for (int rank = 0; rank < n; ++rank) {
        reference_loss = reference_loss +
            torch::mse_loss(forward(reference, shard(x, rank), step, rank),
                            shard(y, rank)) /
                n;
      }
    } else {
      reference_loss = torch::mse_loss(forward(reference, x, step, -1), y);
    }
    reference_loss.backward();
    reference_optimizer->step();

    std::string context = "after step " + std::to_string(step);
    expect_close_parameters(*model, *reference, setup.tolerance, context);
    expect_same_on_every_rank(world, flatten(model->parameters()),
                              "parameters " + context);
  }
  return ddp.stats();
}

} // namespace lockstep::testing
