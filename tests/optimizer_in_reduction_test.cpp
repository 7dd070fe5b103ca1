// The optimizer inside the reduction: ddp.step_in_backward(optimizer),
// ZeroRedundancyOptimizer, and both together. Each way is trained beside
// plain DDP with optimizer.step() after backward in the same process (the
// parameters must be bit-identical: the same arithmetic on the same
// averages) and beside one process on the whole batch (kFloat64Tolerance),
// with replicas bit-identical after every step; in float64, at 2, 3 and 4
// ranks, with no_sync, a learning-rate scheduler, clipping, an uneven last
// batch under Join, and across checkpoint resumes.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "support/multiprocess.h"
#include "support/optimizers.h"
#include "support/scratch_folder.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

struct Scenario {
  bool no_sync = false;   // two micro-batches, the first under no_sync
  bool scheduler = false; // StepLR halving the learning rate every 2 steps
  std::optional<double> clip;
  int steps = 4;
};

// `way` beside plain DDP with optimizer.step() and beside one process.
void train_three_ways(World& world, Kind kind, Way way, const Scenario& scenario,
                      ZeroPartition partition = ZeroPartition::Parameters) {
  int n = world.size();
  int rank = world.rank();
  Mlp model = float64_mlp(3);
  Mlp plain = float64_mlp(3);
  Mlp reference = float64_mlp(3);
  DDP<Mlp> ddp(model, world, one_parameter_per_bucket());
  DDP<Mlp> plain_ddp(plain, world);
  auto optimizer = optimizer_of(way, kind, ddp, world,
                                StepInBackwardOptions().max_grad_norm(scenario.clip),
                                ZeroOptions().partition(partition));
  auto plain_optimizer_ = plain_optimizer(kind, plain->parameters());
  auto reference_optimizer = plain_optimizer(kind, reference->parameters());
  std::vector<std::unique_ptr<torch::optim::StepLR>> schedulers;
  if (scenario.scheduler) {
    for (auto* each : {optimizer.get(), plain_optimizer_.get(), reference_optimizer.get()}) {
      schedulers.push_back(std::make_unique<torch::optim::StepLR>(*each, 2, 0.5));
    }
  }
  int micro = scenario.no_sync ? 2 : 1;
  auto clip = [&](torch::nn::Module& module) {
    if (scenario.clip) {
      torch::nn::utils::clip_grad_norm_(module.parameters(), *scenario.clip);
    }
  };
  for (int step = 0; step < scenario.steps; ++step) {
    for (auto* each : {optimizer.get(), plain_optimizer_.get(), reference_optimizer.get()}) {
      each->zero_grad();
    }
    for (int m = 0; m < micro; ++m) {
      auto [x, y] = batch(step * micro + m, n);
      for (auto* wrapped : {&ddp, &plain_ddp}) {
        std::optional<NoSyncGuard> guard;
        if (m + 1 < micro) {
          guard.emplace(wrapped->no_sync());
        }
        torch::mse_loss((*wrapped)(shard(x, rank, kPerRank)), shard(y, rank, kPerRank))
            .backward();
      }
      torch::mse_loss(reference(x), y).backward();
    }
    if (way == Way::Zero) {
      clip(*model);
      optimizer->step();
    }
    clip(*plain);
    plain_optimizer_->step();
    clip(*reference);
    reference_optimizer->step();
    for (auto& scheduler : schedulers) {
      scheduler->step();
    }
    expect_as_plain_ddp_and_one_process(world, *model, *plain, *reference,
                                        std::string(name_of(way)) + ", " + name_of(kind) +
                                            ", after step " + std::to_string(step));
  }
  // The steps inside backward are timed apart from the wait for buckets.
  if (way == Way::Zero) {
    EXPECT_EQ(ddp.stats().total.step_ms, 0);
  } else {
    EXPECT_GT(ddp.stats().total.step_ms, 0);
  }
}

class OptimizerInReduction : public ::testing::TestWithParam<std::tuple<WorldSetup, Way>> {};

TEST_P(OptimizerInReduction, MatchesPlainDdpBitForBitAndOneProcess) {
  auto [setup, way] = GetParam();
  run_ranks(setup, [way = way](int) {
    World world = init();
    for (auto kind : {Kind::Sgd, Kind::Adam, Kind::AdamW}) {
      SCOPED_TRACE(name_of(kind));
      train_three_ways(world, kind, way, {});
      if (way != Way::InBackward) {
        SCOPED_TRACE("equal slices of the elements");
        train_three_ways(world, kind, way, {}, ZeroPartition::Elements);
      }
    }
    {
      SCOPED_TRACE("no_sync on every other backward, with a scheduler");
      Scenario scenario;
      scenario.no_sync = true;
      scenario.scheduler = true;
      train_three_ways(world, Kind::Adam, way, scenario);
    }
    {
      SCOPED_TRACE("clipped to a total norm of 0.05");
      Scenario scenario;
      scenario.clip = 0.05;
      train_three_ways(world, Kind::AdamW, way, scenario);
      train_three_ways(world, Kind::Sgd, way, scenario);
    }
  }, std::chrono::seconds(180));
}

// Rank r holds `steps - r % 2` batches: the odd ranks run out one step
// early, and the others' last step averages over the ranks that had one
// (divided by the world size, as JoinOptions' default says).
TEST_P(OptimizerInReduction, AnUnevenLastBatchUnderJoinMatchesOneProcess) {
  auto [setup, way] = GetParam();
  if (setup.size < 2) {
    GTEST_SKIP();
  }
  run_ranks(setup, [way = way](int rank) {
    World world = init();
    int n = world.size();
    const int steps = 4;
    for (auto kind : {Kind::Sgd, Kind::Adam}) {
      SCOPED_TRACE(name_of(kind));
      Mlp model = float64_mlp(5);
      Mlp reference = float64_mlp(5);
      DDP<Mlp> ddp(model, world, one_parameter_per_bucket());
      auto optimizer = optimizer_of(way, kind, ddp, world);
      auto reference_optimizer = plain_optimizer(kind, reference->parameters());
      {
        JoinOptions options;
        if (way == Way::Zero) {
          options.optimizers({optimizer.get()});
        }
        auto join = ddp.join(options);
        for (int step = 0; step < steps - rank % 2; ++step) {
          auto [x, y] = batch(step, n);
          optimizer->zero_grad();
          torch::mse_loss(ddp(shard(x, rank, kPerRank)), shard(y, rank, kPerRank)).backward();
          if (way == Way::Zero) {
            optimizer->step();
          }
        }
      }
      for (int step = 0; step < steps; ++step) {
        auto [x, y] = batch(step, n);
        reference_optimizer->zero_grad();
        auto loss = torch::zeros({}, torch::kDouble);
        for (int r = 0; r < n; ++r) {
          if (step < steps - r % 2) {
            loss = loss + torch::mse_loss(reference(shard(x, r, kPerRank)),
                                          shard(y, r, kPerRank)) / n;
          }
        }
        loss.backward();
        reference_optimizer->step();
      }
      expect_close_parameters(*model, *reference, kFloat64Tolerance, "after the join");
      // Every rank stepped along with the same averages, so the optimizer
      // states agree as well: one more step keeps the replicas identical.
      auto [x, y] = batch(steps, n);
      optimizer->zero_grad();
      torch::mse_loss(ddp(shard(x, rank, kPerRank)), shard(y, rank, kPerRank)).backward();
      if (way == Way::Zero) {
        optimizer->step();
      }
      ddp.check_replicas();
    }
  }, std::chrono::seconds(120));
}

TEST_P(OptimizerInReduction, ResumesFromACheckpointExactly) {
  auto [setup, way] = GetParam();
  ScratchFolder folder("optimizer-in-reduction");
  LaunchOptions launch;
  launch.world_size = setup.size;
  launch.timeout = std::chrono::seconds(120);
  launch.environment = [setup = setup, folder = folder.path()](int, RankEnvironment& env) {
    env["LOCKSTEP_TRANSPORT"] = setup.transport;
    env["LOCKSTEP_TEST_FOLDER"] = folder;
  };
  auto result = launch_ranks(launch, [way = way](int rank) {
    World world = init();
    int n = world.size();
    std::vector<ZeroOptions> variants{ZeroOptions()};
    if (way != Way::InBackward) {
      variants.push_back(ZeroOptions().checkpoint_shards(true));
      variants.push_back(ZeroOptions().checkpoint_shards(true).partition(ZeroPartition::Elements));
    }
    for (size_t v = 0; v < variants.size(); ++v) {
      auto zero = variants[v];
      SCOPED_TRACE(zero.checkpoint_shards() ? "each rank's shard saved" : "consolidated");
      SCOPED_TRACE(zero.partition() == ZeroPartition::Elements ? "equal slices" : "parameters");
      auto path = shared_folder() + "/resume" + std::to_string(v);
      DDP<Mlp> ddp(float64_mlp(3), world, one_parameter_per_bucket());
      auto optimizer = optimizer_of(way, Kind::Adam, ddp, world, {}, zero);
      torch::optim::StepLR scheduler(*optimizer, 1, 0.5);
      train_steps(ddp, *optimizer, way == Way::Zero, 0, 2, rank, n);
      scheduler.step();
      save_checkpoint(world, path, *ddp.module(), *optimizer);
      if (way != Way::InBackward) {
        // Written, the whole state is let go of again on rank 0.
        EXPECT_THROW(dynamic_cast<detail::ShardedOptimizer&>(*optimizer).consolidated(),
                     UsageError);
      }
      train_steps(ddp, *optimizer, way == Way::Zero, 2, 4, rank, n);

      DDP<Mlp> resumed(float64_mlp(9), world);
      auto resumed_optimizer = optimizer_of(way, Kind::Adam, resumed, world, {}, zero);
      load_checkpoint(world, path, *resumed.module(), *resumed_optimizer);
      train_steps(resumed, *resumed_optimizer, way == Way::Zero, 2, 4, rank, n);
      expect_bit_identical(*resumed.module(), *ddp.module(), "after the resume");
    }
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

std::vector<std::tuple<WorldSetup, Way>> settings() {
  std::vector<std::tuple<WorldSetup, Way>> all;
  for (const auto& setup : every_world_setup()) {
    if (setup.transport == "gloo" && setup.size != 2) {
      continue; // Gloo at 2 ranks; shared memory at 2, 3 and 4
    }
    for (auto way : {Way::InBackward, Way::Zero, Way::ZeroInBackward}) {
      all.emplace_back(setup, way);
    }
  }
  return all;
}

INSTANTIATE_TEST_SUITE_P(
    WorldSizeAndWay, OptimizerInReduction, ::testing::ValuesIn(settings()),
    [](const auto& info) {
      auto way = std::get<1>(info.param);
      return std::get<0>(info.param).name() +
             (way == Way::InBackward ? "_in_backward" : way == Way::Zero ? "_zero" : "_zero_in_backward");
    });

} // namespace
} // namespace lockstep::testing
