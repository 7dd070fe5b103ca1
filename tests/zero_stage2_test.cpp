// ZeRO-2: DdpOptions::shard_gradients with a ZeroRedundancyOptimizer in
// ZeroPartition::Elements. Each bucket is reduce-scattered, a rank keeps
// the averages of its own slices only, steps them and all-gathers the new
// parameters. Trained beside DDP + ZeRO-1 in the same process, the
// parameters must be bit-identical after every step (the same sums, the
// same elementwise arithmetic, wherever the pieces lie), and within float64
// rounding of one process on the whole batch; in float64, at 1 to 4 ranks,
// over shared memory and Gloo, stepping after backward and inside it.

#include <algorithm>
#include <sstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/clip_grad_norm.h>
#include <lockstep/lockstep.h>

#include "optim/parameter_state.h"
#include "support/expect_error.h"
#include "support/multiprocess.h"
#include "support/scratch_folder.h"
#include "support/shared_folder.h"
#include "support/optimizers.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

// Every torch::optim optimizer that treats each element on its own.
enum class Optim { SgdMomentum, Adam, AdamW, Adagrad, RmsProp };
constexpr Optim kEveryOptim[] = {Optim::SgdMomentum, Optim::Adam, Optim::AdamW,
                                 Optim::Adagrad, Optim::RmsProp};

const char* name_of(Optim optim) {
  switch (optim) {
    case Optim::SgdMomentum:
      return "SGD (momentum, weight decay)";
    case Optim::Adam:
      return "Adam";
    case Optim::AdamW:
      return "AdamW";
    case Optim::Adagrad:
      return "Adagrad";
    default:
      return "RMSprop";
  }
}

// Calls `make` with the options of `optim` and a value of its type.
template <typename Make>
auto with_options(Optim optim, Make make) {
  switch (optim) {
    case Optim::SgdMomentum:
      return make(static_cast<torch::optim::SGD*>(nullptr), torch::optim::SGDOptions(0.05).momentum(0.9)
                                            .weight_decay(1e-2));
    case Optim::Adam:
      return make(static_cast<torch::optim::Adam*>(nullptr), torch::optim::AdamOptions(1e-2).weight_decay(1e-3));
    case Optim::AdamW:
      return make(static_cast<torch::optim::AdamW*>(nullptr), torch::optim::AdamWOptions(1e-2));
    case Optim::Adagrad:
      return make(static_cast<torch::optim::Adagrad*>(nullptr), torch::optim::AdagradOptions(0.05));
    default:
      return make(static_cast<torch::optim::RMSprop*>(nullptr), torch::optim::RMSpropOptions(1e-2).momentum(0.5));
  }
}

std::unique_ptr<torch::optim::Optimizer> plain(Optim optim, std::vector<torch::Tensor> params) {
  return with_options(optim, [&](auto* type, auto options) -> std::unique_ptr<torch::optim::Optimizer> {
    using Type = std::remove_pointer_t<decltype(type)>;
    return std::make_unique<Type>(params, options);
  });
}

std::unique_ptr<detail::ShardedOptimizer> zero(Optim optim, std::vector<torch::Tensor> params,
                                               World& world) {
  return with_options(optim, [&](auto* type, auto options)
                                 -> std::unique_ptr<detail::ShardedOptimizer> {
    using Type = std::remove_pointer_t<decltype(type)>;
    return std::make_unique<ZeroRedundancyOptimizer<Type>>(
        params, world, options, ZeroOptions().partition(ZeroPartition::Elements));
  });
}

struct Scenario {
  bool in_backward = false;
  bool one_parameter_per_bucket = true;
  bool no_sync = false;        // two micro-batches, the first under no_sync
  std::optional<double> clip;  // lockstep::clip_grad_norm_ over the shards (not in backward)
  bool scaler = false;         // a GradScaler, whose step 1 finds an inf and skips
  int steps = 3;
};

// A state's fields, as its own serialization writes them.
detail::StateFields fields_of(const torch::optim::OptimizerParamState& state) {
  torch::serialize::OutputArchive out;
  state.serialize(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  std::istringstream in_bytes(bytes.str());
  torch::serialize::InputArchive in;
  in.load_from(in_bytes);
  return detail::fields_in(in);
}

// Collective: the two optimizers consolidate on rank 0, where every
// parameter's state must be the same, field by field, to the bit.
void expect_same_consolidated_state(detail::ShardedOptimizer& actual,
                                    detail::ShardedOptimizer& expected,
                                    const std::string& context) {
  actual.consolidate_state_dict(0);
  expected.consolidate_state_dict(0);
  if (actual.world().rank() != 0) {
    return;
  }
  const auto& params = actual.all_parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto* mine = detail::find_state(actual.consolidated(), params[i]);
    const auto* theirs = detail::find_state(expected.consolidated(),
                                            expected.all_parameters()[i]);
    ASSERT_EQ(mine == nullptr, theirs == nullptr) << context << ": parameter " << i;
    if (mine == nullptr) {
      continue;
    }
    auto a = fields_of(*mine);
    auto b = fields_of(*theirs);
    ASSERT_EQ(a.size(), b.size()) << context << ": parameter " << i;
    for (size_t f = 0; f < a.size(); ++f) {
      EXPECT_EQ(a[f].first, b[f].first) << context;
      if (a[f].second.isTensor()) {
        EXPECT_TRUE(a[f].second.toTensor().equal(b[f].second.toTensor()))
            << context << ": parameter " << i << "'s " << a[f].first;
      } else if (a[f].second.isInt()) {
        EXPECT_EQ(a[f].second.toInt(), b[f].second.toInt()) << context << ": " << a[f].first;
      }
    }
  }
}

void train_beside_zero_one(World& world, Optim optim, const Scenario& scenario) {
  int n = world.size();
  int rank = world.rank();
  Mlp model = float64_mlp(3);
  Mlp zero_one = float64_mlp(3);
  Mlp reference = float64_mlp(3);
  auto buckets = scenario.one_parameter_per_bucket ? one_parameter_per_bucket() : DdpOptions();
  DDP<Mlp> ddp(model, world, DdpOptions(buckets).shard_gradients(true));
  DDP<Mlp> zero_one_ddp(zero_one, world, buckets);
  auto optimizer = zero(optim, model->parameters(), world);
  auto zero_one_optimizer = zero(optim, zero_one->parameters(), world);
  auto reference_optimizer = plain(optim, reference->parameters());
  if (scenario.in_backward) {
    ddp.step_in_backward(*optimizer);
    zero_one_ddp.step_in_backward(*zero_one_optimizer);
  } else {
    ddp.shard_gradients_with(*optimizer);
  }
  int micro = scenario.no_sync ? 2 : 1;
  amp::GradScaler scaler(amp::GradScalerOptions().init_scale(1024));
  amp::GradScaler zero_one_scaler(amp::GradScalerOptions().init_scale(1024));
  for (int step = 0; step < scenario.steps; ++step) {
    std::string context = std::string(name_of(optim)) + ", after step " + std::to_string(step);
    for (auto* each : {optimizer.get(), zero_one_optimizer.get()}) {
      each->zero_grad();
    }
    reference_optimizer->zero_grad();
    for (int m = 0; m < micro; ++m) {
      auto [x, y] = batch(step * micro + m, n);
      for (auto* wrapped : {&ddp, &zero_one_ddp}) {
        std::optional<NoSyncGuard> guard;
        if (m + 1 < micro) {
          guard.emplace(wrapped->no_sync());
        }
        auto loss =
            torch::mse_loss((*wrapped)(shard(x, rank, kPerRank)), shard(y, rank, kPerRank));
        if (scenario.scaler) {
          // Step 1's loss is infinite on the last rank alone: every rank
          // must skip that step.
          bool inf = step == 1 && rank == n - 1;
          loss = (wrapped == &ddp ? scaler : zero_one_scaler).scale(inf ? loss / 0.0 : loss);
        }
        loss.backward();
      }
      torch::mse_loss(reference(x), y).backward();
    }
    // No rank keeps a whole gradient. After backward, this rank's pieces
    // hold its slices (1/N of the buckets, padding aside), and a parameter
    // has a gradient only where it is one of them, whole; stepped inside
    // backward, none is left.
    std::vector<torch::Tensor> pieces;
    for (const auto& group : optimizer->local_optimizer().param_groups()) {
      for (const auto& piece : group.params()) {
        pieces.push_back(piece);
      }
    }
    int64_t held = 0;
    for (const auto& piece : pieces) {
      held += piece.grad().defined() ? piece.grad().numel() : 0;
    }
    int64_t total = 0;
    for (const auto& param : model->parameters()) {
      total += param.numel();
      bool is_piece = std::any_of(pieces.begin(), pieces.end(),
                                  [&](const torch::Tensor& piece) { return piece.is_same(param); });
      EXPECT_TRUE(!param.grad().defined() || (is_piece && !scenario.in_backward))
          << context << ": the parameter of shape " << param.sizes() << " keeps its gradient";
    }
    // 1/N of each bucket (padded, float64), whose slices hold the averages.
    int64_t slices = 0;
    for (int64_t bytes : ddp.stats().bucket_bytes) {
      slices += bytes / 8 / n;
    }
    EXPECT_LE(held, scenario.in_backward ? 0 : slices) << context;
    // Each bucket's slice: 1/N of its gradients, flags (one per parameter)
    // and extras (2, in the last), rounded up.
    auto count = static_cast<int64_t>(model->parameters().size());
    auto buckets = static_cast<int64_t>(ddp.stats().bucket_bytes.size());
    EXPECT_LE(slices, (total + count + 2) / n + buckets + 1) << context;
    // Whole buckets exist only while they fill and travel: at most two
    // travelling and one filling, where DDP keeps every one.
    int64_t largest = 0;
    int64_t all_buckets = 0;
    for (int64_t bytes : zero_one_ddp.stats().bucket_bytes) {
      largest = std::max(largest, bytes);
      all_buckets += bytes;
    }
    EXPECT_LE(ddp.stats().last.bucket_bytes_held, 3 * (largest + n * 8)) << context;
    EXPECT_EQ(zero_one_ddp.stats().last.bucket_bytes_held, all_buckets) << context;
    if (scenario.clip) {
      double sharded_norm = lockstep::clip_grad_norm_(pieces, *scenario.clip, world);
      double zero_one_norm =
          torch::nn::utils::clip_grad_norm_(zero_one->parameters(), *scenario.clip);
      EXPECT_NEAR(sharded_norm, zero_one_norm, 1e-12 * std::max(1.0, zero_one_norm)) << context;
      torch::nn::utils::clip_grad_norm_(reference->parameters(), *scenario.clip);
    }
    if (scenario.scaler) {
      EXPECT_EQ(scaler.step(*optimizer), step != 1) << context;
      EXPECT_EQ(zero_one_scaler.step(*zero_one_optimizer), step != 1) << context;
      scaler.update();
      zero_one_scaler.update();
      if (step != 1) {
        reference_optimizer->step();
      }
    } else {
      if (!scenario.in_backward) {
        optimizer->step();
        zero_one_optimizer->step();
      }
      reference_optimizer->step();
    }
    if (!scenario.clip) {
      expect_bit_identical(*model, *zero_one, context + " (beside DDP + ZeRO-1)");
    }
    expect_close_parameters(*model, *reference, kFloat64Tolerance, context);
    expect_same_on_every_rank(world, flatten(model->parameters()), "parameters " + context);
  }
  if (!scenario.clip) {
    // The consolidated state is the one ZeRO-1 consolidates, to the byte.
    expect_same_consolidated_state(*optimizer, *zero_one_optimizer, name_of(optim));
  }
  ddp.check_replicas();
}

class ZeroStage2 : public ::testing::TestWithParam<WorldSetup> {};

TEST_P(ZeroStage2, MatchesZeroOneBitForBitAndOneProcess) {
  run_ranks(GetParam(), [](int) {
    World world = init();
    for (bool in_backward : {false, true}) {
      SCOPED_TRACE(in_backward ? "stepping inside backward" : "optimizer.step()");
      for (auto optim : kEveryOptim) {
        Scenario scenario;
        scenario.in_backward = in_backward;
        train_beside_zero_one(world, optim, scenario);
      }
      Scenario shared_buckets;
      shared_buckets.in_backward = in_backward;
      shared_buckets.one_parameter_per_bucket = false;
      SCOPED_TRACE("several parameters per bucket");
      train_beside_zero_one(world, Optim::Adam, shared_buckets);
    }
    {
      SCOPED_TRACE("no_sync on every other backward");
      Scenario scenario;
      scenario.no_sync = true;
      train_beside_zero_one(world, Optim::AdamW, scenario);
    }
    {
      SCOPED_TRACE("a GradScaler that skips a step");
      Scenario scenario;
      scenario.scaler = true;
      train_beside_zero_one(world, Optim::Adam, scenario);
    }
    {
      SCOPED_TRACE("clipped to a total norm of 0.05 over the shards");
      Scenario scenario;
      scenario.clip = 0.05;
      train_beside_zero_one(world, Optim::AdamW, scenario);
    }
  }, std::chrono::seconds(240));
}

INSTANTIATE_TEST_SUITE_P(WorldSize, ZeroStage2, ::testing::ValuesIn(every_world_setup()),
                         [](const auto& info) { return info.param.name(); });

// What shard_gradients does not take: refused before the first forward,
// on every rank alike, by name.
TEST(ZeroStage2Errors, WhatItCannotShardIsRefusedByName) {
  run_ranks(2, [](int) {
    World world = init();
    auto sharded = one_parameter_per_bucket().shard_gradients(true);
    {
      Mlp model = float64_mlp(1);
      DDP<Mlp> ddp(model, world, sharded);
      auto [x, y] = batch(0, 2);
      expect_error<UsageError>([&] { ddp(x); }, {"none is registered",
                                                 "ddp.shard_gradients_with(optimizer)"});
    }
    {
      Mlp model = float64_mlp(1);
      DDP<Mlp> ddp(model, world, sharded);
      torch::optim::SGD sgd(model->parameters(), 0.1);
      expect_error<UsageError>([&] { ddp.shard_gradients_with(sgd); },
                               {"is not one", "ZeroRedundancyOptimizer"});
      ZeroRedundancyOptimizer<torch::optim::SGD> by_parameters(model->parameters(), world,
                                                               torch::optim::SGDOptions(0.1));
      expect_error<UsageError>([&] { ddp.shard_gradients_with(by_parameters); },
                               {"ZeroPartition::Elements"});
      auto elements = ZeroOptions().partition(ZeroPartition::Elements);
      auto some = model->parameters();
      some.pop_back();
      ZeroRedundancyOptimizer<torch::optim::SGD> partial(some, world,
                                                         torch::optim::SGDOptions(0.1), elements);
      expect_error<UsageError>([&] { ddp.shard_gradients_with(partial); },
                               {"does not hold", "every trainable parameter"});
      ZeroRedundancyOptimizer<torch::optim::SGD> whole(model->parameters(), world,
                                                       torch::optim::SGDOptions(0.1), elements);
      expect_error<UsageError>(
          [&] { ddp.step_in_backward(whole, StepInBackwardOptions().max_grad_norm(1.0)); },
          {"does not clip", "lockstep::clip_grad_norm_"});
      expect_error<UsageError>([&] { ddp.register_comm_hook(hooks::fp16_compress()); },
                               {"communication hook"});
      expect_error<UsageError>([&] { auto join = ddp.join(); }, {"join guard"});
    }
    {
      Mlp model = float64_mlp(1);
      DDP<Mlp> ddp(model, world, one_parameter_per_bucket());
      ZeroRedundancyOptimizer<torch::optim::SGD> whole(
          model->parameters(), world, torch::optim::SGDOptions(0.1),
          ZeroOptions().partition(ZeroPartition::Elements));
      expect_error<UsageError>([&] { ddp.shard_gradients_with(whole); },
                               {"shard_gradients(true)"});
    }
    expect_error<ConfigError>(
        [&] {
          Mlp model = float64_mlp(1);
          DDP<Mlp> ddp(model, world,
                       DdpOptions(sharded).mixed_precision(lockstep::MixedPrecision()));
        },
        {"mixed-precision"});
    {
      Mlp model = float64_mlp(1);
      DDP<Mlp> ddp(model, world, sharded);
      auto elements = ZeroOptions().partition(ZeroPartition::Elements);
      ZeroRedundancyOptimizer<torch::optim::SGD> shards(
          model->parameters(), world, torch::optim::SGDOptions(0.1),
          ZeroOptions(elements).checkpoint_shards(true));
      expect_error<UsageError>([&] { ddp.shard_gradients_with(shards); },
                               {"checkpoint_shards"});
      ZeroRedundancyOptimizer<torch::optim::Adam> stepped(model->parameters(), world,
                                                          torch::optim::AdamOptions(0.1),
                                                          elements);
      stepped.step();
      expect_error<UsageError>([&] { ddp.shard_gradients_with(stepped); },
                               {"has a state already"});
      // A backward that bypasses the wrapper before any optimizer is
      // registered.
      auto [x, y] = batch(0, 2);
      expect_error<UsageError>(
          [&] { torch::mse_loss(model->forward(x), y).backward(); },
          {"before its ZeroRedundancyOptimizer was registered"});
    }
  }, std::chrono::seconds(120));
}

// Two synchronised backwards without a step between: the second's
// reduce-scatter would write over the first's averages. Raised on every
// rank at the end of the second; discard_gradients() lets a step be
// skipped on purpose.
TEST(ZeroStage2Errors, ASecondSynchronisedBackwardBeforeTheStepIsNamedOnEveryRank) {
  run_ranks(2, [](int rank) {
    World world = init();
    Mlp model = float64_mlp(1);
    DDP<Mlp> ddp(model, world, one_parameter_per_bucket().shard_gradients(true));
    ZeroRedundancyOptimizer<torch::optim::SGD> optimizer(
        model->parameters(), world, torch::optim::SGDOptions(0.1),
        ZeroOptions().partition(ZeroPartition::Elements));
    ddp.shard_gradients_with(optimizer);
    auto [x, y] = batch(0, 2);
    auto backward = [&] {
      torch::mse_loss(ddp(shard(x, rank, kPerRank)), shard(y, rank, kPerRank)).backward();
    };
    backward();
    expect_error<UsageError>(backward, {"broke a rule on 2 rank(s)",
                                        "the averages of the last one were not stepped",
                                        "discard_gradients()", "ddp.no_sync()"});
    optimizer.discard_gradients();
    backward();
    optimizer.step();
    backward();
    optimizer.step();
    ddp.check_replicas();
  }, std::chrono::seconds(120));
}

// The consolidated checkpoint of ZeRO-2 is a plain optimizer's: written at
// 3 ranks, it resumes ZeRO-2 at 2 ranks exactly as DDP with a plain Adam
// resumes from its own checkpoint.
TEST(ZeroStage2Checkpoint, ResumesAtAnotherWorldSizeAsPlainDdp) {
  ScratchFolder folder("zero2-resize");
  auto train = [](DDP<Mlp>& ddp, torch::optim::Optimizer& optimizer, int from, int to,
                  int rank, int n) { train_steps(ddp, optimizer, true, from, to, rank, n); };
  auto write = launch_ranks(with_shared_folder(3, folder.path()), [&](int rank) {
    World world = init();
    DDP<Mlp> plain(float64_mlp(3), world);
    auto adam = plain_optimizer(Kind::Adam, plain.module()->parameters());
    DDP<Mlp> sharded(float64_mlp(3), world, DdpOptions().shard_gradients(true));
    auto zero = zero_optimizer(Kind::Adam, sharded.module()->parameters(), world,
                               ZeroOptions().partition(ZeroPartition::Elements));
    sharded.shard_gradients_with(*zero);
    train(plain, *adam, 0, 3, rank, 3);
    train(sharded, *zero, 0, 3, rank, 3);
    expect_bit_identical(*sharded.module(), *plain.module(), "ZeRO-2 at 3 ranks");
    save_checkpoint(world, shared_folder() + "/plain", *plain.module(), *adam);
    save_checkpoint(world, shared_folder() + "/zero2", *sharded.module(), *zero);
  });
  ASSERT_TRUE(write.ok()) << write.report();
  auto read = launch_ranks(with_shared_folder(2, folder.path()), [&](int rank) {
    World world = init();
    DDP<Mlp> plain(float64_mlp(11), world);
    auto adam = plain_optimizer(Kind::Adam, plain.module()->parameters());
    load_checkpoint(world, shared_folder() + "/plain", *plain.module(), *adam);
    DDP<Mlp> sharded(float64_mlp(11), world, DdpOptions().shard_gradients(true));
    auto zero = zero_optimizer(Kind::Adam, sharded.module()->parameters(), world,
                               ZeroOptions().partition(ZeroPartition::Elements));
    sharded.step_in_backward(*zero);  // registered first, then loaded
    load_checkpoint(world, shared_folder() + "/zero2", *sharded.module(), *zero);
    train(plain, *adam, 3, 5, rank, 2);
    train_steps(sharded, *zero, false, 3, 5, rank, 2);
    expect_bit_identical(*sharded.module(), *plain.module(), "ZeRO-2 resumed at 2 ranks");
  });
  EXPECT_TRUE(read.ok()) << read.report();
}

} // namespace
} // namespace lockstep::testing
