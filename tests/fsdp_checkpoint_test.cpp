// A FullyShardedDataParallel checkpoint of 4 ranks: the module's
// parameters in full and Adam's state consolidated, in one file of
// save_checkpoint. A plain model and a plain Adam on one process load it
// and hold what one process trained on the whole batch holds; FSDP at 2
// ranks loads it and trains on as that process does, within float64
// rounding.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/checkpoint.h>
#include <lockstep/fsdp.h>
#include <lockstep/world.h>

#include "support/multiprocess.h"
#include "support/scratch_folder.h"
#include "support/shared_folder.h"
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

// Steps [first, last) of `model` trained on the whole batch in one process.
void train_alone(TinyTransformer& model, torch::optim::Optimizer& optimizer, int64_t first,
                 int64_t last) {
  for (int64_t step = first; step < last; ++step) {
    auto [tokens, targets] = token_batch(step);
    optimizer.zero_grad();
    loss_of(model(tokens), targets).backward();
    optimizer.step();
  }
}

void train_sharded(FullyShardedDataParallel<TinyTransformer>& fsdp,
                   torch::optim::Optimizer& optimizer, int64_t first, int64_t last, int rank,
                   int ranks) {
  int64_t share = kSamples / ranks;
  for (int64_t step = first; step < last; ++step) {
    auto [tokens, targets] = token_batch(step);
    optimizer.zero_grad();
    loss_of(fsdp(tokens.narrow(0, rank * share, share)), targets.narrow(0, rank * share, share))
        .backward();
    optimizer.step();
  }
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

} // namespace
} // namespace lockstep::testing
