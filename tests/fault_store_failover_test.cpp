// No single point of failure: two launchers of two ranks each (nodes 0 and
// 1, on this host over TCP) train under --restart rank, node 1 named as the
// store's successor: elastic_float64 (each rank a replica), and
// groups_float64 with FSDP inside replica groups of 2 (each node a group,
// torchft's FT-HSDP). Node 0 is killed whole (its
// launcher, which hosts the job's store, and its ranks at once, as a lost
// host whose address then refuses): node 1's launcher serves the store at
// its own address, node 1's ranks write back what they hold and train on
// as a world of 2, and a fresh launcher for node 0 finds the store at node
// 1 and rejoins. Then node 1 is lost whole in turn: the fresh node 0 takes
// the store back, and a fresh node 1 rejoins. Every committed step equals
// one process.

#include <signal.h>

#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "support/elastic_reference.h"
#include "support/job_output.h"
#include "support/multiprocess.h"
#include "support/paths.h"
#include "support/process.h"
#include "support/scratch_folder.h"

namespace lockstep::testing {
namespace {

using Clock = std::chrono::steady_clock;

bool await_lines(const std::string& path, int lines, Clock::time_point deadline) {
  while (committed_lines(path) < lines && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return committed_lines(path) >= lines;
}

bool await_output(Process& process, const std::string& text, Clock::time_point deadline) {
  while (process.output().find(text) == std::string::npos && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return process.output().find(text) != std::string::npos;
}

// Whether a rank that just received the live state commits steps with it
// (the world that took it in has formed).
bool trains_on(const std::string& path, Clock::time_point deadline) {
  return await_lines(path, committed_lines(path) + 3, deadline);
}

struct FailoverJob {
  std::string name;
  std::string program;
  /// Its environment besides the kill plan.
  std::map<std::string, std::string> env;
  /// The kill plan of the first node 0: rank 1 dies once, so that the
  /// job's store holds epochs that the store taking over must get back
  /// from the ranks.
  std::string first_kill;
  /// Restarts that first kill costs node 0 (its group goes with it).
  int first_restarts;
  /// Worlds of node 1's ranks alone that the first kill forms (node 0's
  /// group out).
  int alone_before_failover;
};

void PrintTo(const FailoverJob& job, std::ostream* out) {
  *out << job.name;
}

class FaultToleranceStoreFailover : public ::testing::TestWithParam<FailoverJob> {};

TEST_P(FaultToleranceStoreFailover, EachNodeLostWholeInTurnTheOtherServesTheStoreAndAFreshOneRejoins) {
  const auto& job = GetParam();
  ScratchFolder out("ft-store-failover");
  // 40 ms a step, so that each fresh node comes before the end (a job whose
  // loop ended has nothing to rejoin).
  constexpr int64_t kSteps = 800;
  int port = free_port();
  int successor = free_port();
  auto node = [&](int rank, const std::string& kills) {
    auto env = job.env;
    env["LOCKSTEP_JOB_SECRET"] = "failover";
    env["LOCKSTEP_TIMEOUT"] = "30";
    env["LOCKSTEP_TEST_KILLS"] = kills;
    return Process({lockstep_run_binary(), "--nproc-per-node", "2", "--nnodes", "2",
                    "--node-rank", std::to_string(rank), "--master-addr", "127.0.0.1",
                    "--master-port", std::to_string(port), "--store-successors",
                    "127.0.0.1:" + std::to_string(successor), "--restart", "rank",
                    "--max-restarts", "4", "--", job.program, std::to_string(kSteps),
                    out.path(), "40"},
                   env);
  };
  auto deadline = Clock::now() + std::chrono::seconds(240);
  Process first0 = node(0, job.first_kill);
  Process first1 = node(1, "");
  ASSERT_TRUE(await_output(first0, "[1] lockstep: rank 1: received the live state", deadline))
      << first0.output() << first1.output();
  ASSERT_TRUE(trains_on(out / "rank-1.log", deadline)) << first0.output();
  ASSERT_TRUE(await_lines(out / "rank-3.log", 40, deadline)) << first1.output();

  first0.kill_group(SIGKILL); // the host is gone: its launcher, its store and its ranks
  first0.wait_until(deadline);
  int before = committed_lines(out / "rank-3.log");
  ASSERT_TRUE(await_lines(out / "rank-3.log", before + 20, deadline)) << first1.output();
  Process second0 = node(0, "");
  for (const char* received : {"[0] lockstep: rank 0: received the live state",
                               "[1] lockstep: rank 1: received the live state"}) {
    ASSERT_TRUE(await_output(second0, received, deadline)) << second0.output() << first1.output();
  }
  // Node 1 is lost only once the world that took node 0's ranks in has
  // formed: a kill inside the transfer would lose the only ranks that held
  // the state, and the job would end saying so.
  ASSERT_TRUE(trains_on(out / "rank-0.log", deadline)) << second0.output();

  first1.kill_group(SIGKILL); // node 1 lost in turn, with the store it took over
  auto lost1 = first1.wait_until(deadline);
  before = committed_lines(out / "rank-0.log");
  ASSERT_TRUE(await_lines(out / "rank-0.log", before + 20, deadline)) << second0.output();
  Process second1 = node(1, "");

  auto node1 = second1.wait_until(deadline);
  auto node0 = second0.wait_until(deadline);
  ASSERT_TRUE(node0.ok()) << node0.status() << "\n" << node0.output << node1.output;
  ASSERT_TRUE(node1.ok()) << node1.status() << "\n" << node1.output << node0.output;
  const std::string at_node1 = "127.0.0.1:" + std::to_string(successor);
  const std::string at_node0 = "127.0.0.1:" + std::to_string(port);
  EXPECT_NE(lost1.output.find("node 1 serves it from now on at " + at_node1), std::string::npos)
      << lost1.output;
  // (It starts with the latest epoch its launcher read, and the ranks'
  // own write-back finds it there: store_failover_test.cpp.)
  EXPECT_GE(occurrences(lost1.output, " (launcher ranks 2, 3) from step"),
            2 * (job.alone_before_failover + 1))
      << "node 1's two ranks train on alone after node 0's loss\n" << lost1.output;
  EXPECT_NE(node0.output.find("node 1 serves the job's store at " + at_node1), std::string::npos)
      << node0.output;
  EXPECT_NE(node0.output.find("node 0 serves it from now on at " + at_node0), std::string::npos)
      << node0.output;
  // Restart counts live with the job too.
  EXPECT_NE(node0.output.find("the job restarted this node's ranks " +
                              std::to_string(job.first_restarts)),
            std::string::npos)
      << node0.output;
  for (int rank : {0, 1}) {
    EXPECT_NE(node0.output.find("[" + std::to_string(rank) + "] lockstep: rank " +
                                std::to_string(rank) + ": received the live state"),
              std::string::npos)
        << node0.output;
  }
  for (int rank : {2, 3}) {
    EXPECT_NE(node1.output.find("[" + std::to_string(rank) + "] lockstep: rank " +
                                std::to_string(rank) + ": received the live state"),
              std::string::npos)
        << node1.output;
  }
  EXPECT_EQ(occurrences(node0.output + node1.output, ": " + std::to_string(kSteps) + " steps"), 4)
      << node0.output << node1.output;
  expect_committed_steps_match(out, 4, elastic_reference(kSteps));
}

INSTANTIATE_TEST_SUITE_P(
    Jobs, FaultToleranceStoreFailover,
    ::testing::Values(
        FailoverJob{"replicas", elastic_float64_binary(), {}, "1:0:15:backward", 1, 0},
        // Each node a replica group of 2, FSDP inside: a node lost whole is
        // a group lost whole.
        FailoverJob{"fsdp_in_groups",
                    groups_float64_binary(),
                    {{"LOCKSTEP_TEST_GROUP_SIZE", "2"}, {"LOCKSTEP_TEST_INNER", "fsdp"}},
                    "1:0:15:forward",
                    2,
                    1}),
    [](const ::testing::TestParamInfo<FailoverJob>& info) { return info.param.name; });

} // namespace
} // namespace lockstep::testing
