// ZeroRedundancyOptimizer's state: checkpoints that resume at another world
// size and partition, and the share of the state each rank holds.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "support/multiprocess.h"
#include "support/optimizers.h"
#include "support/scratch_folder.h"

namespace lockstep::testing {
namespace {

// A ZeRO checkpoint of 4 ranks resumes at 2: from the shards (put together
// and partitioned anew) and from the consolidated state, which a plain
// optimizer loads too. All three continue bit-identically to plain DDP
// resumed from its own checkpoint of the same run.
TEST(ZeroCheckpoint, ResumesAtAnotherWorldSize) {
  ScratchFolder folder("zero-resize");
  auto write = launch_ranks(with_shared_folder(4, folder.path()), [](int rank) {
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
  auto read = launch_ranks(with_shared_folder(2, folder.path()), [](int rank) {
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

// torch::load gives a module's parameters other memory and new gradient
// accumulators (set_): the wrapper hooks them again at the next forward
// (their gradients were no longer averaged), and the pieces that
// ZeroPartition::Elements cut from them follow (it stepped none of them);
// both then train as plain DDP with a module that was never loaded.
TEST(ZeroElements, TrainOnAfterTheModuleIsLoaded) {
  ScratchFolder folder("zero-load");
  auto result = launch_ranks(with_shared_folder(2, folder.path()), [](int rank) {
    World world = init();
    DDP<Mlp> plain(float64_mlp(3), world);
    DDP<Mlp> sliced(float64_mlp(3), world);
    auto plain_optimizer_ = plain_optimizer(Kind::Sgd, plain.module()->parameters());
    auto slices = optimizer_of(Way::Zero, Kind::Sgd, sliced, world, {},
                               ZeroOptions().partition(ZeroPartition::Elements));
    train_steps(plain, *plain_optimizer_, true, 0, 2, rank, 2);
    train_steps(sliced, *slices, true, 0, 2, rank, 2);
    auto file = shared_folder() + "/module-" + std::to_string(rank) + ".pt";
    torch::save(sliced.module(), file);
    torch::load(sliced.module(), file);
    torch::save(plain.module(), file + ".plain");
    DDP<Mlp> reference(float64_mlp(3), world);
    auto reference_optimizer = plain_optimizer(Kind::Sgd, reference.module()->parameters());
    train_steps(reference, *reference_optimizer, true, 0, 2, rank, 2);
    torch::load(plain.module(), file + ".plain");
    auto before = flatten(sliced.module()->parameters()).clone();
    train_steps(plain, *plain_optimizer_, true, 2, 4, rank, 2);
    train_steps(sliced, *slices, true, 2, 4, rank, 2);
    train_steps(reference, *reference_optimizer, true, 2, 4, rank, 2);
    EXPECT_FALSE(flatten(sliced.module()->parameters()).equal(before));
    expect_bit_identical(*plain.module(), *reference.module(), "plain DDP after torch::load");
    expect_bit_identical(*sliced.module(), *reference.module(), "ZeRO after torch::load");
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

} // namespace
} // namespace lockstep::testing
