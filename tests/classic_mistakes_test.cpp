// The classic mistakes of data-parallel training, each made on purpose at 2
// ranks: the error must read exactly as docs/troubleshooting.md shows it,
// and no rank may be left hanging.

#include <chrono>
#include <cstdlib>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "support/documented_error.h"
#include "support/expect_error.h"
#include "support/models.h"
#include "support/multiprocess.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

using torch::nn::Linear;
using torch::nn::ReLU;
using torch::nn::Sequential;

// This rank's share of the global batch of `step`, 4 samples per rank.
std::pair<torch::Tensor, torch::Tensor> shard(int64_t step, int rank, std::vector<int64_t> shape = {20}) {
  auto [x, y] = global_batch(step, 8, shape);
  return {x.narrow(0, 4 * rank, 4), y.narrow(0, 4 * rank, 4)};
}

TEST(ClassicMistakes, BackwardThatBypassesTheWrapper) {
  run_ranks(2, [](int rank) {
    World world = init();
    torch::manual_seed(8);
    Mlp model;
    DDP<Mlp> ddp(model, world, DdpOptions().bypass(Bypass::Error));
    auto [x, y] = shard(0, rank);
    auto mistake = [&] { torch::mse_loss(model(x), y).backward(); };
    if (rank == 0) {
      expect_documented_error<UsageError>(mistake, "bypass");
    } else {
      expect_error<UsageError>(mistake, {"rank 1: backward reached the parameters"});
    }
  });
}

TEST(ClassicMistakes, StaticGraphThatIsNot) {
  run_ranks(2, [](int rank) {
    World world = init();
    torch::manual_seed(7);
    Branchy model;
    DDP<Branchy> ddp(model, world, DdpOptions().static_graph(true));
    for (int step = 0; step < 2; ++step) {
      auto [x, y] = shard(step, rank);
      int64_t head = step == 1 && rank == 0 ? 1 : 0; // rank 0 changes head
      auto loss = torch::mse_loss(ddp(x, head), y);
      if (step == 0) {
        loss.backward();
      } else {
        expect_documented_error<UsageError>([&] { loss.backward(); }, "static-graph");
      }
    }
  });
}

TEST(ClassicMistakes, ModelsThatDiffer) {
  run_ranks(2, [](int rank) {
    World world = init();
    int width = rank == 1 ? 33 : 32; // a rank-dependent hyperparameter
    Sequential model(Linear(20, width), ReLU(), Linear(width, 5));
    expect_documented_error<UsageError>([&] { DDP<Sequential> ddp(model, world); },
                                        "models-differ");
  });
}

TEST(ClassicMistakes, BackwardOnSomeRanksOnly) {
  LaunchOptions options;
  options.environment = [](int, RankEnvironment& env) { env["LOCKSTEP_DEBUG"] = "DETAIL"; };
  auto result = launch_ranks(options, [](int rank) {
    World world = init();
    torch::manual_seed(3);
    Mlp model;
    DDP<Mlp> ddp(model, world);
    auto step = [&](int64_t i) {
      auto [x, y] = shard(i, rank);
      return torch::mse_loss(ddp(x), y);
    };
    step(0).backward();
    auto loss = step(1);
    if (rank == 0) { // say, a loss that only rank 0 finds worth a backward
      expect_documented_error<CollectiveError>([&] { loss.backward(); },
                                               "backward-on-some-ranks");
    } else {
      expect_error<CollectiveError>([&] { step(2).backward(); },
                                    {"rank 0 is doing all_reduce of bucket 0 of iteration 2"});
    }
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST(ClassicMistakes, RanksWithDifferentNumbersOfBatches) {
  // DETAIL through the option this time: it reaches World's collectives too.
  auto result = launch_ranks({}, [](int rank) {
    World world = init();
    torch::manual_seed(3);
    Mlp model;
    DDP<Mlp> ddp(model, world, DdpOptions().debug(DebugLevel::Detail));
    int batches = rank == 0 ? 3 : 2; // an uneven split of the data
    auto train_then_sum_losses = [&] {
      auto total = torch::zeros({1});
      for (int64_t i = 0; i < batches; ++i) {
        auto [x, y] = shard(i, rank);
        auto loss = torch::mse_loss(ddp(x), y);
        loss.backward();
        total += loss.detach();
      }
      world.all_reduce(total);
    };
    if (rank == 0) {
      expect_documented_error<CollectiveError>(train_then_sum_losses, "uneven-batches");
    } else {
      expect_error<CollectiveError>(train_then_sum_losses,
                                    {"rank 1 is doing all_reduce of Float [1]"});
    }
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST(ClassicMistakes, ARankThatIsLate) {
  LaunchOptions options;
  options.environment = [](int, RankEnvironment& env) { env["LOCKSTEP_TIMEOUT"] = "4"; };
  auto result = launch_ranks(options, [](int rank) {
    World world = init();
    torch::manual_seed(3);
    Mlp model;
    DDP<Mlp> ddp(model, world);
    auto [x, y] = shard(0, rank);
    auto loss = torch::mse_loss(ddp(x), y);
    if (rank == 0) {
      expect_documented_error<TimeoutError>([&] { loss.backward(); }, "timeout");
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(6)); // stuck elsewhere
      // At once: rank 0 gave up on the bucket, so its world broke, and it
      // left. (Over shared memory
      // the bucket itself may still complete here, since rank 0 had posted
      // its part; the next collective cannot.)
      auto start = std::chrono::steady_clock::now();
      expect_error<CollectiveError>(
          [&] { loss.backward(); },
          {"rank 1: ", " cannot complete: rank 0 stopped with an error having completed 2 "
           "collective(s)"});
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
    }
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST(ClassicMistakes, ARankThatDied) {
  auto result = launch_ranks({}, [](int rank) {
    World world = init();
    torch::manual_seed(3);
    Mlp model;
    DDP<Mlp> ddp(model, world);
    for (int64_t i = 0; i < 2; ++i) {
      auto [x, y] = shard(i, rank);
      auto loss = torch::mse_loss(ddp(x), y);
      if (rank == 1 && i == 1) {
        std::_Exit(3); // a crash, an out-of-memory kill, a node lost
      }
      if (rank == 0 && i == 1) {
        expect_documented_error<CollectiveError>([&] { loss.backward(); }, "dead-rank");
      } else {
        loss.backward();
      }
    }
  });
  if (!in_rank_process()) {
    ASSERT_EQ(result.ranks.size(), 2u);
    EXPECT_TRUE(result.ranks[0].ok()) << result.report();
    EXPECT_EQ(result.ranks[1].exit_code, 3) << result.report();
  }
}

} // namespace
} // namespace lockstep::testing
