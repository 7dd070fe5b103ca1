// A node the job lost, replaced: two launchers of two ranks each (nodes 0
// and 1, on this host over the job's TCP store) train elastic_float64 under
// --restart rank; node 1 is killed whole (its launcher and its ranks at
// once, as a lost host), the others train on, and a fresh launcher for
// node 1 (--node-rank 1 again, with no memory of the first) starts its
// ranks as their next incarnations, which the job's store knows: they
// rejoin with the live state, and every committed step equals one process.

#include <signal.h>

#include <chrono>
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

TEST(FaultToleranceReplacement, AFreshLauncherForALostNodeRejoinsTheJob) {
  ScratchFolder out("ft-replacement");
  constexpr int64_t kSteps = 300;
  int port = free_port();
  auto node = [&](int rank) {
    return Process({lockstep_run_binary(), "--nproc-per-node", "2", "--nnodes", "2",
                    "--node-rank", std::to_string(rank), "--master-addr", "127.0.0.1",
                    "--master-port", std::to_string(port), "--restart", "rank",
                    "--max-restarts", "2", "--", elastic_float64_binary(),
                    std::to_string(kSteps), out.path(), "10"},
                   {{"LOCKSTEP_JOB_SECRET", "replacement"}, {"LOCKSTEP_TIMEOUT", "30"}});
  };
  auto deadline = Clock::now() + std::chrono::seconds(150);
  Process first = node(0);
  Process lost = node(1);
  while (committed_lines(out / "rank-3.log") < 40 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_GE(committed_lines(out / "rank-3.log"), 40) << first.output() << lost.output();
  lost.kill_group(SIGKILL); // the host is gone: its launcher and its ranks
  lost.wait_until(deadline);
  Process replacement = node(1);
  auto replaced = replacement.wait_until(deadline);
  auto kept = first.wait_until(deadline);
  ASSERT_TRUE(kept.ok()) << kept.status() << "\n" << kept.output << replaced.output;
  ASSERT_TRUE(replaced.ok()) << replaced.status() << "\n" << replaced.output << kept.output;
  for (int rank : {2, 3}) {
    EXPECT_NE(replaced.output.find("rank " + std::to_string(rank) + " is known to the job's "
                                   "store (as incarnation 0)"),
              std::string::npos)
        << replaced.output;
    EXPECT_NE(replaced.output.find("[" + std::to_string(rank) + "] lockstep: rank " +
                                   std::to_string(rank) + ": received the live state"),
              std::string::npos)
        << replaced.output;
  }
  EXPECT_EQ(occurrences(kept.output + replaced.output, ": " + std::to_string(kSteps) + " steps"),
            4)
      << kept.output << replaced.output;
  expect_committed_steps_match(out, 4, elastic_reference(kSteps));
}

} // namespace
} // namespace lockstep::testing
