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

#include "support/expect_error.h"
#include "support/models.h"
#include "support/multiprocess.h"
#include "support/scratch_folder.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

enum class Kind { Sgd, Adam, AdamW };
enum class Way { InBackward, Zero, ZeroInBackward };

const char* name_of(Kind kind) {
  return kind == Kind::Sgd ? "SGD (momentum, weight decay)" : kind == Kind::Adam ? "Adam" : "AdamW";
}
const char* name_of(Way way) {
  return way == Way::InBackward ? "step in backward"
         : way == Way::Zero     ? "ZeRO"
                                : "ZeRO stepping in backward";
}

void PrintTo(Way way, std::ostream* out) {
  *out << name_of(way);
}

torch::optim::SGDOptions sgd_options() {
  return torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-2);
}
torch::optim::AdamOptions adam_options() {
  return torch::optim::AdamOptions(1e-2).weight_decay(1e-3);
}
torch::optim::AdamWOptions adamw_options() {
  return torch::optim::AdamWOptions(1e-2);
}

std::unique_ptr<torch::optim::Optimizer> plain_optimizer(Kind kind,
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

std::unique_ptr<torch::optim::Optimizer> zero_optimizer(Kind kind,
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
std::unique_ptr<torch::optim::Optimizer> optimizer_of(Way way, Kind kind, DDP<Mlp>& ddp,
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

Mlp float64_mlp(int seed) {
  torch::manual_seed(seed);
  Mlp model;
  model->to(torch::kDouble);
  return model;
}

torch::Tensor shard(const torch::Tensor& t, int rank, int64_t per_rank) {
  return t.narrow(0, rank * per_rank, per_rank);
}

constexpr int64_t kPerRank = 4;

// One parameter per bucket: each bucket steps while the later ones are
// still being reduced.
DdpOptions one_parameter_per_bucket() {
  return DdpOptions().bucket_cap_mb(0).first_bucket_cap_mb(0);
}

std::pair<torch::Tensor, torch::Tensor> batch(int64_t step, int n) {
  auto [x, y] = global_batch(step, kPerRank * n, {20});
  return {x.to(torch::kDouble), y.to(torch::kDouble)};
}

struct Scenario {
  bool no_sync = false;   // two micro-batches, the first under no_sync
  bool scheduler = false; // StepLR halving the learning rate every 2 steps
  std::optional<double> clip;
  int steps = 4;
};

void expect_bit_identical(torch::nn::Module& actual, torch::nn::Module& expected,
                          const std::string& context) {
  EXPECT_TRUE(flatten(actual.parameters()).equal(flatten(expected.parameters())))
      << context << ": the parameters differ from plain DDP's by "
      << (flatten(actual.parameters()) - flatten(expected.parameters())).abs().max().item<double>();
}

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
    std::string context = std::string(name_of(way)) + ", " + name_of(kind) + ", after step " +
                          std::to_string(step);
    expect_bit_identical(*model, *plain, context);
    expect_close_parameters(*model, *reference, kFloat64Tolerance, context);
    expect_same_on_every_rank(world, flatten(model->parameters()), "parameters " + context);
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

std::string shared_folder() {
  return std::getenv("LOCKSTEP_TEST_FOLDER");
}

void train_steps(DDP<Mlp>& ddp, torch::optim::Optimizer& optimizer, bool steps_itself,
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

// A ZeRO checkpoint of 4 ranks resumes at 2: from the shards (put together
// and partitioned anew) and from the consolidated state, which a plain
// optimizer loads too. All three continue bit-identically to plain DDP
// resumed from its own checkpoint of the same run.
TEST(ZeroCheckpoint, ResumesAtAnotherWorldSize) {
  ScratchFolder folder("zero-resize");
  auto with_folder = [&](int size) {
    LaunchOptions launch;
    launch.world_size = size;
    launch.timeout = std::chrono::seconds(120);
    launch.environment = [folder = folder.path()](int, RankEnvironment& env) {
      env["LOCKSTEP_TEST_FOLDER"] = folder;
    };
    return launch;
  };
  auto write = launch_ranks(with_folder(4), [](int rank) {
    World world = init();
    DDP<Mlp> plain(float64_mlp(3), world);
    DDP<Mlp> sharded(float64_mlp(3), world);
    DDP<Mlp> consolidated(float64_mlp(3), world);
    auto plain_optimizer_ = plain_optimizer(Kind::Adam, plain.module()->parameters());
    auto shards = optimizer_of(Way::ZeroInBackward, Kind::Adam, sharded, world, {},
                               ZeroOptions().checkpoint_shards(true));
    auto whole = optimizer_of(Way::Zero, Kind::Adam, consolidated, world);
    DDP<Mlp> sliced(float64_mlp(3), world);
    auto slices = optimizer_of(
        Way::ZeroInBackward, Kind::Adam, sliced, world, {},
        ZeroOptions().checkpoint_shards(true).partition(ZeroPartition::Elements));
    train_steps(plain, *plain_optimizer_, true, 0, 3, rank, 4);
    train_steps(sharded, *shards, false, 0, 3, rank, 4);
    train_steps(consolidated, *whole, true, 0, 3, rank, 4);
    train_steps(sliced, *slices, false, 0, 3, rank, 4);
    save_checkpoint(world, shared_folder() + "/plain", *plain.module(), *plain_optimizer_);
    save_checkpoint(world, shared_folder() + "/shards", *sharded.module(), *shards);
    save_checkpoint(world, shared_folder() + "/consolidated", *consolidated.module(), *whole);
    save_checkpoint(world, shared_folder() + "/slices", *sliced.module(), *slices);
  });
  ASSERT_TRUE(write.ok()) << write.report();
  auto read = launch_ranks(with_folder(2), [](int rank) {
    World world = init();
    auto resume = [&](const std::string& file, Way way, bool zero,
                      ZeroPartition partition = ZeroPartition::Parameters) {
      auto ddp = std::make_unique<DDP<Mlp>>(float64_mlp(11), world);
      auto optimizer = zero ? optimizer_of(way, Kind::Adam, *ddp, world, {},
                                           ZeroOptions().partition(partition))
                            : plain_optimizer(Kind::Adam, ddp->module()->parameters());
      load_checkpoint(world, shared_folder() + "/" + file, *ddp->module(), *optimizer);
      train_steps(*ddp, *optimizer, way == Way::Zero || !zero, 3, 5, rank, 2);
      return ddp;
    };
    auto plain = resume("plain", Way::Zero, false);
    expect_bit_identical(*resume("shards", Way::Zero, true)->module(), *plain->module(),
                         "ZeRO from 4 ranks' shards");
    expect_bit_identical(*resume("consolidated", Way::ZeroInBackward, true)->module(),
                         *plain->module(), "ZeRO from the consolidated state");
    expect_bit_identical(*resume("consolidated", Way::Zero, false)->module(), *plain->module(),
                         "a plain Adam from ZeRO's consolidated state");
    expect_bit_identical(*resume("slices", Way::Zero, true)->module(), *plain->module(),
                         "ZeRO by parameters from 4 ranks' slices");
    expect_bit_identical(
        *resume("shards", Way::Zero, true, ZeroPartition::Elements)->module(), *plain->module(),
        "ZeRO in slices from 4 ranks' shards by parameters");
    expect_bit_identical(
        *resume("plain", Way::ZeroInBackward, true, ZeroPartition::Elements)->module(),
        *plain->module(), "ZeRO in slices from a plain Adam's state");
  });
  EXPECT_TRUE(read.ok()) << read.report();
}

// Each rank holds the state of its shard alone. By parameters, with 8 equal
// ones, an even partition exists and is found; in equal slices, any model
// divides evenly (here the test MLP, whose tensors are all of other sizes).
// The largest rank's saved state is then 1/N of the moments, plus at most
// 64 KiB of archive. (bench/run-optimizer measures the 10.5M MLP.)
TEST(ZeroState, EachRankHoldsItsShardAlone) {
  for (int n : {2, 4}) {
    SCOPED_TRACE(std::to_string(n) + " ranks");
    run_ranks(n, [](int) {
      World world = init();
      torch::manual_seed(1);
      torch::nn::Sequential equal;
      for (int i = 0; i < 8; ++i) {
        equal->push_back(torch::nn::Linear(torch::nn::LinearOptions(128, 128).bias(false)));
      }
      Mlp uneven(300, 200, 7);
      for (auto partition : {ZeroPartition::Parameters, ZeroPartition::Elements}) {
        auto params = partition == ZeroPartition::Parameters ? equal->parameters()
                                                             : uneven->parameters();
        int64_t total = 0;
        for (const auto& param : params) {
          total += param.numel();
        }
        ZeroRedundancyOptimizer<torch::optim::Adam> zero(
            params, world, torch::optim::AdamOptions(1e-3), ZeroOptions().partition(partition));
        for (auto& param : params) {
          param.mutable_grad() = torch::ones_like(param);
        }
        zero.step();
        auto bytes = torch::tensor({static_cast<double>(zero.state_bytes())}, torch::kDouble);
        world.all_reduce(bytes, ReduceOp::Max);
        // exp_avg and exp_avg_sq of a 1/N share of the float32 elements.
        double moments = 2.0 * 4 * static_cast<double>((total + world.size() - 1) / world.size());
        EXPECT_GE(bytes.item<double>(), moments);
        EXPECT_LE(bytes.item<double>(), moments + 65536);
      }
    });
  }
}

TEST(StepInBackwardErrors, EachMisuseIsNamed) {
  run_ranks(2, [](int rank) {
    World world = init();
    {
      DDP<Mlp> ddp(float64_mlp(3), world);
      torch::optim::Adam adam(ddp.module()->parameters(), adam_options());
      ddp.step_in_backward(adam);
      expect_error<UsageError>([&] { ddp.step_in_backward(adam); },
                               {"already steps inside backward", "twice"});
      auto [x, y] = batch(0, 2);
      adam.zero_grad();
      torch::mse_loss(ddp(shard(x, rank, kPerRank)), shard(y, rank, kPerRank)).backward();
      adam.step(); // the mistake: the parameters already stepped
      expect_error<UsageError>([&] { ddp(shard(x, rank, kPerRank)); },
                               {"changed in place after the step inside backward",
                                "optimizer.step() was called", "Remove the call"});
    }
    {
      DDP<Mlp> ddp(float64_mlp(3), world);
      auto [x, y] = batch(0, 2);
      ddp(shard(x, rank, kPerRank));
      torch::optim::SGD sgd(ddp.module()->parameters(), sgd_options());
      expect_error<UsageError>([&] { ddp.step_in_backward(sgd); },
                               {"before the first forward"});
    }
    {
      DDP<Mlp> ddp(float64_mlp(3), world);
      auto stranger = torch::zeros({3}, torch::requires_grad());
      torch::optim::SGD sgd({stranger}, sgd_options());
      expect_error<UsageError>([&] { ddp.step_in_backward(sgd); },
                               {"not a parameter of the wrapped module", "never step"});
    }
    {
      DDP<Mlp> ddp(float64_mlp(3), world);
      ZeroRedundancyOptimizer<torch::optim::Adam> zero(ddp.module()->parameters(), world,
                                                       adam_options());
      ddp.step_in_backward(zero);
      auto [x, y] = batch(0, 2);
      zero.zero_grad();
      torch::mse_loss(ddp(shard(x, rank, kPerRank)), shard(y, rank, kPerRank)).backward();
      expect_error<UsageError>([&] { zero.step(); },
                               {"already steps inside backward", "twice"});
      torch::serialize::OutputArchive archive;
      expect_error<UsageError>([&] { zero.save(archive); },
                               {"consolidate_state_dict(", "on every rank first"});
      expect_error<UsageError>([&] { zero.consolidated(); }, {"consolidate_state_dict"});
      zero.consolidate_state_dict(1);
      if (rank == 1) {
        EXPECT_EQ(zero.consolidated().param_groups().front().params().size(), ddp.module()->parameters().size());
      }
    }
  });
}

} // namespace
} // namespace lockstep::testing
