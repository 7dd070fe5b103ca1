// Mixed precision: lockstep::amp::GradScaler against what PyTorch 2.6's
// torch.amp.GradScaler("cpu") did over the same scripted gradients
// (tests/fixtures/grad_scaler_torch26.txt, recorded by
// tests/fixtures/grad_scaler_reference.py), bit for bit; every rank
// skipping together with an inf on one rank only; and the autocast guard's
// nesting and restore.

#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/autocast.h>
#include <lockstep/grad_scaler.h>
#include <lockstep/lockstep.h>

#include "support/expect_error.h"
#include "support/models.h"
#include "support/multiprocess.h"
#include "support/training.h"
#include "support/paths.h"
#include "support/scratch_folder.h"
#include "support/shared_folder.h"

namespace lockstep::testing {
namespace {

using amp::GradScaler;
using amp::GradScalerOptions;

// tests/fixtures/grad_scaler_reference.py's scripted_c.
torch::Tensor scripted_c(int64_t step, const std::string& plant) {
  auto c = torch::tensor({((step % 5) - 2.5) / 8, static_cast<double>(step % 3 + 1) / 16, -0.375,
                          0.125 * static_cast<double>(1 + step % 2)},
                         torch::kFloat);
  if (plant == "overflow") {
    c[1] = 3.0e38;
  } else if (plant == "nan") {
    c[2] = std::numeric_limits<float>::quiet_NaN();
  }
  return c;
}

struct Scenario {
  GradScalerOptions options;
  int64_t steps;
  std::map<int64_t, std::string> plants;
};

TEST(GradScaler, FollowsPyTorchsOverAScriptedSequenceBitForBit) {
  std::map<std::string, Scenario> scenarios{
      {"defaults", {GradScalerOptions(), 12, {{3, "overflow"}, {4, "overflow"}, {8, "nan"}}}},
      {"growth",
       {GradScalerOptions().init_scale(8).growth_factor(2).backoff_factor(0.5).growth_interval(3),
        20,
        {{5, "overflow"}, {11, "nan"}, {12, "overflow"}}}}};
  std::ifstream fixture(std::string(lockstep::testing::source_dir()) +
                        "/tests/fixtures/grad_scaler_torch26.txt");
  ASSERT_TRUE(fixture) << "the fixture is missing";
  std::map<std::string, std::vector<std::string>> lines;
  for (std::string line; std::getline(fixture, line);) {
    lines[line.substr(0, line.find(' '))].push_back(line);
  }
  for (auto& [name, scenario] : scenarios) {
    ASSERT_EQ(static_cast<int64_t>(lines[name].size()), scenario.steps) << name;
    auto p = torch::tensor({1.0, -0.5, 0.25, 2.0}, torch::kFloat).requires_grad_();
    torch::optim::SGD optimizer({p}, 0.5);
    GradScaler scaler(scenario.options);
    for (int64_t step = 0; step < scenario.steps; ++step) {
      optimizer.zero_grad();
      auto plant = scenario.plants.count(step) ? scenario.plants[step] : "";
      auto loss = (p * scripted_c(step, plant)).sum();
      scaler.scale(loss).backward();
      bool stepped = scaler.step(optimizer);
      scaler.update();
      std::istringstream expected(lines[name][static_cast<size_t>(step)]);
      std::string scenario_name, scale_text;
      int64_t expected_step = 0;
      int skipped = 0;
      expected >> scenario_name >> expected_step >> scale_text >> skipped;
      ASSERT_EQ(expected_step, step);
      EXPECT_EQ(scaler.get_scale(), std::strtod(scale_text.c_str(), nullptr))
          << name << " after step " << step;
      EXPECT_EQ(stepped, skipped == 0) << name << " at step " << step;
      for (int64_t i = 0; i < 4; ++i) {
        std::string value;
        expected >> value;
        EXPECT_EQ(p[i].item<float>(), static_cast<float>(std::strtod(value.c_str(), nullptr)))
            << name << ": p[" << i << "] after step " << step;
      }
    }
  }
}

TEST(GradScaler, StateRoundTripsAndMisuseIsNamed) {
  GradScaler scaler(GradScalerOptions().init_scale(4).growth_interval(2));
  auto p = torch::ones({3}, torch::kFloat).requires_grad_();
  torch::optim::SGD optimizer({p}, 0.5);
  scaler.scale(p.sum()).backward();
  scaler.step(optimizer);
  scaler.update();
  EXPECT_EQ(scaler.growth_tracker(), 1);
  torch::serialize::OutputArchive out;
  scaler.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  GradScaler loaded;
  torch::serialize::InputArchive in;
  std::istringstream source(bytes.str());
  in.load_from(source);
  loaded.load(in);
  EXPECT_EQ(loaded.get_scale(), 4.0);
  EXPECT_EQ(loaded.growth_tracker(), 1);
  EXPECT_EQ(loaded.options().growth_interval(), 2);

  optimizer.zero_grad();
  scaler.scale(p.sum()).backward();
  scaler.unscale_(optimizer);
  expect_error<UsageError>([&] { scaler.unscale_(optimizer); },
                           {"unscale_() has already been called on this optimizer"});
  scaler.step(optimizer);
  expect_error<UsageError>([&] { scaler.step(optimizer); }, {"step() has already been called"});
  scaler.update();
  expect_error<UsageError>([&] { scaler.update(); }, {"No inf checks were recorded"});
  expect_error<ConfigError>([&] { GradScaler(GradScalerOptions().growth_factor(0.5)); },
                            {"growth_factor should be > 1"});
  // Disabled, it passes everything through.
  GradScaler off(GradScalerOptions().enabled(false));
  auto loss = p.sum();
  EXPECT_TRUE(off.scale(loss).is_same(loss));
  EXPECT_EQ(off.get_scale(), 1.0);
}

/// A float32 MLP's step on every rank, rank `planted`'s batch poisoned
/// with an inf when `poison` (its gradients all inf or NaN once averaged).
class EveryRankSkipsTogether : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryRankSkipsTogether, WithAnInfOnOneRankOnly) {
  const std::string how = GetParam();
  run_ranks(3, [how](int rank) {
    World world = init();
    torch::manual_seed(5);
    Mlp model;
    std::optional<DDP<Mlp>> ddp;
    if (how != "zero_without_ddp") {
      ddp.emplace(model, world);
    }
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    bool in_backward = how.find("in_backward") != std::string::npos;
    if (how.rfind("zero", 0) == 0) {
      optimizer = std::make_unique<ZeroRedundancyOptimizer<torch::optim::SGD>>(
          model->parameters(), world, torch::optim::SGDOptions(0.1));
    } else {
      optimizer = std::make_unique<torch::optim::SGD>(model->parameters(),
                                                      torch::optim::SGDOptions(0.1));
    }
    GradScaler scaler(GradScalerOptions().init_scale(1024));
    if (in_backward) {
      ddp->step_in_backward(*optimizer, StepInBackwardOptions().grad_scaler(&scaler));
    }
    // Rank 2 runs out of batches a step early: inside the join guard it
    // steps along with the others, and its scale must stay theirs.
    bool uneven = how.rfind("uneven", 0) == 0;
    std::optional<JoinGuard> join;
    if (uneven) {
      join.emplace(ddp->join());
    }
    for (int64_t step = 0; step < 4; ++step) {
      if (uneven && rank == 2 && step == 3) {
        break;
      }
      auto [x, y] = global_batch(step, 4 * world.size(), {20});
      x = x.narrow(0, 4 * rank, 4).clone();
      y = y.narrow(0, 4 * rank, 4);
      bool poison = step == 2 && rank == 1;
      if (poison) {
        x[0][0] = std::numeric_limits<float>::infinity();
      }
      optimizer->zero_grad();
      auto forward = [&](const torch::Tensor& input) {
        return ddp ? (*ddp)(input) : model(input);
      };
      if (how == "no_sync") {
        // Half the batch accumulated without averaging (the inf there),
        // the other half with.
        {
          auto guard = ddp->no_sync();
          scaler.scale(torch::mse_loss(forward(x.narrow(0, 0, 2)), y.narrow(0, 0, 2)))
              .backward();
        }
        scaler.scale(torch::mse_loss(forward(x.narrow(0, 2, 2)), y.narrow(0, 2, 2)))
            .backward();
      } else if (in_backward) {
        auto before = flatten(model->parameters());
        scaler.scale(torch::mse_loss(forward(x), y)).backward();
        bool stepped = !torch::equal(before, flatten(model->parameters()));
        EXPECT_EQ(stepped, step != 2) << "rank " << rank << " at step " << step;
        if (step == 0) {
          // A second stepping backward before update() is named.
          expect_error<UsageError>(
              [&] { scaler.scale(torch::mse_loss(forward(x), y)).backward(); },
              {"without scaler.update() in between"});
        }
        scaler.update();
        continue;
      } else {
        scaler.scale(torch::mse_loss(forward(x), y)).backward();
      }
      auto before = flatten(model->parameters());
      bool stepped = scaler.step(*optimizer);
      scaler.update();
      EXPECT_EQ(stepped, step != 2) << "rank " << rank << " at step " << step;
      if (step == 2) {
        EXPECT_TRUE(torch::equal(before, flatten(model->parameters())));
      }
      auto scale = torch::tensor({scaler.get_scale()}, torch::kDouble);
      expect_same_on_every_rank(world, scale, "the scale after step " + std::to_string(step));
    }
    if (join) {
      join->finish();
    }
    EXPECT_EQ(scaler.get_scale(), 512.0);
    if (ddp) {
      ddp->check_replicas();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ways, EveryRankSkipsTogether,
                         ::testing::Values("ddp", "no_sync", "zero", "zero_without_ddp",
                                           "step_in_backward", "zero_in_backward",
                                           "uneven_in_backward"),
                         [](const auto& info) { return info.param; });

/// DDP's mixed-precision policy beside the loop it stands for, written by
/// hand: a bfloat16 copy of float32 masters, its gradients averaged in
/// reduce_dtype over the same world, the masters stepped. Two ranks, so that
/// every sum is of two terms and exact whatever the order: the parameters
/// must be equal to the bit after every step.
class MixedPrecisionPolicy : public ::testing::TestWithParam<std::string> {};

TEST_P(MixedPrecisionPolicy, EqualsAHandCastLoopBitForBit) {
  const std::string how = GetParam();
  run_ranks(2, [how](int rank) {
    World world = init();
    const int n = world.size();
    bool reduce_in_bf16 = how == "bf16" || how == "hook";
    torch::manual_seed(11);
    Mlp model;
    Mlp masters;
    {
      torch::NoGradGuard no_grad;
      auto from = model->parameters();
      auto to = masters->parameters();
      for (size_t i = 0; i < from.size(); ++i) {
        to[i].copy_(from[i]);
      }
    }
    auto policy = lockstep::MixedPrecision().param_dtype(torch::kBFloat16);
    if (!reduce_in_bf16) {
      policy.reduce_dtype(torch::kFloat);
    }
    DDP<Mlp> ddp(model, world, DdpOptions().mixed_precision(policy));
    if (how == "hook") {
      ddp.register_comm_hook(hooks::allreduce());
    }
    auto kind = how == "zero" ? OptimizerKind::Adam : OptimizerKind::Sgd;
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    if (how == "zero") {
      optimizer = std::make_unique<ZeroRedundancyOptimizer<torch::optim::Adam>>(
          model->parameters(), world, torch::optim::AdamOptions(0.01));
    } else {
      optimizer = make_optimizer(kind, model->parameters());
    }
    auto reference = how == "zero" ? std::make_unique<torch::optim::Adam>(
                                         masters->parameters(), torch::optim::AdamOptions(0.01))
                                   : make_optimizer(kind, masters->parameters());
    if (how == "step_in_backward") {
      ddp.step_in_backward(*optimizer);
    }
    auto loss_of = [](const torch::Tensor& output, const torch::Tensor& y) {
      return torch::mse_loss(output.to(torch::kFloat), y);
    };
    for (int64_t step = 0; step < 5; ++step) {
      auto [x, y] = global_batch(step, 8 * n, {20});
      x = x.narrow(0, 8 * rank, 8).clone();
      y = y.narrow(0, 8 * rank, 8).clone();

      // The loop by hand.
      Mlp copy;
      {
        torch::NoGradGuard no_grad;
        copy->to(torch::kBFloat16);
        auto to = copy->parameters();
        auto from = masters->parameters();
        for (size_t i = 0; i < to.size(); ++i) {
          to[i].copy_(from[i].to(torch::kBFloat16));
        }
      }
      // Each backward's bfloat16 gradients, summed in float32 (as the
      // wrapper accumulates under no_sync()).
      std::vector<torch::Tensor> sums;
      auto add_gradients = [&] {
        torch::NoGradGuard no_grad;
        auto low = copy->parameters();
        for (size_t i = 0; i < low.size(); ++i) {
          auto gradient = low[i].grad().to(torch::kFloat);
          if (sums.size() <= i) {
            sums.push_back(gradient);
          } else {
            sums[i] += gradient;
          }
          low[i].mutable_grad().reset();
        }
      };
      if (how == "no_sync") {
        loss_of(copy(x.narrow(0, 0, 4).to(torch::kBFloat16)), y.narrow(0, 0, 4)).backward();
        add_gradients();
        loss_of(copy(x.narrow(0, 4, 4).to(torch::kBFloat16)), y.narrow(0, 4, 4)).backward();
        add_gradients();
      } else {
        loss_of(copy(x.to(torch::kBFloat16)), y).backward();
        add_gradients();
      }
      reference->zero_grad();
      {
        torch::NoGradGuard no_grad;
        auto high = masters->parameters();
        for (size_t i = 0; i < high.size(); ++i) {
          at::Tensor average = sums[i];
          if (how == "hook") {
            // The user's hook (an average) on the bucket in bfloat16.
            auto wire = average.to(torch::kBFloat16);
            world.all_reduce(wire, ReduceOp::Average);
            average = wire.to(torch::kFloat);
          } else if (reduce_in_bf16) {
            auto wire = (average / n).to(torch::kBFloat16);
            world.all_reduce(wire, ReduceOp::Sum);
            average = wire.to(torch::kFloat);
          } else {
            world.all_reduce(average, ReduceOp::Sum);
            average.div_(n);
          }
          high[i].mutable_grad() = average;
        }
      }
      reference->step();

      // The same through the policy.
      optimizer->zero_grad();
      if (how == "no_sync") {
        {
          auto guard = ddp.no_sync();
          loss_of(ddp(x.narrow(0, 0, 4)), y.narrow(0, 0, 4)).backward();
        }
        loss_of(ddp(x.narrow(0, 4, 4)), y.narrow(0, 4, 4)).backward();
      } else {
        auto output = ddp(x);
        EXPECT_EQ(output.scalar_type(), torch::kBFloat16);
        loss_of(output, y).backward();
      }
      if (how != "step_in_backward") {
        optimizer->step();
      }
      auto ours = model->parameters();
      auto theirs = masters->parameters();
      for (size_t i = 0; i < ours.size(); ++i) {
        ASSERT_EQ(ours[i].scalar_type(), torch::kFloat);
        ASSERT_TRUE(torch::equal(ours[i], theirs[i]))
            << how << ": parameter " << i << " after step " << step << " differs by "
            << (ours[i] - theirs[i]).abs().max().item<double>();
      }
    }
    // An evaluation forward computes in bfloat16 and leaves the masters.
    {
      torch::NoGradGuard no_grad;
      EXPECT_EQ(ddp(torch::ones({2, 20})).scalar_type(), torch::kBFloat16);
    }
    for (const auto& param : model->parameters()) {
      EXPECT_EQ(param.scalar_type(), torch::kFloat);
    }
    ddp.check_replicas();
  });
}

INSTANTIATE_TEST_SUITE_P(Ways, MixedPrecisionPolicy,
                         ::testing::Values("bf16", "reduce_fp32", "hook", "no_sync",
                                           "step_in_backward", "zero"),
                         [](const auto& info) { return info.param; });

TEST(MixedPrecisionPolicy, RefusesWhatItCannotKeepAndCheckpointsTheScaler) {
  ScratchFolder folder("grad-scaler");
  auto result = launch_ranks(with_shared_folder(2, folder.path()), [](int) {
    World world = init();
    Mlp low;
    low->to(torch::kBFloat16);
    expect_error<UsageError>(
        [&] {
          DDP<Mlp>(low, world, DdpOptions().mixed_precision(lockstep::MixedPrecision()));
        },
        {"must be float32 or float64", "Build the model in float32"});
    Mlp model;
    expect_error<ConfigError>(
        [&] {
          DDP<Mlp>(model, world,
                   DdpOptions().mixed_precision(lockstep::MixedPrecision().param_dtype(torch::kLong)));
        },
        {"MixedPrecision takes floating dtypes"});

    // A forward that raises leaves the masters in place, and a join guard
    // cannot divide by the ranks still training through the policy's cast.
    {
      DDP<Mlp> ddp(model, world, DdpOptions().mixed_precision(lockstep::MixedPrecision()));
      EXPECT_THROW(ddp(torch::ones({2, 7})), std::exception);
      for (const auto& param : model->parameters()) {
        EXPECT_EQ(param.scalar_type(), torch::kFloat);
      }
      expect_error<UsageError>(
          [&] { auto join = ddp.join(JoinOptions().divide_by_initial_world_size(false)); },
          {"divide_by_initial_world_size(false)", "communication hook"});
    }

    // A GradScaler travels in a checkpoint.
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    GradScaler scaler(GradScalerOptions().init_scale(256).growth_interval(3));
    scaler.scale(model(torch::ones({2, 20})).sum()).backward();
    scaler.step(optimizer);
    scaler.update();
    std::string path = shared_folder() + "/scaler.pt";
    CheckpointItems items;
    items.module("model", *model).optimizer("optimizer", optimizer).grad_scaler("scaler", scaler);
    save_checkpoint(world, path, items);
    GradScaler resumed;
    CheckpointItems into;
    into.module("model", *model).optimizer("optimizer", optimizer).grad_scaler("scaler", resumed);
    load_checkpoint(world, path, into);
    EXPECT_EQ(resumed.get_scale(), 256.0);
    EXPECT_EQ(resumed.growth_tracker(), 1);
    EXPECT_EQ(resumed.options().growth_interval(), 3);
    GradScaler other;
    CheckpointItems missing;
    missing.module("model", *model).grad_scaler("other", other);
    expect_error<CheckpointError>([&] { load_checkpoint(world, path, missing); },
                                  {"holds no grad scaler named"});
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST(Autocast, NestsAndRestoresTheStateItFound) {
  auto a = torch::randn({8, 8});
  auto b = torch::randn({8, 8});
  EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat);
  {
    amp::Autocast outer(torch::kCPU);
    EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
    {
      amp::Autocast off(torch::kCPU, std::nullopt, /*enabled=*/false);
      EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat);
    }
    EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
    // What needs the range runs in float32 under it.
    auto product = torch::mm(a, b);
    EXPECT_EQ(torch::mse_loss(product, product).scalar_type(), torch::kFloat);
  }
  EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat);
#if TORCH_VERSION_MAJOR >= 2
  {
    amp::Autocast half(torch::kCPU, torch::kHalf);
    EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kHalf);
  }
#else
  expect_error<ConfigError>([] { amp::Autocast half(torch::kCPU, torch::kHalf); },
                            {"bfloat16 (float16 too from LibTorch 2)"});
#endif
  EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat);
}

} // namespace
} // namespace lockstep::testing
