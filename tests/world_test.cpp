// lockstep::init() and World's collectives on real processes, a real
// TCPStore and real Gloo, over world sizes 1 to 4 and several message sizes.

#include <dirent.h>

#include <cstdlib>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <lockstep/lockstep.h>

#include "compat/c10d.h"
#include "support/multiprocess.h"

namespace lockstep {
namespace {

using testing::LaunchOptions;
using testing::RankEnvironment;
using testing::launch_ranks;
using testing::run_ranks;

class Collectives
    : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

TEST_P(Collectives, MatchTheirDefinition) {
  auto [world_size, numel] = GetParam();
  run_ranks(world_size, [world_size = world_size, numel = numel](int rank) {
    World world = init();
    ASSERT_EQ(world.rank(), rank);
    ASSERT_EQ(world.size(), world_size);
    EXPECT_EQ(world.local_rank(), rank);
    EXPECT_EQ(world.local_size(), world_size);
    EXPECT_EQ(world.source(), "RANK/WORLD_SIZE");
    double n = world_size;

    auto sum = at::full({numel}, rank + 1.0, at::kFloat);
    world.all_reduce(sum);
    EXPECT_TRUE(sum.eq(n * (n + 1) / 2).all().item<bool>());

    auto average = at::arange(numel, at::kDouble) * (rank + 1);
    world.all_reduce(average, ReduceOp::Average);
    EXPECT_TRUE(at::allclose(average, at::arange(numel, at::kDouble) * (n + 1) / 2));

    auto largest = at::full({numel}, static_cast<int64_t>(rank), at::kLong);
    world.all_reduce(largest, ReduceOp::Max);
    EXPECT_TRUE(largest.eq(world_size - 1).all().item<bool>());

    auto smallest = at::full({numel}, rank + 3.0, at::kFloat);
    world.all_reduce(smallest, ReduceOp::Min);
    EXPECT_TRUE(smallest.eq(3.0).all().item<bool>());

    int root = world_size - 1;
    auto broadcast = rank == root ? at::arange(numel, at::kFloat)
                                  : at::zeros({numel}, at::kFloat);
    world.broadcast(broadcast, root);
    EXPECT_TRUE(broadcast.equal(at::arange(numel, at::kFloat)));

    auto gathered = world.all_gather(at::full({numel}, rank * 10.0, at::kFloat));
    ASSERT_EQ(static_cast<int>(gathered.size()), world_size);
    for (int r = 0; r < world_size; ++r) {
      EXPECT_TRUE(gathered[r].eq(r * 10.0).all().item<bool>()) << "from rank " << r;
    }

    world.barrier();
  });
}

INSTANTIATE_TEST_SUITE_P(
    WorldSizeAndElements,
    Collectives,
    ::testing::Combine(::testing::Values(1, 2, 3, 4),
                       ::testing::Values(int64_t{1}, int64_t{1000},
                                         int64_t{1} << 20)),
    [](const auto& info) {
      return "world" + std::to_string(std::get<0>(info.param)) + "_numel" +
          std::to_string(std::get<1>(info.param));
    });

TEST(World, CollectivesCarryEveryDtype) {
  run_ranks(2, [](int rank) {
    World world = init();
    for (auto type : {at::kFloat, at::kDouble, at::kBFloat16, at::kInt, at::kLong}) {
      auto options = at::TensorOptions().dtype(type);
      auto tensor = at::full({7}, rank + 1, options);
      world.all_reduce(tensor);
      EXPECT_TRUE(tensor.eq(3).all().item<bool>()) << type;
      EXPECT_EQ(tensor.scalar_type(), type);

      auto broadcast = at::full({5}, rank == 1 ? 2.5 : 0.0, options);
      world.broadcast(broadcast, 1);
      EXPECT_TRUE(broadcast.equal(at::full({5}, type == at::kInt || type == at::kLong ? 2 : 2.5, options))) << type;

      auto gathered = world.all_gather(at::full({3}, rank + 1, options));
      EXPECT_TRUE(gathered[0].eq(1).all().item<bool>()) << type;
      EXPECT_TRUE(gathered[1].eq(2).all().item<bool>()) << type;
    }
  });
}

// A 16-bit sum is a float32 sum rounded once, on every transport and at
// every size: over Gloo up to 4 ranks the 16-bit tensors are gathered in
// pieces and summed on each rank, from 5 on they cross widened to float32.
// The values are multiples of 1/64 below 2 in magnitude, exact in both
// formats and in any float32 sum of a few of them, so the expected bits do
// not depend on the order of the sum; the sum (up to 10, in steps of 1/64)
// needs more bits than bfloat16 has, so only one rounding at the end gives
// them. 4,500,001 elements: three of Gloo's 4 MiB pieces, the last ragged.
class SixteenBitSums : public ::testing::TestWithParam<testing::WorldSetup> {};

TEST_P(SixteenBitSums, AreFloat32SumsRoundedOnce) {
  run_ranks(GetParam(), [](int) {
    World world = init();
    int64_t numel = 4500001;
    auto of_rank = [&](int64_t rank) {
      return at::arange(numel, at::kFloat).mul(0.37).add(rank).sin().mul(127).round().div(64);
    };
    auto expected = at::zeros({numel}, at::kFloat);
    for (int rank = 0; rank < world.size(); ++rank) {
      expected.add_(of_rank(rank));
    }
    for (auto type : {at::kHalf, at::kBFloat16}) {
      auto tensor = of_rank(world.rank()).to(type);
      world.all_reduce(tensor);
      EXPECT_EQ(tensor.scalar_type(), type);
      EXPECT_TRUE(tensor.equal(expected.to(type))) << type << " over " << world.transport();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    WorldSetups,
    SixteenBitSums,
    ::testing::Values(testing::WorldSetup{2, "shm"}, testing::WorldSetup{2, "gloo"},
                      testing::WorldSetup{3, "gloo"}, testing::WorldSetup{5, "gloo"}),
    [](const auto& info) { return info.param.name(); });

TEST(World, GathersStringsRoundAfterRound) {
  run_ranks(3, [](int rank) {
    World world = init();
    for (int round = 0; round < 6; ++round) {
      auto values = world.all_gather_strings(
          "rank " + std::to_string(rank) + " round " + std::to_string(round));
      ASSERT_EQ(values.size(), 3u);
      for (int r = 0; r < 3; ++r) {
        EXPECT_EQ(values[r], "rank " + std::to_string(r) + " round " +
                      std::to_string(round));
      }
    }
  });
}

// Rank 0's text reaches the stream; the others' is discarded, though each
// rank evaluates what it prints (here a collective, which would hang if
// only rank 0 ran it).
TEST(World, OnRankZeroPrintsOnceAJob) {
  run_ranks(3, [](int rank) {
    World world = init();
    std::ostringstream out;
    for (int line = 0; line < 2; ++line) {
      on_rank_zero(world, out) << "line " << line << " of rank " << rank << ", ranks "
                               << world.all_gather_strings("x").size() << std::endl;
    }
    EXPECT_EQ(out.str(), rank == 0 ? "line 0 of rank 0, ranks 3\nline 1 of rank 0, ranks 3\n" : "");
    EXPECT_TRUE(on_rank_zero(world, out).good() == (rank == 0));
  });
}

int count_sockets() {
  int sockets = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  while (dirent* entry = ::readdir(dir)) {
    char target[256] = {};
    std::string path = std::string("/proc/self/fd/") + entry->d_name;
    if (::readlink(path.c_str(), target, sizeof(target) - 1) > 0 &&
        std::string(target).rfind("socket:", 0) == 0) {
      ++sockets;
    }
  }
  ::closedir(dir);
  return sockets;
}

TEST(World, SingleProcessWithoutVariablesOpensNoSocket) {
  LaunchOptions options;
  options.world_size = 1;
  options.environment = [](int, RankEnvironment& env) {
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK",
                             "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
      env[name] = "";
    }
  };
  auto result = launch_ranks(options, [](int) {
    int before = count_sockets();
    World world = init();
    EXPECT_EQ(world.source(), "single process");
    EXPECT_EQ(world.rank(), 0);
    EXPECT_EQ(world.size(), 1);
    auto tensor = at::ones({4});
    world.all_reduce(tensor, ReduceOp::Average);
    world.broadcast(tensor);
    world.barrier();
    EXPECT_TRUE(tensor.eq(1).all().item<bool>());
    EXPECT_EQ(world.all_gather_strings("alone"), std::vector<std::string>{"alone"});
    EXPECT_EQ(count_sockets(), before);
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

// Runs a 2-rank world whose ranks learn who they are only from another
// launcher's variables.
void expect_world_from(
    const std::string& source,
    const std::function<void(int, RankEnvironment&)>& variables) {
  LaunchOptions options;
  options.world_size = 2;
  options.environment = [&](int rank, RankEnvironment& env) {
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}) {
      env[name] = "";
    }
    env["LOCKSTEP_EXPECTED_SOURCE"] = source;
    variables(rank, env);
  };
  auto result = launch_ranks(options, [](int rank) {
    World world = init();
    EXPECT_EQ(world.source(), std::getenv("LOCKSTEP_EXPECTED_SOURCE"));
    EXPECT_EQ(world.rank(), rank);
    EXPECT_EQ(world.size(), 2);
    EXPECT_EQ(world.local_rank(), rank);
    auto tensor = at::full({3}, rank + 1.0);
    world.all_reduce(tensor);
    EXPECT_TRUE(tensor.eq(3).all().item<bool>());
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST(World, FormsFromOpenMpiVariables) {
  expect_world_from("OpenMPI", [](int rank, RankEnvironment& env) {
    env["OMPI_COMM_WORLD_RANK"] = std::to_string(rank);
    env["OMPI_COMM_WORLD_SIZE"] = "2";
    env["OMPI_COMM_WORLD_LOCAL_RANK"] = std::to_string(rank);
    env["OMPI_COMM_WORLD_LOCAL_SIZE"] = "2";
  });
}

TEST(World, FormsFromSlurmVariables) {
  expect_world_from("SLURM", [](int rank, RankEnvironment& env) {
    env["SLURM_PROCID"] = std::to_string(rank);
    env["SLURM_NTASKS"] = "2";
    env["SLURM_LOCALID"] = std::to_string(rank);
    env["SLURM_NTASKS_PER_NODE"] = "2";
  });
}

TEST(World, ConnectsToTorchrunsAgentStore) {
  LaunchOptions options;
  options.world_size = 2;
  options.environment = [](int, RankEnvironment& env) {
    env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
    env["TORCHELASTIC_RUN_ID"] = "agent-test";
  };
  auto result = launch_ranks(options, [](int rank) {
    // Rank 0's process plays torchrun's agent: it hosts its store before any
    // rank calls init(); the port is the agent's, so rank 0 serves the job's
    // store on another one and says where in the agent's.
    c10::intrusive_ptr<c10d::TCPStore> agent;
    if (rank == 0) {
      c10d::TCPStoreOptions store_options;
      store_options.port = static_cast<uint16_t>(std::atoi(std::getenv("MASTER_PORT")));
      store_options.isServer = true;
      store_options.waitWorkers = false;
      detail::choose_tcp_store_server(store_options); // what this LibTorch has
      agent = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_options);
    }
    World world = init();
    auto tensor = at::full({2}, rank + 1.0);
    world.all_reduce(tensor);
    EXPECT_TRUE(tensor.eq(3).all().item<bool>());
    world.barrier();
    if (rank == 0) {
      EXPECT_TRUE(agent->check({"lockstep/agent-test/0/store"}))
          << "the ranks did not find the job's store through the agent's";
    }
    world.barrier();
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

} // namespace
} // namespace lockstep
