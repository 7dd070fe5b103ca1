// What a collective that fails leaves behind, and how the world behaves
// around it: a failed wait fails again (never a success with unreduced
// data) and the world refuses further collectives at once; ranks that reach
// World::allocate at different times agree on where the tensor lives; two
// threads may issue collectives; a timeout names only the ranks that did
// not arrive, however many collectives are in flight; and waiting polls the
// backend without throwing. Over shared memory and Gloo, at 2 and 3 ranks
// where ranks matter.

#include <cxxabi.h>
#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <lockstep/lockstep.h>

#include "support/expect_error.h"
#include "support/multiprocess.h"

// Every C++ throw in this binary passes here: the polling test counts them.
namespace {
std::atomic<uint64_t> thrown_count{0};
} // namespace

// Declared by <cxxabi.h> in this namespace, with C linkage.
namespace __cxxabiv1 {
extern "C" void __cxa_throw(void* thrown, std::type_info* type, void (*destroy)(void*)) {
  thrown_count.fetch_add(1, std::memory_order_relaxed);
  using Throw = void (*)(void*, std::type_info*, void (*)(void*));
  static auto real = reinterpret_cast<Throw>(::dlsym(RTLD_NEXT, "__cxa_throw"));
  real(thrown, type, destroy);
  __builtin_unreachable();
}
} // namespace __cxxabiv1

namespace lockstep::testing {
namespace {

using Clock = std::chrono::steady_clock;

class CollectiveFailures : public ::testing::TestWithParam<WorldSetup> {
 protected:
  LaunchResult run(const std::function<void(int rank)>& body,
                   const std::function<void(RankEnvironment&)>& more = nullptr) {
    WorldSetup setup = GetParam();
    LaunchOptions options;
    options.world_size = setup.size;
    options.timeout = std::chrono::seconds(90);
    options.environment = [setup, more](int, RankEnvironment& env) {
      env["LOCKSTEP_TRANSPORT"] = setup.transport;
      if (more) {
        more(env);
      }
    };
    return launch_ranks(options, body);
  }

  // The last rank arrives only after the others gave up on their first
  // collective (a 1 s timeout); `waiting` runs on the others, which stay
  // until every one has seen its own timeout.
  LaunchResult run_with_a_late_rank(const std::function<void(World&)>& waiting) {
    return run(
        [waiting](int rank) {
          World world = init();
          if (rank == world.size() - 1) {
            std::this_thread::sleep_for(std::chrono::seconds(4));
            return;
          }
          waiting(world);
          std::this_thread::sleep_for(std::chrono::seconds(1));
        },
        [](RankEnvironment& env) { env["LOCKSTEP_TIMEOUT"] = "1"; });
  }
};

INSTANTIATE_TEST_SUITE_P(WorldSetups, CollectiveFailures,
                         ::testing::ValuesIn(two_and_three_rank_setups()),
                         [](const auto& info) { return info.param.name(); });

TEST_P(CollectiveFailures, AFailedWaitFailsAgainAndTheWorldRefusesWhatFollowsAtOnce) {
  auto result = run_with_a_late_rank([](World& world) {
    auto tensor = at::full({1000}, 1.0 + world.rank());
    auto pending = world.all_reduce_async(tensor, ReduceOp::Average, "the first");
    expect_error<TimeoutError>([&] { pending.wait(); }, {"the first #1 did not complete"});
    // Waiting again must not pass off unreduced (or, over Gloo, partly
    // reduced) data as the average.
    expect_error<TimeoutError>([&] { pending.wait(); }, {"the first #1 did not complete"});
    // What follows fails at once, naming the collective that broke the
    // world, instead of queueing behind it for the whole timeout.
    auto start = Clock::now();
    auto other = at::ones({8});
    expect_error<CollectiveError>(
        [&] { world.all_reduce(other); },
        {"cannot start: collective #1 (the first) failed on this rank, so this world is "
         "unusable"});
    expect_error<CollectiveError>([&] { world.barrier(); }, {"unusable"});
    EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(500));
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

// Over Gloo a 16-bit sum travels as posted point-to-point messages that a
// thread of the collective's own waits on: a sum that times out must be
// abandoned (its thread freed, nothing left hanging) when it is dropped.
TEST_P(CollectiveFailures, ASixteenBitSumThatTimesOutIsAbandoned) {
  auto result = run_with_a_late_rank([](World& world) {
    auto tensor = at::full({300000}, 1.0 + world.rank(), at::kHalf);
    auto pending = world.all_reduce_async(tensor, ReduceOp::Sum, "the half sum");
    expect_error<TimeoutError>([&] { pending.wait(); }, {"the half sum #1 did not complete"});
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST_P(CollectiveFailures, RanksThatAllocateAtDifferentTimesAgreeWhereTheTensorLives) {
  // The last rank comes to allocate() well after the others' timeout:
  // every rank must reach the same verdict, so that the all-reduce that
  // follows runs the same way everywhere (not a hang until the timeout).
  if (GetParam().transport == "gloo") {
    GTEST_SKIP() << "Gloo allocates each rank's tensor privately: nothing to agree on";
  }
  auto result = run(
      [](int rank) {
        World world = init();
        int last = world.size() - 1;
        if (rank == last) {
          std::this_thread::sleep_for(std::chrono::milliseconds(3500));
        }
        auto tensor = world.allocate(1000, at::kFloat);
        tensor.fill_(1.0 + rank);
        auto start = Clock::now();
        world.all_reduce(tensor);
        int n = world.size();
        EXPECT_TRUE(tensor.equal(at::full({1000}, n * (n + 1) / 2.0)));
        if (rank == last) {
          EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(1500));
        }
      },
      [](RankEnvironment& env) { env["LOCKSTEP_TIMEOUT"] = "2"; });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST_P(CollectiveFailures, APeerThatDiesBeforeAllocateIsNamed) {
  auto result = run(
      [](int rank) {
        World world = init();
        world.barrier();
        int last = world.size() - 1;
        if (rank == last) {
          std::_Exit(3);
        }
        auto start = Clock::now();
        std::string transport = world.transport();
        try {
          auto tensor = world.allocate(1000, at::kFloat);
          // Gloo allocates privately and meets the dead rank only here.
          world.all_reduce(tensor);
          ADD_FAILURE() << "no error on rank " << rank;
        } catch (const CollectiveError& e) {
          EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(last)),
                    std::string::npos)
              << e.what();
        }
        EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
      },
      [](RankEnvironment& env) { env["LOCKSTEP_TIMEOUT"] = "30"; });
  ASSERT_FALSE(result.timed_out()) << result.report();
  for (const auto& rank : result.ranks) {
    if (rank.rank + 1 < static_cast<int>(result.ranks.size())) {
      EXPECT_TRUE(rank.ok()) << result.report();
    }
  }
}

TEST_P(CollectiveFailures, ADeadPeerIsNamedThoughAnotherLeftBeforeThisRankLooked) {
  // The race that made the test above flaky under load: rank 1 met the
  // dead rank first, reported it and exited, so that when rank 0 looked,
  // two processes were gone. The one that caused it must still be named.
  if (GetParam().size < 3) {
    GTEST_SKIP() << "needs a rank that dies and another that leaves";
  }
  auto result = run(
      [](int rank) {
        World world = init();
        world.barrier();
        int last = world.size() - 1;
        if (rank != 0) {
          std::_Exit(rank == last ? 3 : 0);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        try {
          auto tensor = world.allocate(1000, at::kFloat);
          world.all_reduce(tensor);
          ADD_FAILURE() << "no error on rank 0";
        } catch (const CollectiveError& e) {
          EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(last)),
                    std::string::npos)
              << e.what();
        }
      },
      [](RankEnvironment& env) { env["LOCKSTEP_TIMEOUT"] = "30"; });
  ASSERT_FALSE(result.timed_out()) << result.report();
  EXPECT_TRUE(result.ranks[0].ok()) << result.report();
}

TEST_P(CollectiveFailures, TwoThreadsMayIssueCollectives) {
  // Identical collectives, so that any pairing across ranks gives the same
  // sum: what is checked is that the transport keeps each one whole.
  auto result = run([](int) {
    World world = init();
    int n = world.size();
    auto issue = [&](int64_t numel) {
      for (int i = 0; i < 150; ++i) {
        auto tensor = at::ones({numel});
        world.all_reduce(tensor);
        if (!tensor.equal(at::full({numel}, static_cast<float>(n)))) {
          ADD_FAILURE() << "a collective of " << numel << " elements came back wrong";
          return;
        }
      }
    };
    std::thread first(issue, 3000);
    std::thread second(issue, 3000);
    first.join();
    second.join();
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST_P(CollectiveFailures, WaitingPollsTheBackendWithoutThrowing) {
  auto result = run([](int rank) {
    World world = init();
    world.barrier();
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(800));
    }
    auto tensor = at::ones({100});
    uint64_t before = thrown_count.load();
    world.all_reduce(tensor);
    EXPECT_EQ(thrown_count.load() - before, 0u) << "exceptions thrown while waiting";
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST(CollectiveFailureReports, ATimeoutNamesOnlyTheRanksThatDidNotArriveHoweverManyAreInFlight) {
  LaunchOptions options;
  options.world_size = 2;
  options.environment = [](int, RankEnvironment& env) {
    env["LOCKSTEP_TIMEOUT"] = "2";
    env["LOCKSTEP_STORE"] = "tcp"; // the ledger in the store, as across hosts
    env["LOCKSTEP_TRANSPORT"] = "gloo";
  };
  auto result = launch_ranks(options, [](int rank) {
    World world = init();
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(5));
      return;
    }
    std::vector<PendingCollective> pending;
    std::vector<at::Tensor> tensors;
    for (int i = 0; i < 100; ++i) {
      tensors.push_back(at::ones({4}));
      pending.push_back(world.all_reduce_async(tensors.back(), ReduceOp::Sum, "bucket"));
    }
    expect_error<TimeoutError>([&] { pending.front().wait(); },
                               {"rank(s) 1 never reached it (reached: 0)"});
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

} // namespace
} // namespace lockstep::testing
