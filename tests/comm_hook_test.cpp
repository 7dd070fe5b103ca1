// Communication hooks: what a hook sees and when, that its result becomes
// the gradients, its errors on every rank, and the 16-bit compressions
// against the float32 average within the formats' rounding, over shared
// memory and Gloo.

#include <cmath>
#include <tuple>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "support/expect_error.h"
#include "support/models.h"
#include "support/multiprocess.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

class CommHooks : public ::testing::TestWithParam<WorldSetup> {
 protected:
  void run(const std::function<void(int rank)>& body) {
    WorldSetup setup = GetParam();
    LaunchOptions options;
    options.world_size = setup.size;
    options.environment = [setup](int, RankEnvironment& env) {
      env["LOCKSTEP_TRANSPORT"] = setup.transport;
    };
    auto result = launch_ranks(options, body);
    if (!in_rank_process()) {
      EXPECT_TRUE(result.ok()) << result.report();
    }
  }
};

INSTANTIATE_TEST_SUITE_P(WorldSetups, CommHooks, ::testing::ValuesIn(two_and_three_rank_setups()),
                         [](const auto& info) { return info.param.name(); });

// Small buckets, so that the MLP's six parameters travel in several.
DdpOptions small_buckets() {
  return DdpOptions().bucket_cap_mb(0.001).first_bucket_cap_mb(0.001);
}

std::vector<torch::Tensor> gradients_of(torch::nn::Module& module) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : module.parameters()) {
    grads.push_back(p.grad().clone());
  }
  return grads;
}

TEST_P(CommHooks, AHookSeesEveryBucketOnceInOrderAndItsResultIsTheGradients) {
  run([](int rank) {
    World world = init();
    int n = world.size();
    torch::manual_seed(8);
    Mlp model;
    torch::manual_seed(8);
    Mlp reference;
    model->to(torch::kDouble);
    reference->to(torch::kDouble);
    DDP<Mlp> ddp(model, world, small_buckets());
    std::vector<std::pair<size_t, bool>> seen;
    std::vector<std::vector<torch::Tensor>> parameters_seen;
    auto allreduce = hooks::allreduce();
    ddp.register_comm_hook([&](GradBucket& bucket) {
      seen.emplace_back(bucket.index, bucket.last);
      parameters_seen.push_back(bucket.parameters);
      EXPECT_EQ(bucket.offsets.size(), bucket.parameters.size());
      return allreduce(bucket);
    });
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    torch::optim::SGD reference_optimizer(reference->parameters(), 0.1);
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = global_batch(step, 4 * n, {20});
      x = x.to(torch::kDouble);
      y = y.to(torch::kDouble);
      seen.clear();
      parameters_seen.clear();
      optimizer.zero_grad();
      {
        auto guard = ddp.no_sync(); // no bucket leaves
        torch::mse_loss(ddp(x.narrow(0, 4 * rank, 2)), y.narrow(0, 4 * rank, 2)).backward();
      }
      EXPECT_TRUE(seen.empty()) << "a no_sync backward hands no bucket to the hook";
      torch::mse_loss(ddp(x.narrow(0, 4 * rank + 2, 2)), y.narrow(0, 4 * rank + 2, 2))
          .backward();
      size_t buckets = ddp.stats().bucket_bytes.size();
      ASSERT_GT(buckets, 1u);
      ASSERT_EQ(seen.size(), buckets) << "each bucket once per synchronised backward";
      size_t parameters = 0;
      for (size_t b = 0; b < seen.size(); ++b) {
        EXPECT_EQ(seen[b].first, b) << "in launch order";
        EXPECT_EQ(seen[b].second, b + 1 == seen.size());
        parameters += parameters_seen[b].size();
      }
      EXPECT_EQ(parameters, model->parameters().size()) << "every parameter, once";
      optimizer.step();
      reference_optimizer.zero_grad();
      (2 * torch::mse_loss(reference(x), y)).backward(); // two micro-batches' sum
      reference_optimizer.step();
      expect_close_parameters(*model, *reference, kFloat64Tolerance,
                              "after step " + std::to_string(step));
    }
  });
}

TEST_P(CommHooks, WhatTheHookReturnsBecomesTheGradients) {
  run([](int rank) {
    World world = init();
    torch::manual_seed(8);
    Mlp model;
    DDP<Mlp> ddp(model, world, small_buckets());
    ddp.register_comm_hook([](GradBucket& bucket) -> BucketFuture {
      auto result = torch::full_like(bucket.gradients, 0.25);
      return [result] { return result; };
    });
    auto [x, y] = global_batch(0, 8, {20});
    torch::mse_loss(ddp(x.narrow(0, 4 * (rank % 2), 4)), y.narrow(0, 4 * (rank % 2), 4))
        .backward();
    for (const auto& param : model->parameters()) {
      EXPECT_TRUE(param.grad().eq(0.25).all().item<bool>());
    }
  });
}

TEST_P(CommHooks, AHookThatThrowsFailsBackwardOnEveryRankWithItsMessage) {
  run([](int) {
    World world = init();
    Mlp model;
    DDP<Mlp> ddp(model, world, small_buckets());
    ddp.register_comm_hook([](GradBucket& bucket) -> BucketFuture {
      if (bucket.index == 1) {
        throw std::runtime_error("this hook cannot count");
      }
      return hooks::allreduce()(bucket);
    });
    auto [x, y] = global_batch(0, 4, {20});
    expect_error<UsageError>(
        [&] { torch::mse_loss(ddp(x), y).backward(); },
        {"the communication hook failed on bucket 1 of iteration 1 (", "this hook cannot count"});
  });
}

TEST_P(CommHooks, AFutureThatThrowsFailsBackwardOnEveryRankWithItsMessage) {
  run([](int) {
    World world = init();
    Mlp model;
    DDP<Mlp> ddp(model, world, small_buckets());
    ddp.register_comm_hook([](GradBucket& bucket) -> BucketFuture {
      auto future = hooks::allreduce()(bucket);
      return [future]() -> at::Tensor {
        future();
        throw std::runtime_error("lost the result");
      };
    });
    auto [x, y] = global_batch(0, 4, {20});
    expect_error<UsageError>([&] { torch::mse_loss(ddp(x), y).backward(); },
                             {"the communication hook's future failed for bucket 0 of "
                              "iteration 1 (",
                              "lost the result"});
  });
}

TEST(CommHookErrors, ARegistrationAfterTheFirstForwardIsRefused) {
  run_ranks(2, [](int) {
    World world = init();
    Mlp model;
    DDP<Mlp> ddp(model, world);
    ddp(torch::randn({2, 20}));
    expect_error<UsageError>([&] { ddp.register_comm_hook(hooks::allreduce()); },
                             {"register_comm_hook must come before the first forward, on "
                              "every rank (this one comes after 1 forward(s)"});
  });
}

// The 16-bit hooks against the float32 average: each rank's share g/n is
// rounded once to the format (relative error <= 2^-p, p = 11 for float16,
// 8 for bfloat16), the shares are summed in float32 and the sum rounded
// once more, so |hooked - average| <= 2^-p (sum |g_r| / n + |average|)
// <= 2^-p * 2 max_r |g_r|, plus float16's smallest step (2^-24) for values
// it holds as subnormals, plus float32's own rounding.
void expect_within_16_bit_rounding(World& world, const torch::Tensor& hooked,
                                   const torch::Tensor& local, int mantissa_bits,
                                   const std::string& what, bool may_be_exact = false) {
  auto average = local.clone();
  world.all_reduce(average, ReduceOp::Average);
  auto largest = local.abs();
  world.all_reduce(largest, ReduceOp::Max);
  auto bound = largest * (2 * std::ldexp(1.0, -mantissa_bits) + 1e-6) + std::ldexp(1.0, -24);
  auto error = (hooked - average).abs();
  EXPECT_TRUE(error.le(bound).all().item<bool>())
      << what << ": off by up to " << error.max().item<double>() << " where the bound is "
      << bound.min().item<double>() << " or more";
  if (!may_be_exact) {
    EXPECT_GT(error.max().item<double>(), 0.0) << what << ": compressed, so not exact";
  }
}

TEST_P(CommHooks, SixteenBitCompressionIsTheAverageWithinTheFormatsRounding) {
  run([](int rank) {
    World world = init();
    for (auto [name, hook, bits] :
         {std::tuple{"fp16", hooks::fp16_compress(), 11}, {"bf16", hooks::bf16_compress(), 8}}) {
      torch::manual_seed(9);
      Mlp model;
      torch::manual_seed(9);
      Mlp local;
      DDP<Mlp> ddp(model, world, small_buckets());
      ddp.register_comm_hook(hook);
      auto [x, y] = global_batch(0, 8 * world.size(), {20});
      auto mine = [&, x = x, y = y](int part) {
        auto rows = x.narrow(0, 8 * rank + 4 * part, 4);
        return std::pair{rows, y.narrow(0, 8 * rank + 4 * part, 4)};
      };
      {
        // Accumulated under no_sync, compressed once at the synchronised
        // backward.
        auto guard = ddp.no_sync();
        auto [a, b] = mine(0);
        torch::mse_loss(ddp(a), b).backward();
      }
      auto [c, d] = mine(1);
      torch::mse_loss(ddp(c), d).backward();
      for (int part = 0; part < 2; ++part) {
        auto [e, f] = mine(part);
        torch::mse_loss(local(e), f).backward();
      }
      auto hooked = flatten(gradients_of(*model));
      expect_within_16_bit_rounding(world, hooked, flatten(gradients_of(*local)), bits, name);
      expect_same_on_every_rank(world, hooked, std::string(name) + " gradients");
    }
  });
}

} // namespace
} // namespace lockstep::testing

namespace lockstep::testing {
namespace {

// Each wrapper around the plain all-reduce, with its format's significant
// bits.
std::vector<std::tuple<const char*, CommHook, int>> sixteen_bit_wrappers_of_allreduce() {
  return {{"fp16 wrapper", hooks::fp16_wrapper(hooks::allreduce()), 11},
          {"bf16 wrapper", hooks::bf16_wrapper(hooks::allreduce()), 8}};
}

TEST_P(CommHooks, AWrapperSendsWhatTheInnerHookSendsAtSixteenBits) {
  run([](int rank) {
    World world = init();
    for (auto [name, hook, bits] : sixteen_bit_wrappers_of_allreduce()) {
      torch::manual_seed(9);
      Mlp model;
      torch::manual_seed(9);
      Mlp local;
      DDP<Mlp> ddp(model, world, small_buckets());
      ddp.register_comm_hook(hook);
      auto [x, y] = global_batch(0, 4 * world.size(), {20});
      auto rows = x.narrow(0, 4 * rank, 4);
      auto targets = y.narrow(0, 4 * rank, 4);
      torch::mse_loss(ddp(rows), targets).backward();
      torch::mse_loss(local(rows), targets).backward();
      auto hooked = flatten(gradients_of(*model));
      EXPECT_EQ(ddp.stats().last.bytes_reduced, hooked.numel() * 2) << name;
      // The sum of the rounded gradients, rounded, then divided: within the
      // same bound as the compressing hooks (the division is exact or one
      // more rounding of the same size).
      expect_within_16_bit_rounding(world, hooked, flatten(gradients_of(*local)), bits - 1, name);
      expect_same_on_every_rank(world, hooked, name);
    }
    // A PowerSGD inside a bfloat16 wrapper runs too (bfloat16 products).
    PowerSGD power_sgd(PowerSGDOptions().start_powerSGD_iter(2));
    Mlp model;
    DDP<Mlp> ddp(model, world);
    ddp.register_comm_hook(hooks::bf16_wrapper(power_sgd.hook()));
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = global_batch(step, 4 * world.size(), {20});
      torch::mse_loss(ddp(x.narrow(0, 4 * rank, 4)), y.narrow(0, 4 * rank, 4)).backward();
    }
    expect_same_on_every_rank(world, flatten(gradients_of(*model)), "bf16-wrapped PowerSGD");
  });
}

TEST_P(CommHooks, AWrapperKeepsGradientsNearTheFormatsLargestValueFinite) {
  // Gradients of about 4e4 on every rank: their sum passes float16's
  // largest value (65504), their average does not.
  run([](int rank) {
    World world = init();
    for (auto [name, hook, bits] : sixteen_bit_wrappers_of_allreduce()) {
      torch::manual_seed(9);
      torch::nn::Linear model(torch::nn::LinearOptions(4, 3).bias(false));
      torch::nn::Linear local(torch::nn::LinearOptions(4, 3).bias(false));
      {
        torch::NoGradGuard no_grad;
        local->weight.copy_(model->weight);
      }
      DDP<torch::nn::Linear> ddp(model, world);
      ddp.register_comm_hook(hook);
      auto x = torch::full({1, 4}, 1.0 + 0.1 * rank);
      (ddp(x) * 4e4).sum().backward();
      (local(x) * 4e4).sum().backward();
      auto hooked = model->weight.grad().reshape({-1});
      EXPECT_TRUE(torch::isfinite(hooked).all().item<bool>()) << name << ": " << hooked;
      // Twelve values: they may all happen to round exactly.
      expect_within_16_bit_rounding(world, hooked, local->weight.grad().reshape({-1}), bits - 1,
                                    name, /*may_be_exact=*/true);
    }
  });
}

TEST_P(CommHooks, PowerSGDIsAllReduceBeforeItsStartAndKeepsReplicasIdenticalAfter) {
  run([](int rank) {
    World world = init();
    int n = world.size();
    torch::manual_seed(10);
    Mlp model;
    torch::manual_seed(10);
    Mlp reference;
    model->to(torch::kDouble);
    reference->to(torch::kDouble);
    DDP<Mlp> ddp(model, world);
    PowerSGD power_sgd(PowerSGDOptions().start_powerSGD_iter(3).matrix_approximation_rank(2));
    ddp.register_comm_hook(power_sgd.hook());
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    torch::optim::SGD reference_optimizer(reference->parameters(), 0.1);
    for (int step = 0; step < 6; ++step) {
      auto [x, y] = global_batch(step, 4 * n, {20});
      x = x.to(torch::kDouble);
      y = y.to(torch::kDouble);
      optimizer.zero_grad();
      torch::mse_loss(ddp(x.narrow(0, 4 * rank, 4)), y.narrow(0, 4 * rank, 4)).backward();
      EXPECT_EQ(power_sgd.iteration(), step + 1);
      optimizer.step();
      expect_same_on_every_rank(world, flatten(model->parameters()),
                                "parameters after step " + std::to_string(step));
      if (step < 3) {
        reference_optimizer.zero_grad();
        torch::mse_loss(reference(x), y).backward();
        reference_optimizer.step();
        expect_close_parameters(*model, *reference, kFloat64Tolerance,
                                "before start_powerSGD_iter, step " + std::to_string(step));
      }
    }
    EXPECT_LT(power_sgd.values_after_compression(), power_sgd.values_before_compression());
  });
}

TEST_P(CommHooks, PowerSGDSendsNPlusMTimesRValuesPerCompressedMatrix) {
  run([](int rank) {
    World world = init();
    for (int64_t r : {1, 4}) {
      torch::manual_seed(11);
      Mlp model; // 20-32-32-5
      DDP<Mlp> ddp(model, world);
      PowerSGD power_sgd(PowerSGDOptions().start_powerSGD_iter(2).matrix_approximation_rank(r));
      ddp.register_comm_hook(power_sgd.hook());
      int64_t expected = 0;
      for (const auto& p : model->parameters()) {
        int64_t rows = p.size(0);
        int64_t columns = p.numel() / rows;
        int64_t rank_used = std::min({rows, columns, r});
        bool compressed = rows * columns > 2 * (rows + columns) * rank_used;
        EXPECT_EQ(compressed, p.dim() == 2 && !(r == 4 && rows == 5))
            << "1-D tensors, and fc3 at rank 4, go uncompressed";
        expected += 4 * (compressed ? (rows + columns) * rank_used : rows * columns);
      }
      for (int step = 0; step < 3; ++step) {
        auto [x, y] = global_batch(step, 8, {20});
        torch::mse_loss(ddp(x.narrow(0, 4 * (rank % 2), 4)), y.narrow(0, 4 * (rank % 2), 4))
            .backward();
      }
      EXPECT_EQ(ddp.stats().last.bytes_reduced, expected) << "rank " << r;
    }
  });
}

TEST_P(CommHooks, PowerSGDsErrorFeedbackCarriesTheResidual) {
  // The same gradients every step (no optimizer step): without error
  // feedback the applied gradient misses the true average by the same
  // amount every step, and the misses add up; with it, the sum of the
  // misses is the (bounded) error kept, not lost.
  run([](int rank) {
    World world = init();
    auto residual_after = [&](bool feedback, int steps) {
      torch::manual_seed(12);
      Mlp model;
      torch::manual_seed(12);
      Mlp local;
      model->to(torch::kDouble);
      local->to(torch::kDouble);
      DDP<Mlp> ddp(model, world);
      PowerSGD power_sgd(PowerSGDOptions().start_powerSGD_iter(2).use_error_feedback(feedback));
      ddp.register_comm_hook(power_sgd.hook());
      auto [x, y] = global_batch(0, 8, {20});
      x = x.narrow(0, 4 * (rank % 2), 4).to(torch::kDouble);
      y = y.narrow(0, 4 * (rank % 2), 4).to(torch::kDouble);
      torch::mse_loss(local(x), y).backward();
      auto average = flatten(gradients_of(*local));
      world.all_reduce(average, ReduceOp::Average);
      auto residual = torch::zeros_like(average);
      for (int step = 0; step < steps + 2; ++step) {
        model->zero_grad();
        torch::mse_loss(ddp(x), y).backward();
        if (step >= 2) {
          residual += average - flatten(gradients_of(*model));
        }
      }
      return std::pair{residual.norm().item<double>(), average.norm().item<double>()};
    };
    auto [lost_10, norm] = residual_after(false, 10);
    double lost_40 = residual_after(false, 40).first;
    double kept_10 = residual_after(true, 10).first;
    double kept_40 = residual_after(true, 40).first;
    EXPECT_GT(lost_40, 3.5 * lost_10) << "without feedback, the misses add up";
    EXPECT_LT(kept_40, 1.5 * kept_10 + 1e-9) << "with it, they stay bounded";
    EXPECT_LT(kept_40, 0.25 * lost_40)
        << "far below what is lost without it (gradient norm " << norm << ", lost after 10 "
        << lost_10 << ", kept after 10 " << kept_10 << ")";
  });
}

} // namespace
} // namespace lockstep::testing
