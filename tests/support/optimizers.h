#pragma once

// What the tests of the optimizer inside the reduction share: the
// optimizers (plain, ZeRO, stepping in backward), a float64 test MLP, its
// batches and shards, and the bit-for-bit comparison with plain DDP.

#include <cstdlib>
#include <memory>
#include <ostream>
#include <string>
#include <utility>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "support/models.h"
#include "support/shared_folder.h"
#include "support/training.h"

namespace lockstep::testing {

enum class Kind { Sgd, Adam, AdamW };
enum class Way { InBackward, Zero, ZeroInBackward };

inline const char* name_of(Kind kind) {
  return kind == Kind::Sgd ? "SGD (momentum, weight decay)" : kind == Kind::Adam ? "Adam" : "AdamW";
}
inline const char* name_of(Way way) {
  return way == Way::InBackward ? "step in backward"
         : way == Way::Zero     ? "ZeRO"
                                : "ZeRO stepping in backward";
}

inline void PrintTo(Way way, std::ostream* out) {
  *out << name_of(way);
}

inline torch::optim::SGDOptions sgd_options() {
  return torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-2);
}
inline torch::optim::AdamOptions adam_options() {
  return torch::optim::AdamOptions(1e-2).weight_decay(1e-3);
}
inline torch::optim::AdamWOptions adamw_options() {
  return torch::optim::AdamWOptions(1e-2);
}

inline std::unique_ptr<torch::optim::Optimizer> plain_optimizer(Kind kind,
                                                         std::vector<torch::Tensor> params) {
  switch (kind) {
    case Kind::Sgd:
      return std::make_unique<torch::optim::SGD>(params, sgd_options());
    case Kind::Adam:
      return std::make_unique<torch::optim::Adam>(params, adam_options());
    default:
      return std::make_unique<torch::optim::AdamW>(params, adamw_options());
  }
}

inline std::unique_ptr<torch::optim::Optimizer> zero_optimizer(Kind kind,
                                                        std::vector<torch::Tensor> params,
                                                        World& world, ZeroOptions zero = {}) {
  switch (kind) {
    case Kind::Sgd:
      return std::make_unique<ZeroRedundancyOptimizer<torch::optim::SGD>>(params, world,
                                                                          sgd_options(), zero);
    case Kind::Adam:
      return std::make_unique<ZeroRedundancyOptimizer<torch::optim::Adam>>(params, world,
                                                                           adam_options(), zero);
    default:
      return std::make_unique<ZeroRedundancyOptimizer<torch::optim::AdamW>>(
          params, world, adamw_options(), zero);
  }
}

/// The optimizer of `way`, registered with `ddp` when it steps in backward.
inline std::unique_ptr<torch::optim::Optimizer> optimizer_of(Way way, Kind kind, DDP<Mlp>& ddp,
                                                      World& world,
                                                      const StepInBackwardOptions& options = {},
                                                      ZeroOptions zero = {}) {
  auto params = ddp.module()->parameters();
  auto optimizer = way == Way::InBackward ? plain_optimizer(kind, params)
                                          : zero_optimizer(kind, params, world, zero);
  if (way != Way::Zero) {
    ddp.step_in_backward(*optimizer, options);
  }
  return optimizer;
}

inline Mlp float64_mlp(int seed) {
  torch::manual_seed(seed);
  Mlp model;
  model->to(torch::kDouble);
  return model;
}

inline torch::Tensor shard(const torch::Tensor& t, int rank, int64_t per_rank) {
  return t.narrow(0, rank * per_rank, per_rank);
}

inline constexpr int64_t kPerRank = 4;

// One parameter per bucket: each bucket steps while the later ones are
// still being reduced.
inline DdpOptions one_parameter_per_bucket() {
  return DdpOptions().bucket_cap_mb(0).first_bucket_cap_mb(0);
}

inline std::pair<torch::Tensor, torch::Tensor> batch(int64_t step, int n) {
  auto [x, y] = global_batch(step, kPerRank * n, {20});
  return {x.to(torch::kDouble), y.to(torch::kDouble)};
}

struct Scenario {
  bool no_sync = false;   // two micro-batches, the first under no_sync
  bool scheduler = false; // StepLR halving the learning rate every 2 steps
  std::optional<double> clip;
  int steps = 4;
};

inline void expect_bit_identical(torch::nn::Module& actual, torch::nn::Module& expected,
                          const std::string& context) {
  EXPECT_TRUE(flatten(actual.parameters()).equal(flatten(expected.parameters())))
      << context << ": the parameters differ from plain DDP's by "
      << (flatten(actual.parameters()) - flatten(expected.parameters())).abs().max().item<double>();
}


/// After a step: `model` (the way under test) is bit for bit `plain` (plain
/// DDP and a plain optimizer), within float64 rounding of `reference` (one
/// process on the whole batch), and the same on every rank.
inline void expect_as_plain_ddp_and_one_process(World& world, torch::nn::Module& model,
                                                torch::nn::Module& plain,
                                                torch::nn::Module& reference,
                                                const std::string& context) {
  expect_bit_identical(model, plain, context);
  expect_close_parameters(model, reference, kFloat64Tolerance, context);
  expect_same_on_every_rank(world, flatten(model.parameters()), "parameters " + context);
}

// Steps `from` to `to` on this rank's shard; `steps_itself`: the loop calls
// optimizer.step() (not when it steps inside backward).
inline void train_steps(DDP<Mlp>& ddp, torch::optim::Optimizer& optimizer, bool steps_itself,
                 int from, int to, int rank, int n) {
  for (int step = from; step < to; ++step) {
    auto [x, y] = batch(step, n);
    optimizer.zero_grad();
    torch::mse_loss(ddp(shard(x, rank, kPerRank)), shard(y, rank, kPerRank)).backward();
    if (steps_itself) {
      optimizer.step();
    }
  }
}

} // namespace lockstep::testing
