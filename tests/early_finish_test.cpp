// A rank that leaves the training loop before the others (one more or one
// fewer iteration on one rank): the ranks still waiting fail within seconds,
// naming the rank that closed its world, with or without DETAIL, over the
// file store of one host and over the TCP store whose host may be the rank
// that left. The rank that finished exits 0: it did all it was asked.

#include <chrono>
#include <cstdlib>
#include <iostream>

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

using Clock = std::chrono::steady_clock;

enum class Uneven { ExtraOnRankZero, FewerOnRankZero };

struct Case {
  int world_size;
  Uneven uneven;
  bool detail;
  const char* store;
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << c.world_size << " ranks, " << c.store << " store";
}

class EarlyFinish : public ::testing::TestWithParam<Case> {};

constexpr int kIterations = 3;
// The exit code of a waiting rank that got the expected error: any other
// code (1 for a failed expectation) fails the test.
constexpr int kWaitingRankExit = 7;

TEST_P(EarlyFinish, WaitingRanksNameTheRankThatClosed) {
  Case c = GetParam();
  LaunchOptions options;
  options.world_size = c.world_size;
  options.timeout = std::chrono::seconds(50);
  options.environment = [c](int, RankEnvironment& env) {
    env["LOCKSTEP_DEBUG"] = c.detail ? "DETAIL" : "OFF";
    env["LOCKSTEP_STORE"] = c.store;
    env["LOCKSTEP_TIMEOUT"] = "30"; // an error within 5 s is not the timeout
  };
  auto result = launch_ranks(options, [c](int rank) {
    World world = init();
    torch::manual_seed(3);
    Mlp model;
    DDP<Mlp> ddp(model, world);
    int iterations = kIterations;
    if (rank == 0) {
      iterations += c.uneven == Uneven::ExtraOnRankZero ? 1 : -1;
    }
    auto step = [&](int64_t i) {
      auto [x, y] = global_batch(i, 4 * world.size(), {20});
      torch::mse_loss(ddp(x.narrow(0, 4 * rank, 4)), y.narrow(0, 4 * rank, 4)).backward();
    };
    for (int i = 0; i < std::min(iterations, kIterations - 1); ++i) {
      step(i);
    }
    auto begin = Clock::now();
    try {
      for (int i = kIterations - 1; i < iterations; ++i) {
        step(i);
      }
    } catch (const CollectiveError& e) {
      auto waited = Clock::now() - begin;
      EXPECT_LT(waited, std::chrono::seconds(5)) << e.what();
      std::string closed = c.uneven == Uneven::ExtraOnRankZero
          ? "rank 1 closed its world having completed "
          : "rank 0 closed its world having completed ";
      EXPECT_NE(std::string(e.what()).find(closed), std::string::npos) << e.what();
      if (c.world_size == 2 && c.uneven == Uneven::ExtraOnRankZero && !c.detail) {
        expect_documented_error<CollectiveError>([&] { throw; }, "early-finish");
      }
      std::cout << e.what() << std::endl;
      if (!::testing::Test::HasFailure()) {
        std::_Exit(kWaitingRankExit); // as a real job's rank exits, with its error
      }
      return;
    }
    bool waits = c.uneven == Uneven::ExtraOnRankZero ? rank == 0 : rank != 0;
    EXPECT_FALSE(waits) << "rank " << rank << " finished without an error";
  });
  if (in_rank_process()) {
    return;
  }
  ASSERT_EQ(static_cast<int>(result.ranks.size()), c.world_size);
  for (const auto& rank : result.ranks) {
    bool waits = c.uneven == Uneven::ExtraOnRankZero ? rank.rank == 0 : rank.rank != 0;
    if (waits) {
      EXPECT_EQ(rank.exit_code, kWaitingRankExit) << result.report() << rank.output;
    } else {
      EXPECT_TRUE(rank.ok()) << result.report();
    }
  }
}

std::vector<Case> cases() {
  std::vector<Case> all;
  for (int size : {2, 3}) {
    for (auto uneven : {Uneven::ExtraOnRankZero, Uneven::FewerOnRankZero}) {
      for (bool detail : {false, true}) {
        for (const char* store : {"auto", "tcp"}) {
          all.push_back({size, uneven, detail, store});
        }
      }
    }
  }
  return all;
}

INSTANTIATE_TEST_SUITE_P(
    UnevenIterations, EarlyFinish, ::testing::ValuesIn(cases()), [](const auto& info) {
      const Case& c = info.param;
      return "world" + std::to_string(c.world_size) +
          (c.uneven == Uneven::ExtraOnRankZero ? "_extra_on_rank0" : "_fewer_on_rank0") +
          (c.detail ? "_detail" : "") + (std::string(c.store) == "tcp" ? "_tcp_store" : "");
    });

TEST(EarlyFinish, ARankThatFailsIsNamedAsFailing) {
  // Rank 1's own error (here a bad input of the program's) closes its world
  // while the exception unwinds: rank 0 must not blame uneven batches.
  auto result = launch_ranks({}, [](int rank) {
    World world = init();
    auto tensor = torch::ones({4});
    world.all_reduce(tensor);
    if (rank == 1) {
      throw std::runtime_error("a corrupt batch");
    }
    expect_error<CollectiveError>(
        [&] { world.all_reduce(tensor); },
        {"rank 0: all_reduce of Float [4] #2 cannot complete: rank 1 stopped with an error "
         "having completed 1 collective(s), so it will never complete this one; its own "
         "output says why."});
  });
  if (!in_rank_process()) {
    EXPECT_TRUE(result.ranks.at(0).ok()) << result.report();
    EXPECT_NE(result.ranks.at(1).output.find("a corrupt batch"), std::string::npos);
  }
}

} // namespace
} // namespace lockstep::testing
