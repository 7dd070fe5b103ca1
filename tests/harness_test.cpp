// The multi-process harness is itself under test: a failing, hanging or
// crashing rank must fail the launch, within its limit, with the reason.

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include <gtest/gtest.h>

#include "support/documented_error.h"
#include "support/multiprocess.h"
#include "support/scratch_folder.h"

namespace lockstep::testing {
namespace {

TEST(Harness, EveryRankRunsWithItsEnvironment) {
  run_ranks(3, [](int rank) {
    EXPECT_EQ(std::getenv("RANK"), std::to_string(rank));
    EXPECT_STREQ(std::getenv("WORLD_SIZE"), "3");
    EXPECT_STREQ(std::getenv("MASTER_ADDR"), "127.0.0.1");
    EXPECT_NE(std::getenv("MASTER_PORT"), nullptr);
  });
}

TEST(Harness, AFailingRankFailsTheLaunch) {
  LaunchOptions options;
  options.world_size = 2;
  auto result = launch_ranks(options, [](int rank) {
    EXPECT_EQ(rank, 0) << "deliberate failure on rank " << rank;
  });
  EXPECT_FALSE(result.ok());
  EXPECT_TRUE(result.ranks[0].ok());
  EXPECT_EQ(result.ranks[1].exit_code, 1);
  EXPECT_NE(result.report().find("deliberate failure on rank 1"),
            std::string::npos)
      << result.report();
}

TEST(Harness, AnExceptionFailsTheRank) {
  LaunchOptions options;
  options.world_size = 1;
  auto result = launch_ranks(options, [](int) {
    throw std::runtime_error("thrown on purpose");
  });
  EXPECT_FALSE(result.ok());
  EXPECT_NE(result.ranks[0].output.find("thrown on purpose"), std::string::npos);
}

TEST(Harness, AHangingRankTimesOutWithinItsLimit) {
  LaunchOptions options;
  options.world_size = 2;
  // Long enough for rank 0 to start and end on a loaded machine (starting a
  // rank that links LibTorch took 1.6 s in a CI run), short enough to wait.
  options.timeout = std::chrono::seconds(6);
  options.stacks_on_timeout = false; // the limit alone is timed
  auto result = launch_ranks(options, [](int rank) {
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::hours(1));
    }
  });
  EXPECT_TRUE(result.timed_out());
  EXPECT_TRUE(result.ranks[0].ok());
  EXPECT_TRUE(result.ranks[1].timed_out);
  EXPECT_LT(result.elapsed, options.timeout + std::chrono::milliseconds(3500));
  EXPECT_NE(result.report().find("rank 1: timed out"), std::string::npos);
}

TEST(Harness, TimeoutAlsoKillsWhatARankStarted) {
  LaunchOptions options;
  options.world_size = 1;
  options.timeout = std::chrono::milliseconds(1000);
  // The rank re-runs this test from its start, so the marker's name reaches
  // it through the environment rather than through a local variable.
  ScratchFolder folder("harness");
  std::string path = folder / "marker";
  if (!in_rank_process()) {
    std::fclose(std::fopen(path.c_str(), "w"));
  }
  options.environment = [&](int, RankEnvironment& env) {
    env["LOCKSTEP_HARNESS_MARKER"] = path;
  };
  auto result = launch_ranks(options, [](int) {
    // A grandchild that would outlive a rank killed alone.
    std::string command =
        std::string("sleep 3 && rm -f ") + std::getenv("LOCKSTEP_HARNESS_MARKER") + " &";
    ASSERT_EQ(std::system(command.c_str()), 0);
    std::this_thread::sleep_for(std::chrono::hours(1));
  });
  EXPECT_TRUE(result.timed_out());
  // The stacks of the rank at its limit, where gdb may attach (a loaded
  // machine may still be loading LibTorch there: any frame will do).
  const auto& output = result.ranks[0].output;
  if (::access("/usr/bin/gdb", X_OK) == 0 && output.find("ptrace") == std::string::npos) {
    EXPECT_NE(output.find("Thread 1 "), std::string::npos) << result.report();
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(3500));
  EXPECT_EQ(::access(path.c_str(), F_OK), 0)
      << "the grandchild survived the rank's timeout";
}

TEST(Harness, ACrashingRankIsReportedWithItsSignal) {
  LaunchOptions options;
  options.world_size = 2;
  auto result = launch_ranks(options, [](int rank) {
    if (rank == 0) {
      std::abort();
    }
  });
  EXPECT_FALSE(result.ok());
  EXPECT_EQ(result.ranks[0].signal, SIGABRT);
  EXPECT_NE(result.report().find("rank 0: killed by signal 6 (Aborted)"),
            std::string::npos)
      << result.report();
}

TEST(Harness, EnvironmentOverridesReachTheRank) {
  LaunchOptions options;
  options.world_size = 2;
  options.environment = [](int rank, RankEnvironment& env) {
    env["LOCKSTEP_HARNESS_VALUE"] = "v" + std::to_string(rank);
    env["MASTER_ADDR"] = ""; // unset
  };
  auto result = launch_ranks(options, [](int rank) {
    EXPECT_EQ(std::getenv("LOCKSTEP_HARNESS_VALUE"), "v" + std::to_string(rank));
    EXPECT_EQ(std::getenv("MASTER_ADDR"), nullptr);
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST(DocumentedMessages, AnEllipsisStandsForTextThatVaries) {
  EXPECT_TRUE(matches_documented("exactly this", "exactly this"));
  EXPECT_FALSE(matches_documented("exactly this, and more", "exactly this"));
  EXPECT_TRUE(matches_documented("failed.\n  cause: port 4242 closed", "failed.\n  cause: …"));
  EXPECT_TRUE(matches_documented("a 1 b 2 c", "a … b … c"));
  EXPECT_FALSE(matches_documented("a 1 c 2 b", "a … b … c"));
  EXPECT_FALSE(matches_documented("ab", "ab…b")); // head and tail may not overlap
  EXPECT_FALSE(documented_message("bypass").empty());
}

} // namespace
} // namespace lockstep::testing
