// ZeroRedundancyOptimizer with parameter groups, as PyTorch's takes them:
// weights with weight decay and biases without, each group with its own
// learning rate, a scheduler over every group, a group added during
// training, and checkpoints that bring each group's options back. Each is
// trained beside plain DDP with a plain optimizer over the same groups
// (bit-identical) and beside one process on the whole batch
// (kFloat64Tolerance), in float64 at 1 to 4 ranks.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "support/expect_error.h"
#include "support/multiprocess.h"
#include "support/optimizers.h"
#include "support/scratch_folder.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

using torch::optim::OptimizerOptions;
using torch::optim::OptimizerParamGroup;

std::vector<torch::Tensor> weights_of(Mlp& model) {
  return {model->fc1->weight, model->fc2->weight, model->fc3->weight};
}
std::vector<torch::Tensor> biases_of(Mlp& model) {
  return {model->fc1->bias, model->fc2->bias, model->fc3->bias};
}

// The biases' options: another learning rate, no weight decay.
std::unique_ptr<OptimizerOptions> bias_options(Kind kind) {
  switch (kind) {
    case Kind::Sgd:
      return std::make_unique<torch::optim::SGDOptions>(sgd_options().lr(0.1).weight_decay(0));
    case Kind::Adam:
      return std::make_unique<torch::optim::AdamOptions>(adam_options().lr(3e-2).weight_decay(0));
    default:
      return std::make_unique<torch::optim::AdamWOptions>(
          adamw_options().lr(3e-2).weight_decay(0));
  }
}

// The weights with the defaults; the biases with their own options.
std::vector<OptimizerParamGroup> groups_of(Kind kind, Mlp& model, bool with_biases) {
  std::vector<OptimizerParamGroup> groups;
  groups.emplace_back(weights_of(model));
  if (with_biases) {
    groups.emplace_back(biases_of(model), bias_options(kind));
  }
  return groups;
}

std::unique_ptr<torch::optim::Optimizer> plain_with_groups(Kind kind,
                                                           std::vector<OptimizerParamGroup> g) {
  switch (kind) {
    case Kind::Sgd:
      return std::make_unique<torch::optim::SGD>(std::move(g), sgd_options());
    case Kind::Adam:
      return std::make_unique<torch::optim::Adam>(std::move(g), adam_options());
    default:
      return std::make_unique<torch::optim::AdamW>(std::move(g), adamw_options());
  }
}

std::unique_ptr<detail::ShardedOptimizer> zero_with_groups(Kind kind,
                                                           std::vector<OptimizerParamGroup> g,
                                                           World& world, ZeroOptions zero) {
  switch (kind) {
    case Kind::Sgd:
      return std::make_unique<ZeroRedundancyOptimizer<torch::optim::SGD>>(
          std::move(g), world, sgd_options(), zero);
    case Kind::Adam:
      return std::make_unique<ZeroRedundancyOptimizer<torch::optim::Adam>>(
          std::move(g), world, adam_options(), zero);
    default:
      return std::make_unique<ZeroRedundancyOptimizer<torch::optim::AdamW>>(
          std::move(g), world, adamw_options(), zero);
  }
}

// Six steps with a StepLR over every group. `added_later`: the biases'
// group comes by add_param_group before step 3 (until then they have
// gradients, and nothing steps them).
void train_with_groups(World& world, Kind kind, Way way, ZeroPartition partition,
                       bool added_later) {
  int n = world.size();
  int rank = world.rank();
  Mlp model = float64_mlp(3);
  Mlp plain = float64_mlp(3);
  Mlp reference = float64_mlp(3);
  DDP<Mlp> ddp(model, world, one_parameter_per_bucket());
  DDP<Mlp> plain_ddp(plain, world);
  auto zero = zero_with_groups(kind, groups_of(kind, model, !added_later), world,
                               ZeroOptions().partition(partition));
  if (way == Way::ZeroInBackward) {
    ddp.step_in_backward(*zero);
  }
  auto plain_optimizer_ = plain_with_groups(kind, groups_of(kind, plain, !added_later));
  auto reference_optimizer = plain_with_groups(kind, groups_of(kind, reference, !added_later));
  std::vector<torch::optim::Optimizer*> all{zero.get(), plain_optimizer_.get(),
                                            reference_optimizer.get()};
  std::vector<std::unique_ptr<torch::optim::StepLR>> schedulers;
  for (auto* each : all) {
    schedulers.push_back(std::make_unique<torch::optim::StepLR>(*each, 2, 0.5));
  }
  for (int step = 0; step < 6; ++step) {
    if (added_later && step == 3) {
      zero->add_param_group(OptimizerParamGroup(biases_of(model), bias_options(kind)));
      plain_optimizer_->add_param_group(OptimizerParamGroup(biases_of(plain), bias_options(kind)));
      reference_optimizer->add_param_group(
          OptimizerParamGroup(biases_of(reference), bias_options(kind)));
    }
    for (auto* each : all) {
      each->zero_grad();
    }
    auto [x, y] = batch(step, n);
    for (auto* wrapped : {&ddp, &plain_ddp}) {
      torch::mse_loss((*wrapped)(shard(x, rank, kPerRank)), shard(y, rank, kPerRank)).backward();
    }
    torch::mse_loss(reference(x), y).backward();
    if (way == Way::Zero) {
      zero->step();
    }
    plain_optimizer_->step();
    reference_optimizer->step();
    for (auto& scheduler : schedulers) {
      scheduler->step();
    }
    expect_as_plain_ddp_and_one_process(world, *model, *plain, *reference,
                                        std::string(name_of(way)) + ", " + name_of(kind) +
                                            ", after step " + std::to_string(step));
  }
  ASSERT_EQ(zero->param_groups().size(), 2u);
  for (size_t g = 0; g < 2; ++g) {
    EXPECT_EQ(zero->param_groups()[g].options().get_lr(),
              plain_optimizer_->param_groups()[g].options().get_lr());
  }
}

class ZeroGroups : public ::testing::TestWithParam<int> {};

TEST_P(ZeroGroups, MatchAPlainOptimizerOverTheSameGroups) {
  run_ranks(GetParam(), [](int) {
    World world = init();
    for (auto kind : {Kind::Sgd, Kind::Adam, Kind::AdamW}) {
      for (auto partition : {ZeroPartition::Parameters, ZeroPartition::Elements}) {
        SCOPED_TRACE(std::string(name_of(kind)) +
                     (partition == ZeroPartition::Elements ? ", equal slices" : ", by parameters"));
        train_with_groups(world, kind, Way::Zero, partition, /*added_later=*/false);
        train_with_groups(world, kind, Way::ZeroInBackward, partition, /*added_later=*/false);
        train_with_groups(world, kind, Way::Zero, partition, /*added_later=*/true);
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSize, ZeroGroups, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// PyTorch's rule across groups: group by group, largest first, each to the
// rank that owns the fewest elements over all groups so far; a group added
// later leaves the pieces before it where they were. In equal slices, each
// group is sliced on its own.
TEST(ZeroPartitionOfGroups, CarriesTheLoadFromGroupToGroup) {
  auto pieces = partition_parameter_groups({{10, 30}, {25, 5}}, 2);
  ASSERT_EQ(pieces.size(), 4u);
  EXPECT_EQ(pieces[1].owner, 0); // 30 first
  EXPECT_EQ(pieces[0].owner, 1); // then 10
  EXPECT_EQ(pieces[2].owner, 1); // 25 to rank 1, which owns 10
  EXPECT_EQ(pieces[3].owner, 0); // 5 to rank 0 (30 against 35)
  EXPECT_EQ(pieces[2].group, 1u);
  EXPECT_EQ(pieces[2].param, 2u);
  auto first_only = partition_parameter_groups({{10, 30}}, 2);
  for (size_t i = 0; i < first_only.size(); ++i) {
    EXPECT_EQ(first_only[i].owner, pieces[i].owner);
  }
  auto slices = partition_parameter_groups({{3}, {4}}, 2, ZeroPartition::Elements);
  ASSERT_EQ(slices.size(), 4u);
  EXPECT_EQ(slices[0].length, 2); // ceil(3 / 2) of group 0 to rank 0
  EXPECT_EQ(slices[1].length, 1);
  EXPECT_EQ(slices[2].length, 2); // group 1 on its own: 2 and 2
  EXPECT_EQ(slices[3].owner, 1);
}

// A checkpoint holds each group's options as a scheduler left them, and
// loading it brings them back (LibTorch's own load keeps the options the
// optimizer was built with): plain AdamW, ZeRO consolidated and ZeRO's
// shards, written at 2 ranks and resumed at 3 by optimizers built with
// another learning rate; all continue bit-identically to the plain one.
TEST(ZeroGroups, CheckpointsBringBackEachGroupsOptions) {
  ScratchFolder folder("zero-groups");
  auto write = launch_ranks(with_shared_folder(2, folder.path()), [](int rank) {
    World world = init();
    DDP<Mlp> plain(float64_mlp(3), world);
    DDP<Mlp> consolidated(float64_mlp(3), world);
    DDP<Mlp> sharded(float64_mlp(3), world);
    auto plain_optimizer_ = plain_with_groups(Kind::AdamW, groups_of(Kind::AdamW, plain.module(), true));
    auto whole = zero_with_groups(Kind::AdamW, groups_of(Kind::AdamW, consolidated.module(), true),
                                  world, {});
    auto shards = zero_with_groups(
        Kind::AdamW, groups_of(Kind::AdamW, sharded.module(), true), world,
        ZeroOptions().checkpoint_shards(true).partition(ZeroPartition::Elements));
    for (auto* each : std::vector<torch::optim::Optimizer*>{plain_optimizer_.get(), whole.get(),
                                                            shards.get()}) {
      for (auto& group : each->param_groups()) { // as a scheduler would
        group.options().set_lr(group.options().get_lr() / 8);
      }
    }
    train_steps(plain, *plain_optimizer_, true, 0, 3, rank, 2);
    train_steps(consolidated, *whole, true, 0, 3, rank, 2);
    train_steps(sharded, *shards, true, 0, 3, rank, 2);
    save_checkpoint(world, shared_folder() + "/plain", *plain.module(), *plain_optimizer_);
    save_checkpoint(world, shared_folder() + "/consolidated", *consolidated.module(), *whole);
    save_checkpoint(world, shared_folder() + "/shards", *sharded.module(), *shards);
  });
  ASSERT_TRUE(write.ok()) << write.report();
  auto read = launch_ranks(with_shared_folder(3, folder.path()), [](int rank) {
    World world = init();
    auto built_with_lr_one = [](Kind kind, Mlp& model) {
      auto groups = groups_of(kind, model, true);
      for (auto& group : groups) {
        if (group.has_options()) {
          group.options().set_lr(1.0);
        }
      }
      return groups;
    };
    auto resume = [&](const std::string& file, bool zero) {
      auto ddp = std::make_unique<DDP<Mlp>>(float64_mlp(11), world);
      auto groups = built_with_lr_one(Kind::AdamW, ddp->module());
      std::unique_ptr<torch::optim::Optimizer> optimizer;
      if (zero) {
        optimizer = std::make_unique<ZeroRedundancyOptimizer<torch::optim::AdamW>>(
            std::move(groups), world, torch::optim::AdamWOptions(1.0));
      } else {
        optimizer = std::make_unique<torch::optim::AdamW>(std::move(groups),
                                                          torch::optim::AdamWOptions(1.0));
      }
      load_checkpoint(world, shared_folder() + "/" + file, *ddp->module(), *optimizer);
      // 1e-2 and 3e-2, as the writing run had decayed them.
      EXPECT_EQ(optimizer->param_groups()[0].options().get_lr(), 1e-2 / 8) << file;
      EXPECT_EQ(optimizer->param_groups()[1].options().get_lr(), 3e-2 / 8) << file;
      EXPECT_EQ(static_cast<torch::optim::AdamWOptions&>(optimizer->param_groups()[1].options())
                    .weight_decay(),
                0)
          << file;
      train_steps(*ddp, *optimizer, true, 3, 5, rank, 3);
      return ddp;
    };
    auto plain = resume("plain", false);
    expect_bit_identical(*resume("consolidated", true)->module(), *plain->module(),
                         "ZeRO from its consolidated state");
    expect_bit_identical(*resume("shards", true)->module(), *plain->module(),
                         "ZeRO from 2 ranks' shards in equal slices");
    expect_bit_identical(*resume("consolidated", false)->module(), *plain->module(),
                         "a plain AdamW from ZeRO's consolidated state");
  });
  EXPECT_TRUE(read.ok()) << read.report();
}

// PyTorch's step(closure): the closure runs on every rank (it computes the
// gradients), its loss comes back, and the step is the one without it.
TEST(ZeroGroups, StepTakesAClosureAndReturnsItsLoss) {
  run_ranks(2, [](int rank) {
    World world = init();
    DDP<Mlp> ddp(float64_mlp(3), world);
    DDP<Mlp> plain(float64_mlp(3), world);
    ZeroRedundancyOptimizer<torch::optim::Adam> zero(ddp.module()->parameters(), world,
                                                     adam_options());
    auto plain_optimizer_ = plain_optimizer(Kind::Adam, plain.module()->parameters());
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = batch(step, 2);
      auto loss = zero.step([&] {
        zero.zero_grad();
        auto value = torch::mse_loss(ddp(shard(x, rank, kPerRank)), shard(y, rank, kPerRank));
        value.backward();
        return value;
      });
      plain_optimizer_->zero_grad();
      auto expected = torch::mse_loss(plain(shard(x, rank, kPerRank)), shard(y, rank, kPerRank));
      expected.backward();
      plain_optimizer_->step();
      ASSERT_TRUE(loss.defined());
      EXPECT_TRUE(loss.equal(expected));
      expect_bit_identical(*ddp.module(), *plain.module(), "after a step with a closure");
    }
  });
}

// An empty parameter list is an error, as in PyTorch, and so is a
// parameter in two groups; so are ranks that build their optimizers over
// other groups, or add other groups (on every rank, not a hang).
TEST(ZeroGroups, AnEmptyListOrOtherGroupsOnSomeRankAreErrors) {
  run_ranks(2, [](int rank) {
    World world = init();
    EXPECT_THROW(ZeroRedundancyOptimizer<torch::optim::SGD>(std::vector<torch::Tensor>{}, world,
                                                            sgd_options()),
                 UsageError);
    Mlp model = float64_mlp(3);
    {
      ZeroRedundancyOptimizer<torch::optim::SGD> zero(groups_of(Kind::Sgd, model, false), world,
                                                      sgd_options());
      expect_error<UsageError>(
          [&] { zero.add_param_group(OptimizerParamGroup({model->fc1->weight})); },
          {"appears twice in this ZeroRedundancyOptimizer's groups"});
      expect_error<UsageError>(
          [&] {
            zero.add_param_group(OptimizerParamGroup(
                rank == 0 ? biases_of(model) : std::vector<torch::Tensor>{model->fc1->bias}));
          },
          {"holds other parameters than rank 0's", "add the same groups"});
    }
    try {
      ZeroRedundancyOptimizer<torch::optim::SGD> zero(groups_of(Kind::Sgd, model, rank == 0),
                                                      world, sgd_options());
      ADD_FAILURE() << "other groups on rank 1 were accepted";
    } catch (const UsageError& error) {
      EXPECT_NE(std::string(error.what()).find("the ZeroRedundancyOptimizer of rank 1 holds "
                                               "other parameters than rank 0's (rank 0: 6 "
                                               "tensors in 2 groups; rank 1: 3 in 1"),
                std::string::npos)
          << error.what();
    }
  });
}

} // namespace
} // namespace lockstep::testing
