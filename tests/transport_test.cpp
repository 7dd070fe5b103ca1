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

#include "support/expect_error.h"
#include "support/multiprocess.h"
#include "support/scratch_folder.h"

namespace lockstep::testing {
namespace {

using Clock = std::chrono::steady_clock;

const char* transport_of(const std::string& name) {
  return name == "shm" ? "shared memory" : "Gloo";
}

// What rank `rank` contributes: small integers, whose sums over 4 ranks are
// exact in float16 and bfloat16 too, or values that round.
at::Tensor contribution(int64_t numel, at::ScalarType type, int rank, bool exact) {
  auto positions = at::arange(numel, at::kDouble);
  auto values = exact ? at::remainder(positions * 7 + rank * 3, 13) - 6
                      : at::sin(positions * 0.37 + rank) * (rank + 1.5);
  return values.to(type);
}

// A checksum of `tensor`'s bytes, to compare ranks without trusting the
// transport under test.
std::string fingerprint(const at::Tensor& tensor) {
  auto bytes = tensor.contiguous().view(at::kByte);
  const auto* data = bytes.data_ptr<uint8_t>();
  uint64_t hash = 1469598103934665603ull;
  for (int64_t i = 0; i < bytes.numel(); ++i) {
    hash = (hash ^ data[i]) * 1099511628211ull;
  }
  return std::to_string(hash);
}

void expect_same_everywhere(World& world, const at::Tensor& tensor, const std::string& what) {
  auto prints = world.all_gather_strings(fingerprint(tensor));
  for (size_t rank = 1; rank < prints.size(); ++rank) {
    EXPECT_EQ(prints[rank], prints[0]) << what << ": rank " << rank << " differs from rank 0";
  }
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
  auto result = launch_ranks(options, [transport = transport](int rank) {
    World world = init();
    if (world.size() > 1) {
      EXPECT_EQ(world.transport().rfind(transport_of(transport), 0), 0u) << world.transport();
    }
    int n = world.size();
    // Every dtype up to a million elements; float32 also at 64 MiB.
    std::vector<std::pair<at::ScalarType, int64_t>> cases;
    for (auto type : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
      for (int64_t numel : {int64_t{1}, int64_t{7}, int64_t{1001}, int64_t{65536 + 3},
                            (int64_t{1} << 20) + 5}) {
        cases.emplace_back(type, numel);
      }
    }
    cases.emplace_back(at::kFloat, int64_t{16} << 20);
    for (auto [type, numel] : cases) {
      auto contributions = [&, type = type, numel = numel](bool exact) {
        std::vector<at::Tensor> all;
        for (int r = 0; r < n; ++r) {
          all.push_back(contribution(numel, type, r, exact));
        }
        return all;
      };
      auto exact_values = contributions(true);
      auto rounding_values = contributions(false);
      auto exact_sum = at::zeros({numel}, at::kDouble);
      auto rounded_exact = at::zeros({numel}, at::kDouble);
      auto smallest = exact_values[0].to(at::kDouble);
      for (int r = 0; r < n; ++r) {
        exact_sum += exact_values[r].to(at::kDouble);
        rounded_exact += rounding_values[r].to(at::kDouble);
        smallest = at::minimum(smallest, exact_values[r].to(at::kDouble));
      }
      auto allocated = world.allocate(numel, type);
      for (bool in_place : {false, true}) {
        std::string what = str(type, " x ", numel, in_place ? ", allocated" : ", own tensor");
        SCOPED_TRACE(what);
        auto place = [&](const at::Tensor& values) {
          return in_place ? allocated.copy_(values) : values.clone();
        };
        auto sum = place(exact_values[rank]);
        world.all_reduce(sum);
        EXPECT_TRUE(sum.equal(exact_sum.to(type))) << "sum";
        auto average = place(exact_values[rank]);
        world.all_reduce(average, ReduceOp::Average);
        EXPECT_TRUE(average.equal(exact_sum.to(type).div(n))) << "average";
        auto minimum = place(exact_values[rank]);
        world.all_reduce(minimum, ReduceOp::Min);
        EXPECT_TRUE(minimum.equal(smallest.to(type))) << "min";
        // Values that round: as close to the exact sum as the dtype allows,
        // and the same bits on every rank.
        auto rounded = place(rounding_values[rank]);
        world.all_reduce(rounded);
        double unit = type == at::kBFloat16 ? 1.0 / 128 : type == at::kHalf ? 1.0 / 1024
                      : type == at::kFloat ? 1.2e-7 : 2.3e-16;
        EXPECT_LE((rounded.to(at::kDouble) - rounded_exact).abs().max().item<double>(),
                  n * unit * (rounded_exact.abs().max().item<double>() + 1));
        expect_same_everywhere(world, rounded, what);
      }
    }
    for (auto type : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
      // Broadcast and all_gather move bits, whatever they are.
      for (int64_t numel : {int64_t{1}, int64_t{1001}, (int64_t{1} << 20) + 5}) {
        int root = n - 1;
        auto data = contribution(numel, type, rank, false);
        auto broadcast = data.clone();
        world.broadcast(broadcast, root);
        EXPECT_TRUE(broadcast.equal(contribution(numel, type, root, false))) << "broadcast";
        auto gathered = world.all_gather(data);
        for (int r = 0; r < n; ++r) {
          EXPECT_TRUE(gathered[r].equal(contribution(numel, type, r, false))) << "gather " << r;
        }
      }
    }
    world.barrier();
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
    auto pending = world.all_reduce_async(tensor, ReduceOp::Sum, "the doomed all_reduce");
    if (rank == 1) {
      ::raise(SIGKILL); // its part is posted; it never reduces its slice
    }
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
    auto pending = world.all_reduce_async(tensor, ReduceOp::Sum, "the stalled all_reduce");
    std::string pid_file = std::string(std::getenv("LOCKSTEP_TEST_FOLDER")) + "/pid";
    if (rank == 1) {
      std::ofstream(pid_file) << ::getpid();
      ::raise(SIGSTOP); // a debugger, a swapped-out machine: alive but still
      return;
    }
    auto start = Clock::now();
    expect_error<TimeoutError>(
        [&] { pending.wait(); },
        {"rank 0: the stalled all_reduce #", " did not complete within 2 s: ",
         "cause: waiting for rank(s) 1 to reduce their slice of this tensor (shared memory)"});
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(4));
    int pid = 0;
    std::ifstream(pid_file) >> pid;
    ASSERT_GT(pid, 0);
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
         "every rank on one host"});
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

} // namespace
} // namespace lockstep::testing
