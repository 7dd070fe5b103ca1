// The transports beneath World: shared memory between the ranks of a host,
// and Gloo. Each collective equals its definition bit for bit on values
// whose sums are exact in every dtype, is bit-identical on every rank on
// values that round, over world sizes 1 to 4, sizes from one element to
// 64 MiB (odd ones included), the program's own tensors (copied through
// staging buffers) and World::allocate's (reduced in place). A rank killed
// or stopped in the middle of one is named; two jobs on one host keep to
// their own memory; where shared memory cannot be had, auto falls back to
// Gloo with one line and shm is an error.

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <lockstep/lockstep.h>

#include "support/collective_checks.h"
#include "support/expect_error.h"
#include "support/multiprocess.h"
#include "support/scratch_folder.h"
#include "world/process_identity.h"

namespace lockstep::testing {
namespace {

using Clock = std::chrono::steady_clock;

const char* transport_of(const std::string& name) {
  return name == "shm" ? "shared memory" : "Gloo";
}

class Transports : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(Transports, CollectivesMatchTheirDefinitionOnEveryRank) {
  auto [world_size, transport] = GetParam();
  LaunchOptions options;
  options.world_size = world_size;
  options.timeout = std::chrono::seconds(240);
  options.environment = [transport = transport](int, RankEnvironment& env) {
    env["LOCKSTEP_TRANSPORT"] = transport;
  };
  auto result = launch_ranks(options, [transport = transport](int) {
    World world = init();
    if (world.size() > 1) {
      EXPECT_EQ(world.transport().rfind(transport_of(transport), 0), 0u) << world.transport();
    }
    for (const auto& failure : check_collectives(world, /*large=*/true)) {
      ADD_FAILURE() << failure;
    }
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

std::vector<std::tuple<int, std::string>> transport_cases() {
  std::vector<std::tuple<int, std::string>> cases{{1, "auto"}};
  for (int size : {2, 3, 4}) {
    for (const char* transport : {"shm", "gloo"}) {
      cases.emplace_back(size, transport);
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(WorldSize, Transports, ::testing::ValuesIn(transport_cases()),
                         [](const auto& info) {
                           return "world" + std::to_string(std::get<0>(info.param)) + "_" +
                               std::get<1>(info.param);
                         });

TEST(SharedMemory, IsWhatAJobOnOneHostUsesAndItSaysSoAtInfo) {
  LaunchOptions options;
  options.environment = [](int, RankEnvironment& env) { env["LOCKSTEP_DEBUG"] = "INFO"; };
  auto result = launch_ranks(options, [](int) {
    World world = init();
    EXPECT_EQ(world.transport(), "shared memory (2 ranks on this host)");
  });
  ASSERT_TRUE(result.ok()) << result.report();
  EXPECT_NE(result.ranks[1].output.find("lockstep INFO rank 1: collectives of CPU tensors go "
                                        "through shared memory (2 ranks on this host)"),
            std::string::npos)
      << result.ranks[1].output;
}

// Whether /dev/shm holds anything whose name mentions lockstep.
std::vector<std::string> lockstep_files_in_dev_shm() {
  std::vector<std::string> found;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    if (entry.path().filename().string().find("lockstep") != std::string::npos) {
      found.push_back(entry.path().string());
    }
  }
  return found;
}

TEST(SharedMemory, ARankKilledInTheMiddleIsNamedAndNothingStaysInDevShm) {
  auto before = lockstep_files_in_dev_shm();
  auto result = launch_ranks({}, [](int rank) {
    World world = init();
    auto tensor = world.allocate(1 << 20, at::kFloat);
    tensor.fill_(1);
    world.all_reduce(tensor);
    if (rank == 1) {
      // Dies while rank 0 is in the next all-reduce. (Had it begun that
      // one, it might already have reduced its slice: rank 0 would finish.)
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      ::raise(SIGKILL);
    }
    auto pending = world.all_reduce_async(tensor, ReduceOp::Sum, "the doomed all_reduce");
    auto start = Clock::now();
    expect_error<CollectiveError>(
        [&] { pending.wait(); },
        {"rank 0: the doomed all_reduce #", " cannot complete: rank 1 (pid ",
         ") exited without closing its world"});
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(2));
  });
  if (in_rank_process()) {
    return;
  }
  ASSERT_EQ(result.ranks.size(), 2u);
  EXPECT_TRUE(result.ranks[0].ok()) << result.report();
  EXPECT_EQ(result.ranks[1].signal, SIGKILL) << result.report();
  EXPECT_EQ(lockstep_files_in_dev_shm(), before);
}

TEST(SharedMemory, AStoppedRankIsNamedAtTheTimeout) {
  ScratchFolder folder("stopped");
  LaunchOptions options;
  options.timeout = std::chrono::seconds(30);
  options.environment = [&](int, RankEnvironment& env) {
    env["LOCKSTEP_TIMEOUT"] = "2";
    env["LOCKSTEP_TEST_FOLDER"] = folder.path();
  };
  auto result = launch_ranks(options, [](int rank) {
    World world = init();
    auto tensor = world.allocate(1 << 20, at::kFloat);
    std::string folder = std::getenv("LOCKSTEP_TEST_FOLDER");
    if (rank == 1) {
      // Rank 1 arrives, and stops before rank 0 does: it cannot have reduced
      // its slice, whatever the scheduling (it could, had rank 0 come first).
      auto pending = world.all_reduce_async(tensor, ReduceOp::Sum, "the stalled all_reduce");
      std::ofstream(folder + "/pid.tmp") << ::getpid();
      std::filesystem::rename(folder + "/pid.tmp", folder + "/pid");
      ::raise(SIGSTOP); // a debugger, a swapped-out machine: alive but still
      return;
    }
    int pid = 0;
    auto deadline = Clock::now() + std::chrono::seconds(10);
    while (pid == 0 || detail::process_state(pid) != 'T') {
      ASSERT_LT(Clock::now(), deadline) << "rank 1 never stopped";
      std::ifstream(folder + "/pid") >> pid;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    auto pending = world.all_reduce_async(tensor, ReduceOp::Sum, "the stalled all_reduce");
    auto start = Clock::now();
    expect_error<TimeoutError>(
        [&] { pending.wait(); },
        {"rank 0: the stalled all_reduce #", " did not complete within 2 s: ",
         "cause: waiting for rank(s) 1 to reduce their slice of this tensor (shared memory)"});
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(4));
    ::kill(pid, SIGKILL);
  });
  if (!in_rank_process()) {
    EXPECT_TRUE(result.ranks.at(0).ok()) << result.report();
  }
}

TEST(SharedMemory, TwoJobsOnOneHostKeepToTheirOwnMemory) {
  // Harness ranks 0 and 1 are job A, 2 and 3 job B, at once on this host.
  int port_b = free_port();
  LaunchOptions options;
  options.world_size = 4;
  options.environment = [port_b](int rank, RankEnvironment& env) {
    env["WORLD_SIZE"] = "2";
    env["LOCAL_WORLD_SIZE"] = "2";
    env["RANK"] = std::to_string(rank % 2);
    env["LOCAL_RANK"] = std::to_string(rank % 2);
    if (rank >= 2) {
      env["MASTER_PORT"] = std::to_string(port_b);
      env["LOCKSTEP_JOB_ID"] = "job-b";
    }
  };
  auto result = launch_ranks(options, [](int rank) {
    World world = init();
    double job = rank < 2 ? 1 : 100;
    auto own = at::empty({300000}, at::kFloat);
    auto allocated = world.allocate(300000, at::kFloat);
    for (int i = 0; i < 200; ++i) {
      own.fill_(job * (world.rank() + 1) + i);
      allocated.fill_(job * (world.rank() + 1) - i);
      world.all_reduce(own);
      world.all_reduce(allocated);
      ASSERT_TRUE(own.eq(job * 3 + 2 * i).all().item<bool>()) << "iteration " << i;
      ASSERT_TRUE(allocated.eq(job * 3 - 2 * i).all().item<bool>()) << "iteration " << i;
    }
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST(SharedMemory, WhereItCannotBeHadAutoFallsBackToGlooWithOneLine) {
  LaunchOptions options;
  options.environment = [](int, RankEnvironment& env) {
    env["LOCKSTEP_SHM_DIR"] = "/nonexistent/shm";
  };
  auto result = launch_ranks(options, [](int) {
    World world = init();
    EXPECT_EQ(world.transport(), "Gloo");
    auto tensor = at::ones({10});
    world.all_reduce(tensor);
    EXPECT_TRUE(tensor.eq(2).all().item<bool>());
  });
  ASSERT_TRUE(result.ok()) << result.report();
  std::string line =
      "lockstep: collectives go through Gloo, not shared memory: rank 0: "
      "LOCKSTEP_SHM_DIR=/nonexistent/shm cannot be used: No such file or directory. "
      "(LOCKSTEP_TRANSPORT=gloo chooses Gloo without this line.)";
  EXPECT_NE(result.ranks[0].output.find(line), std::string::npos) << result.ranks[0].output;
  EXPECT_EQ(result.ranks[1].output.find("lockstep: collectives go through Gloo"),
            std::string::npos)
      << "one line, from rank 0";
}

TEST(SharedMemory, WhereItCannotBeHadShmIsAnError) {
  LaunchOptions options;
  options.environment = [](int, RankEnvironment& env) {
    env["LOCKSTEP_SHM_DIR"] = "/nonexistent/shm";
    env["LOCKSTEP_TRANSPORT"] = "shm";
  };
  auto result = launch_ranks(options, [](int rank) {
    expect_error<ConfigError>(
        [] { init(); },
        {"rank " + std::to_string(rank) + ": LOCKSTEP_TRANSPORT=shm (or "
         "WorldOptions::transport) asks for shared memory, but rank 0: "
         "LOCKSTEP_SHM_DIR=/nonexistent/shm cannot be used: No such file or directory. Run "
         "two or more ranks on each host"});
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

} // namespace
} // namespace lockstep::testing
