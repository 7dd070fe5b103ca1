// FullyShardedDataParallel checkpoints of 4 ranks, both kinds. Consolidated:
// the module's parameters in full and Adam's state, in one file of
// save_checkpoint; a plain model and a plain Adam on one process load it
// and hold what one process trained on the whole batch holds, and FSDP at
// 2 ranks loads it and trains on as that process does. Sharded: each rank
// its own file; FSDP at 3 ranks (whose pieces straddle the saved ones) and
// at 2 loads it and trains on as that process does. Within float64
// rounding throughout.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/checkpoint.h>
#include <lockstep/fsdp.h>
#include <lockstep/world.h>

#include <algorithm>
#include <filesystem>

#include "checkpoint/checkpoint_file.h"
#include "optim/parameter_state.h"
#include "support/expect_error.h"
#include "support/multiprocess.h"
#include "support/scratch_folder.h"
#include "support/shared_folder.h"
#include "support/small_cnn.h"
#include "support/tiny_transformer.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

using namespace tiny;

torch::optim::AdamOptions adam() {
  return torch::optim::AdamOptions(1e-2);
}

TinyTransformer float64_transformer(uint64_t seed) {
  return float64_model<TinyTransformer>(seed, false);
}

TEST(FsdpCheckpoint, ConsolidatedAtFourRanksResumesAtTwoAndInAPlainProgram) {
  ScratchFolder folder("fsdp-checkpoint");
  auto write = launch_ranks(with_shared_folder(4, folder.path()), [](int rank) {
    World world = init();
    auto model = float64_transformer(0);
    FullyShardedDataParallel<TinyTransformer> fsdp(model, world);
    torch::optim::Adam optimizer(fsdp.parameters(), adam());
    train_sharded(fsdp, optimizer, 0, 3, rank, 4);
    torch::optim::Adam full(model->parameters(), adam());
    fsdp.consolidate_optimizer_state(optimizer, full);
    auto gathered = fsdp.summon_full_parameters();
    save_checkpoint(world, shared_folder() + "/fsdp", *model, full);
  });
  ASSERT_TRUE(write.ok()) << write.report();
  auto read = launch_ranks(with_shared_folder(2, folder.path()), [](int rank) {
    World world = init();
    auto reference = float64_transformer(0);
    torch::optim::Adam reference_optimizer(reference->parameters(), adam());
    train_alone(reference, reference_optimizer, 0, 3);

    // A plain model and optimizer, as a program without FSDP has them.
    auto plain = float64_transformer(21);
    torch::optim::Adam plain_optimizer(plain->parameters(), adam());
    load_checkpoint(world, shared_folder() + "/fsdp", *plain, plain_optimizer);
    expect_close_parameters(plain->named_parameters(), *reference, "a plain model loaded");

    // FSDP at 2 ranks, from another initialisation.
    auto model = float64_transformer(11);
    FullyShardedDataParallel<TinyTransformer> fsdp(model, world);
    torch::optim::Adam optimizer(fsdp.parameters(), adam());
    {
      torch::optim::Adam full(model->parameters(), adam());
      auto gathered = fsdp.summon_full_parameters();
      load_checkpoint(world, shared_folder() + "/fsdp", *model, full);
      fsdp.load_optimizer_state(optimizer, full);
    }
    expect_close_parameters(fsdp.full_parameters(), *reference, "FSDP at 2 ranks loaded");

    // All three train on: the optimizers' states came through too.
    train_alone(reference, reference_optimizer, 3, 5);
    train_alone(plain, plain_optimizer, 3, 5);
    train_sharded(fsdp, optimizer, 3, 5, rank, 2);
    expect_close_parameters(plain->named_parameters(), *reference, "the plain model, trained on");
    expect_close_parameters(fsdp.full_parameters(), *reference, "FSDP at 2 ranks, trained on");
  });
  EXPECT_TRUE(read.ok()) << read.report();
}

// What a scheduler would do between steps 1 and 2: the learning rate that
// a sharded checkpoint carries in its groups' options.
constexpr double kLaterRate = 4e-3;

void lower_rate(torch::optim::Optimizer& optimizer) {
  static_cast<torch::optim::AdamOptions&>(optimizer.param_groups()[0].options()).lr(kLaterRate);
}

std::vector<std::string> files_in(const std::string& folder) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(folder)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(FsdpCheckpoint, ShardedAtFourRanksResumesAtThreeAndAtTwo) {
  // 4 ranks save twice; 3 ranks load (their pieces straddle the saved ones)
  // and save at once; 2 ranks load that.
  ScratchFolder folder("fsdp-sharded");
  auto write = launch_ranks(with_shared_folder(4, folder.path()), [](int rank) {
    World world = init();
    auto model = float64_transformer(0);
    FullyShardedDataParallel<TinyTransformer> fsdp(model, world);
    torch::optim::Adam optimizer(fsdp.parameters(), adam());
    train_sharded(fsdp, optimizer, 0, 2, rank, 4);
    fsdp.save_sharded(shared_folder() + "/fsdp", optimizer);
    lower_rate(optimizer);
    train_sharded(fsdp, optimizer, 2, 3, rank, 4);
    // The second save replaces the first, whose files go.
    fsdp.save_sharded(shared_folder() + "/fsdp", optimizer);
  });
  ASSERT_TRUE(write.ok()) << write.report();
  if (!in_rank_process()) {
    EXPECT_EQ(files_in(folder.path()),
              (std::vector<std::string>{"fsdp", "fsdp.2.rank0-of-4", "fsdp.2.rank1-of-4",
                                        "fsdp.2.rank2-of-4", "fsdp.2.rank3-of-4"}));
  }
  for (int ranks : {3, 2}) {
    auto read = launch_ranks(with_shared_folder(ranks, folder.path()), [ranks](int rank) {
      World world = init();
      auto reference = float64_transformer(0);
      torch::optim::Adam reference_optimizer(reference->parameters(), adam());
      train_alone(reference, reference_optimizer, 0, 2);
      lower_rate(reference_optimizer);
      train_alone(reference, reference_optimizer, 2, 3);

      auto model = float64_transformer(11);
      FullyShardedDataParallel<TinyTransformer> fsdp(model, world);
      torch::optim::Adam optimizer(fsdp.parameters(), adam());
      fsdp.load_sharded(shared_folder() + "/fsdp", optimizer);
      EXPECT_EQ(static_cast<torch::optim::AdamOptions&>(optimizer.param_groups()[0].options())
                    .lr(),
                kLaterRate);
      expect_close_parameters(fsdp.full_parameters(), *reference, "FSDP loaded");
      // Each moment in memory of its own piece's size, not of the larger
      // saved piece it was cut from.
      for (const auto& piece : fsdp.parameters()) {
        const auto& state = static_cast<const torch::optim::AdamParamState&>(
            *detail::find_state(optimizer, piece));
        for (const auto& moment : {state.exp_avg(), state.exp_avg_sq()}) {
          EXPECT_EQ(moment.storage().nbytes(), moment.numel() * moment.element_size());
        }
      }
      if (ranks == 3) {
        // Saved again at once, by 3 ranks: what the 2 ranks next load, and
        // the 4 ranks' files go.
        fsdp.save_sharded(shared_folder() + "/fsdp", optimizer);
      }
      train_alone(reference, reference_optimizer, 3, 5);
      train_sharded(fsdp, optimizer, 3, 5, rank, ranks);
      expect_close_parameters(fsdp.full_parameters(), *reference, "FSDP, trained on");
    });
    EXPECT_TRUE(read.ok()) << ranks << " ranks: " << read.report();
  }
  if (!in_rank_process()) {
    EXPECT_EQ(files_in(folder.path()),
              (std::vector<std::string>{"fsdp", "fsdp.3.rank0-of-3", "fsdp.3.rank1-of-3",
                                        "fsdp.3.rank2-of-3"}));
  }
}

TEST(FsdpCheckpoint, ShardedBuffersComeFromRankZeroAtAnotherWorldSize) {
  // SyncBatchNorm's running statistics: the same on every rank, and what one
  // process's BatchNorm holds.
  ScratchFolder folder("fsdp-sharded-buffers");
  auto train = [](torch::optim::Optimizer& optimizer,
                  const std::function<torch::Tensor(const torch::Tensor&)>& forward, int rank,
                  int ranks) {
    int64_t share = kSamples / ranks;
    for (int64_t step = 0; step < 2; ++step) {
      auto [x, y] = global_batch(step, kSamples, {1, 8, 8});
      optimizer.zero_grad();
      torch::mse_loss(forward(x.to(torch::kDouble).narrow(0, rank * share, share)),
                      y.to(torch::kDouble).narrow(0, rank * share, share))
          .backward();
      optimizer.step();
    }
  };
  auto write = launch_ranks(with_shared_folder(2, folder.path()), [&](int rank) {
    World world = init();
    auto model = float64_model<SmallCnn>(3);
    FullyShardedDataParallel<SmallCnn> fsdp(model, world);
    torch::optim::SGD optimizer(fsdp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    train(optimizer, [&](const torch::Tensor& x) { return fsdp(x); }, rank, 2);
    fsdp.save_sharded(shared_folder() + "/cnn", optimizer);
  });
  ASSERT_TRUE(write.ok()) << write.report();
  auto read = launch_ranks(with_shared_folder(3, folder.path()), [&](int) {
    World world = init();
    auto reference = float64_model<SmallCnn>(3);
    torch::optim::SGD reference_optimizer(reference->parameters(),
                                          torch::optim::SGDOptions(0.1).momentum(0.9));
    train(reference_optimizer, [&](const torch::Tensor& x) { return reference(x); },
          0, 1);
    auto model = float64_model<SmallCnn>(5);
    FullyShardedDataParallel<SmallCnn> fsdp(model, world);
    torch::optim::SGD optimizer(fsdp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    fsdp.load_sharded(shared_folder() + "/cnn", optimizer);
    expect_close_parameters(fsdp.full_parameters(), *reference, "the CNN loaded");
    auto buffers = model->named_buffers();
    for (const auto& item : reference->named_buffers()) {
      EXPECT_TRUE(torch::allclose(buffers[item.key()], item.value(), 0, kFloat64Tolerance))
          << item.key();
    }
  });
  EXPECT_TRUE(read.ok()) << read.report();
}

TEST(FsdpCheckpoint, ACrashDuringAShardedSaveLeavesTheLastOneWhole) {
  ScratchFolder folder("fsdp-sharded-crash");
  auto crashed = launch_ranks(with_shared_folder(2, folder.path()), [](int rank) {
    World world = init();
    auto model = float64_transformer(0);
    FullyShardedDataParallel<TinyTransformer> fsdp(model, world);
    torch::optim::Adam optimizer(fsdp.parameters(), adam());
    train_sharded(fsdp, optimizer, 0, 1, rank, 2);
    fsdp.save_sharded(shared_folder() + "/fsdp", optimizer);
    train_sharded(fsdp, optimizer, 1, 2, rank, 2);
    detail::set_checkpoint_write_observer([](size_t) {
      std::_Exit(3); // the machines go down in the middle of their files
    });
    fsdp.save_sharded(shared_folder() + "/fsdp", optimizer);
  });
  if (!in_rank_process()) {
    ASSERT_EQ(crashed.ranks[0].exit_code, 3) << crashed.report();
    ASSERT_EQ(crashed.ranks[1].exit_code, 3) << crashed.report();
    auto files = files_in(folder.path());
    EXPECT_TRUE(std::any_of(files.begin(), files.end(), [](const std::string& name) {
      return name.find(".tmp-") != std::string::npos;
    })) << "the crash left no temp file: nothing to clear";
  }
  auto read = launch_ranks(with_shared_folder(2, folder.path()), [](int rank) {
    World world = init();
    auto reference = float64_transformer(0);
    torch::optim::Adam reference_optimizer(reference->parameters(), adam());
    train_alone(reference, reference_optimizer, 0, 1);
    auto model = float64_transformer(11);
    FullyShardedDataParallel<TinyTransformer> fsdp(model, world);
    torch::optim::Adam optimizer(fsdp.parameters(), adam());
    fsdp.load_sharded(shared_folder() + "/fsdp", optimizer);
    train_alone(reference, reference_optimizer, 1, 3);
    train_sharded(fsdp, optimizer, 1, 3, rank, 2);
    expect_close_parameters(fsdp.full_parameters(), *reference, "resumed from the first save");
    // The next save clears what the crash left (temp files) and the first.
    fsdp.save_sharded(shared_folder() + "/fsdp", optimizer);
  });
  EXPECT_TRUE(read.ok()) << read.report();
  if (!in_rank_process()) {
    EXPECT_EQ(files_in(folder.path()),
              (std::vector<std::string>{"fsdp", "fsdp.2.rank0-of-2", "fsdp.2.rank1-of-2"}));
  }
}

TEST(FsdpCheckpoint, ASharedCheckpointWithAFileMissingOrOfAnotherModelFailsOnEveryRank) {
  ScratchFolder folder("fsdp-sharded-bad");
  auto write = launch_ranks(with_shared_folder(2, folder.path()), [](int) {
    World world = init();
    auto model = float64_transformer(0);
    FullyShardedDataParallel<TinyTransformer> fsdp(model, world);
    torch::optim::Adam optimizer(fsdp.parameters(), adam());
    fsdp.save_sharded(shared_folder() + "/fsdp", optimizer);
    // Another model's: a plain save_checkpoint.
    auto gathered = fsdp.summon_full_parameters();
    torch::optim::Adam full(model->parameters(), adam());
    save_checkpoint(world, shared_folder() + "/plain", *model, full);
  });
  ASSERT_TRUE(write.ok()) << write.report();
  if (!in_rank_process()) {
    std::filesystem::remove(folder.path() + "/fsdp.1.rank1-of-2");
  }
  auto read = launch_ranks(with_shared_folder(2, folder.path()), [](int) {
    World world = init();
    auto model = float64_transformer(7);
    FullyShardedDataParallel<TinyTransformer> fsdp(model, world);
    torch::optim::Adam optimizer(fsdp.parameters(), adam());
    expect_error<CheckpointError>(
        [&] { fsdp.load_sharded(shared_folder() + "/fsdp", optimizer); },
        // Rank 0 needs only its own file at the same world size; the error
        // reaches it all the same.
        {"loading the sharded checkpoint", "failed on 1 rank(s)",
         "rank 1: lockstep: cannot read the checkpoint", "fsdp.1.rank1-of-2"});
    expect_error<CheckpointError>(
        [&] { fsdp.load_sharded(shared_folder() + "/plain", optimizer); },
        {"is not the index of a FullyShardedDataParallel sharded checkpoint"});
    // Nothing was changed, on any rank, and the world goes on.
    expect_close_parameters(fsdp.full_parameters(), *float64_transformer(7), "after the errors");
    EXPECT_TRUE(optimizer.state().empty());
  });
  EXPECT_TRUE(read.ok()) << read.report();
}

} // namespace
} // namespace lockstep::testing
