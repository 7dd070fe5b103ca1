// Hybrid sharding (FsdpOptions::shard_group_size, HSDP): each unit sharded
// inside groups of consecutive ranks and replicated across them. Against one
// process on the whole batch in float64: 2 groups of 2 over shared memory
// and Gloo, 3 groups of 2; reshard after forward on and off; gradients on
// the wire in float32 (a tolerance derived from that rounding); a model
// built sharded for the groups. Its sharded checkpoint, written by one
// group, loads at other layouts and trains on as one process.

#include <cmath>
#include <filesystem>
#include <limits>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/clip_grad_norm.h>
#include <lockstep/fsdp.h>
#include <lockstep/world.h>

#include "support/expect_error.h"
#include "support/multiprocess.h"
#include "support/scratch_folder.h"
#include "support/shared_folder.h"
#include "support/tiny_transformer.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

using namespace tiny;

constexpr double kRate = 0.1;
constexpr double kMaxNorm = 0.5; // below the gradients' norm: clipping acts
constexpr double kMomentum = 0.9;

torch::optim::SGDOptions sgd() {
  return torch::optim::SGDOptions(kRate).momentum(kMomentum);
}

struct HybridCase {
  int groups;
  int group_size;
  std::string transport;
  bool reshard_after_forward;
  bool float32_wire;
  bool built_sharded;
  std::string name;
};
void PrintTo(const HybridCase& c, std::ostream* out) {
  *out << c.name;
}

// The largest element of any rank's gradient in this step (each rank's
// share of the batch, computed on the reference): what a float32 wire
// rounds.
double largest_share_gradient(TinyTransformer& reference, int64_t step, int ranks) {
  auto [tokens, targets] = token_batch(step);
  const int64_t share = kSamples / ranks;
  double largest = 0;
  for (int r = 0; r < ranks; ++r) {
    reference->zero_grad();
    loss_of(reference(tokens.narrow(0, r * share, share)), targets.narrow(0, r * share, share))
        .backward();
    for (const auto& param : reference->parameters()) {
      if (param.grad().defined()) {
        largest = std::max(largest, param.grad().abs().max().item<double>());
      }
    }
  }
  reference->zero_grad();
  return largest;
}

void expect_within(const torch::OrderedDict<std::string, torch::Tensor>& actual,
                   torch::nn::Module& reference, double tolerance, const std::string& what) {
  for (const auto& item : reference.named_parameters()) {
    ASSERT_TRUE(actual.contains(item.key())) << what << ": " << item.key();
    double off = (actual[item.key()] - item.value()).abs().max().item<double>();
    EXPECT_LE(off, tolerance) << what << ": " << item.key();
  }
}

class FsdpHybrid : public ::testing::TestWithParam<HybridCase> {};

TEST_P(FsdpHybrid, TrainsAsOneProcessOnTheWholeBatch) {
  auto c = GetParam();
  run_ranks(WorldSetup{c.groups * c.group_size, c.transport}, [c](int rank) {
    World world = init();
    auto options = FsdpOptions()
                       .shard_group_size(c.group_size)
                       .reshard_after_forward(c.reshard_after_forward);
    if (c.float32_wire) {
      options.reduce_dtype(torch::kFloat);
    }
    auto reference = built_in_float64<TinyTransformer>(0, true);
    TinyTransformer model{nullptr};
    if (c.built_sharded) {
      auto previous = torch::get_default_dtype();
      torch::set_default_dtype(caffe2::TypeMeta::Make<double>());
      torch::manual_seed(0);
      model = build_sharded<TinyTransformer>(world, options, true);
      torch::set_default_dtype(previous);
    } else {
      model = built_in_float64<TinyTransformer>(0, true);
    }
    FullyShardedDataParallel<TinyTransformer> fsdp(model, world, options);
    for (const auto& item : reference->named_parameters()) {
      EXPECT_TRUE(torch::equal(fsdp.full_parameters()[item.key()], item.value())) << item.key();
    }
    torch::optim::SGD reference_optimizer(reference->parameters(), sgd());
    torch::optim::SGD optimizer(fsdp.parameters(), sgd());
    const int ranks = world.size();
    const int64_t share = kSamples / ranks;
    // A float32 wire rounds each rank's gradient, the group's average and
    // the groups' (each within a unit in the last place of the largest
    // element), and SGD carries the error through its momentum.
    double momentum_error = 0;
    double tolerance = kFloat64Tolerance;
    for (int64_t step = 0; step < 4; ++step) {
      if (c.float32_wire) {
        double rounded = std::ldexp(largest_share_gradient(reference, step, ranks), -24) *
            (2 + c.group_size + c.groups);
        momentum_error = kMomentum * momentum_error + rounded;
        // Twice the first-order bound: the parameters' own differences
        // change the next gradients a little.
        tolerance += 2 * kRate * momentum_error;
      }
      auto [tokens, targets] = token_batch(step);
      reference_optimizer.zero_grad();
      loss_of(reference(tokens), targets).backward();
      optimizer.zero_grad();
      loss_of(fsdp(tokens.narrow(0, rank * share, share)), targets.narrow(0, rank * share, share))
          .backward();
      // Clipped over the ranks that hold each piece once (over the whole
      // world, each group's pieces would count once per group).
      double expected = torch::nn::utils::clip_grad_norm_(reference->parameters(), kMaxNorm);
      World shards = fsdp.shard_world();
      double norm = clip_grad_norm_(fsdp.parameters(), kMaxNorm, shards);
      EXPECT_NEAR(norm, expected, (c.float32_wire ? 1e-5 : 1e-12) * expected);
      reference_optimizer.step();
      optimizer.step();
      expect_within(fsdp.full_parameters(), *reference, tolerance,
                    "step " + std::to_string(step));
    }
    // Each rank holds 1/k of each unit: a group's pieces are the model.
    int64_t held = 0;
    for (const auto& piece : fsdp.parameters()) {
      held += piece.numel();
    }
    int64_t whole = 0;
    for (const auto& param : reference->parameters()) {
      whole += param.numel();
    }
    EXPECT_LE(held, whole / c.group_size + 7 * c.group_size) << "padding aside";
    EXPECT_GE(held, whole / c.group_size - 7 * c.group_size) << "padding aside";
  });
}

INSTANTIATE_TEST_SUITE_P(
    Layouts,
    FsdpHybrid,
    ::testing::Values(
        HybridCase{2, 2, "shm", true, false, false, "2x2_shm"},
        HybridCase{2, 2, "shm", false, false, false, "2x2_shm_kept_gathered"},
        HybridCase{2, 2, "shm", true, true, false, "2x2_shm_float32_wire"},
        HybridCase{2, 2, "gloo", true, false, false, "2x2_gloo"},
        HybridCase{2, 2, "gloo", false, true, false, "2x2_gloo_kept_gathered_float32_wire"},
        HybridCase{3, 2, "shm", true, false, false, "3x2_shm"},
        HybridCase{3, 2, "shm", false, true, false, "3x2_shm_kept_gathered_float32_wire"},
        HybridCase{2, 2, "shm", true, false, true, "2x2_shm_built_sharded"},
        HybridCase{3, 2, "gloo", true, false, true, "3x2_gloo_built_sharded"}),
    [](const auto& info) { return info.param.name; });

// Written by the first group (one file per place), loaded by plain FSDP at
// 4 ranks (whose pieces straddle the saved ones) and by 3 groups of 2;
// each trains on as one process.
TEST(FsdpHybridCheckpoint, WrittenByOneGroupLoadsAtOtherLayouts) {
  ScratchFolder folder("fsdp-hybrid");
  auto write = launch_ranks(with_shared_folder(4, folder.path()), [&](int rank) {
    World world = init();
    auto model = float64_model<TinyTransformer>(0, false);
    FullyShardedDataParallel<TinyTransformer> fsdp(model, world,
                                                   FsdpOptions().shard_group_size(2));
    torch::optim::SGD optimizer(fsdp.parameters(), sgd());
    train_sharded(fsdp, optimizer, 0, 2, rank, 4);
    fsdp.save_sharded(shared_folder() + "/hsdp", optimizer);
  });
  ASSERT_TRUE(write.ok()) << write.report();
  if (!in_rank_process()) {
    std::vector<std::string> files;
    for (const auto& entry : std::filesystem::directory_iterator(folder.path())) {
      files.push_back(entry.path().filename().string());
    }
    std::sort(files.begin(), files.end());
    EXPECT_EQ(files, (std::vector<std::string>{"hsdp", "hsdp.1.rank0-of-2", "hsdp.1.rank1-of-2"}));
  }
  for (auto [ranks, group] : {std::pair{4, 0}, std::pair{6, 2}}) {
    auto read = launch_ranks(with_shared_folder(ranks, folder.path()), [&, ranks = ranks,
                                                                        group = group](int rank) {
      World world = init();
      auto reference = float64_model<TinyTransformer>(0, false);
      torch::optim::SGD reference_optimizer(reference->parameters(), sgd());
      train_alone(reference, reference_optimizer, 0, 2);
      auto model = float64_model<TinyTransformer>(11, false);
      FsdpOptions options;
      if (group > 0) {
        options.shard_group_size(group);
      }
      FullyShardedDataParallel<TinyTransformer> fsdp(model, world, options);
      torch::optim::SGD optimizer(fsdp.parameters(), sgd());
      fsdp.load_sharded(shared_folder() + "/hsdp", optimizer);
      expect_close_parameters(fsdp.full_parameters(), *reference, "loaded");
      train_alone(reference, reference_optimizer, 2, 4);
      train_sharded(fsdp, optimizer, 2, 4, rank, ranks);
      expect_close_parameters(fsdp.full_parameters(), *reference, "trained on");
    });
    EXPECT_TRUE(read.ok()) << ranks << " ranks in groups of " << group << ": " << read.report();
  }
}

TEST(FsdpHybridErrors, GroupsThatDoNotDivideTheWorldOrAModelCutForAnotherAreRefused) {
  run_ranks(4, [](int) {
    World world = init();
    {
      auto model = float64_model<TinyTransformer>(0, false);
      expect_error<ConfigError>(
          [&] {
            FullyShardedDataParallel<TinyTransformer> fsdp(model, world,
                                                           FsdpOptions().shard_group_size(3));
          },
          {"FsdpOptions::shard_group_size: groups of 3 ranks do not divide the world's 4"});
    }
    {
      // Built for plain FSDP over 4, wrapped for groups of 2.
      auto model = [&] {
        ShardedConstruction construction(world);
        return built_in_float64<TinyTransformer>(0, false);
      }();
      expect_error<ConfigError>(
          [&] {
            FullyShardedDataParallel<TinyTransformer> fsdp(model, world,
                                                           FsdpOptions().shard_group_size(2));
          },
          {"was built under a ShardedConstruction for shards of 4 ranks",
           "with its FsdpOptions"});
    }
  });
}

} // namespace
} // namespace lockstep::testing
