// lockstep::FaultTolerance: a dead rank costs the step in flight, not the
// job. Real processes under lockstep-run --restart rank, killed (SIGKILL)
// or stopped (SIGSTOP) at chosen moments; each run is compared, step by
// step, with a reference that applies exactly the committed steps.

#include <signal.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "support/elastic_reference.h"
#include "support/expect_error.h"
#include "support/job_output.h"
#include "support/multiprocess.h"
#include "support/models.h"
#include "support/process.h"
#include "support/scratch_folder.h"
#include "support/training.h"
#include "store/client.h"
#include "store/host_folder.h"
#include "support/paths.h"

namespace lockstep::testing {
namespace {

using Clock = std::chrono::steady_clock;

// Until `path` holds `lines` lines (a rank's committed steps), at most
// until `deadline`.
void wait_for_lines(const std::string& path, int lines, Clock::time_point deadline) {
  while (Clock::now() < deadline) {
    std::ifstream log(path);
    std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    if (occurrences(text, "\n") >= lines) {
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// A rank of a job of `size` on this host started by hand (no launcher),
// running elastic_float64 with `args`; `extra` adds to its environment.
Process elastic_rank(int rank, int size, int port, const std::vector<std::string>& args,
                     Environment extra = {}) {
  std::vector<std::string> argv{lockstep::testing::elastic_float64_binary()};
  argv.insert(argv.end(), args.begin(), args.end());
  Environment environment{{"RANK", std::to_string(rank)}, {"WORLD_SIZE", std::to_string(size)},
                          {"LOCAL_RANK", std::to_string(rank)},
                          {"LOCAL_WORLD_SIZE", std::to_string(size)},
                          {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)},
                          {"OMP_NUM_THREADS", "1"}};
  environment.insert(extra.begin(), extra.end());
  return Process(argv, environment);
}

std::vector<std::string> launch(int ranks, int restarts) {
  return {lockstep::testing::lockstep_run_binary(), "--nproc-per-node", std::to_string(ranks), "--restart",
          "rank", "--max-restarts", std::to_string(restarts), "--"};
}

// elastic_float64 under lockstep-run --restart rank: STEPS, OUT_DIR and
// the pause after each step.
std::vector<std::string> elastic_job(int ranks, int restarts, int64_t steps,
                                     const ScratchFolder& out, int pause_ms) {
  auto argv = launch(ranks, restarts);
  for (std::string arg : {std::string(lockstep::testing::elastic_float64_binary()),
                          std::to_string(steps), out.path(), std::to_string(pause_ms)}) {
    argv.push_back(arg);
  }
  return argv;
}

struct KillPlan {
  int ranks;
  /// LOCKSTEP_TEST_KILLS of elastic_float64.
  std::string kills;
  int killed;
};

class FaultToleranceKills : public ::testing::TestWithParam<KillPlan> {};

TEST_P(FaultToleranceKills, EachFailureCostsOneStepAndTheRunEqualsTheCommittedSteps) {
  const auto& plan = GetParam();
  ScratchFolder out("ft-kills");
  constexpr int64_t kSteps = 300;
  auto argv = elastic_job(plan.ranks, plan.killed, kSteps, out, 10);
  // A collective that stalls (none should) then costs a step, named in
  // the log, instead of the test's whole limit. With a secret, so that
  // every decision is signed and checked.
  auto result = run_process(argv,
                            {{"LOCKSTEP_TEST_KILLS", plan.kills},
                             {"LOCKSTEP_TIMEOUT", "20"},
                             {"LOCKSTEP_JOB_SECRET", "kill-plans"}},
                            std::chrono::seconds(120));
  ASSERT_TRUE(result.ok()) << result.status() << "\n" << result.output;
  // Every kill was a restart of that rank alone, and every restarted rank
  // received the live state from a peer.
  EXPECT_EQ(occurrences(result.output, "killed by signal 9"), plan.killed) << result.output;
  EXPECT_EQ(occurrences(result.output, "restarting it alone"), plan.killed) << result.output;
  EXPECT_EQ(occurrences(result.output, "received the live state"), plan.killed) << result.output;
  EXPECT_EQ(occurrences(result.output, "the job is ending"), 0) << result.output;
  // The live state brings the optimizer's group options: a restarted rank
  // receives the sender's decayed rate. (LibTorch's StepLR halves it at its
  // 51st, 101st ... step: it decides before it counts.)
  std::regex received("received lr ([0-9.e+-]+) after ([0-9]+) scheduled steps");
  int receipts = 0;
  for (std::sregex_iterator it(result.output.begin(), result.output.end(), received), end;
       it != end; ++it, ++receipts) {
    int64_t scheduled = std::stoll((*it)[2]);
    int64_t halvings = scheduled > 0 ? (scheduled - 1) / 50 : 0;
    EXPECT_EQ(std::stod((*it)[1]), 0.1 * std::pow(0.5, static_cast<double>(halvings)))
        << "after " << scheduled << " steps";
  }
  EXPECT_EQ(receipts, plan.killed) << result.output;
  // The GradScaler's state travels too (FaultTolerance::register_state):
  // 300 clean updates, a growth every 20, on every rank alike.
  EXPECT_EQ(occurrences(result.output, "loss scale 2147483648\n"), plan.ranks) << result.output;
  // Replicas checked bit for bit at the end, on every rank.
  EXPECT_EQ(occurrences(result.output, ": " + std::to_string(kSteps) + " steps"), plan.ranks)
      << result.output;
  expect_committed_steps_match(out, plan.ranks, elastic_reference(kSteps));
}

INSTANTIATE_TEST_SUITE_P(
    Plans,
    FaultToleranceKills,
    ::testing::Values(
        // Rank 1 in backward with a bucket in flight; then rank 0, whose
        // process made the job's store, in forward.
        KillPlan{2, "1:0:4:backward,0:0:10:forward", 2},
        // In forward, in backward, after the commit (during the step), at
        // the commit; two at once.
        KillPlan{3, "1:0:3:forward,2:0:6:backward,0:0:9:step,1:1:12:commit,2:1:30:begin", 5},
        KillPlan{4, "3:0:5:backward,1:0:10:forward,2:0:10:forward", 3},
        // The sender of the live state dies while it sends (rank 1, up to
        // date, waits for the transfer outside it): the next epoch's sender
        // brings both restarts up to date.
        KillPlan{3, "2:0:5:forward,0:0:5:send", 2}),
    [](const ::testing::TestParamInfo<KillPlan>& info) {
      return std::to_string(info.param.ranks) + "Ranks" + std::to_string(info.param.killed) +
          "Kills";
    });

// The live state travels from its sender to the rank that rejoins, and to
// no other, in pieces of FaultToleranceOptions::state_piece_bytes.
TEST(FaultTolerance, TheLiveStateGoesOnlyToTheRankThatRejoinsInPieces) {
  ScratchFolder out("ft-transfer");
  constexpr int64_t kSteps = 60;
  auto result = run_process(elastic_job(3, 1, kSteps, out, 10),
                            {{"LOCKSTEP_TEST_KILLS", "2:0:5:forward"},
                             {"LOCKSTEP_TEST_STATE_PIECE_BYTES", "1000"},
                             {"LOCKSTEP_JOB_SECRET", "transfer"}},
                            std::chrono::seconds(120));
  ASSERT_TRUE(result.ok()) << result.status() << "\n" << result.output;
  std::regex line("rank ([0-9]) incarnation ([0-9]): live state sent ([0-9]+) bytes, "
                  "received ([0-9]+) bytes");
  std::map<std::string, std::pair<int64_t, int64_t>> figures;
  for (std::sregex_iterator it(result.output.begin(), result.output.end(), line), end;
       it != end; ++it) {
    figures[(*it)[1].str() + "." + (*it)[2].str()] = {std::stoll((*it)[3]), std::stoll((*it)[4])};
  }
  ASSERT_EQ(figures.size(), 3u) << result.output;
  // Rank 0 (the lowest that holds the state) sends; rank 1 is up to date.
  EXPECT_GT(figures["0.0"].first, 3000) << result.output; // pieces of 1000 bytes
  EXPECT_EQ(figures["0.0"].second, 0);
  EXPECT_EQ(figures["1.0"], std::make_pair(int64_t{0}, int64_t{0})) << result.output;
  EXPECT_EQ(figures["2.1"], std::make_pair(int64_t{0}, figures["0.0"].first)) << result.output;
  expect_committed_steps_match(out, 3, elastic_reference(kSteps));
}

int read_pid(const std::string& path) {
  int pid = 0;
  std::ifstream(path) >> pid;
  return pid;
}

TEST(FaultTolerance, AStoppedRankIsDroppedAfterTheHeartbeatTimeoutThenRejoins) {
  ScratchFolder out("ft-stop");
  auto argv = elastic_job(3, 0, 300, out, 10);
  Process job(argv, {});
  auto deadline = Clock::now() + std::chrono::seconds(120);
  wait_for_lines(out / "rank-2.log", 20, deadline); // rank 2 committed a few steps
  int pid = read_pid(out / "pid-2");
  ASSERT_GT(pid, 0);
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  // The heartbeat timeout of elastic_float64 is 1 s. The rank stays
  // stopped until the survivors have formed a world without it: a rank
  // that moves again before the new world is decided is alive, and is
  // rightly taken into it (CI once saw that, with the survivors' reason
  // already printed), and on a loaded machine a fixed pause can end
  // before the survivors look.
  const std::string said = "sent no heartbeat for ";
  const std::string formed_without = "(launcher ranks 0, 1) from step";
  while (job.output().find(formed_without) == std::string::npos && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(::kill(pid, SIGCONT), 0);
  size_t at = job.output().find(said);
  ASSERT_NE(at, std::string::npos) << "no survivor named the stopped rank:\n" << job.output();
  EXPECT_GE(std::stoll(job.output().substr(at + said.size())), 1000) << job.output();
  auto result = job.wait_until(deadline);
  ASSERT_TRUE(result.ok()) << result.status() << "\n" << result.output;
  EXPECT_NE(result.output.find("sent no heartbeat for"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("[2] lockstep: rank 2: received the live state"),
            std::string::npos)
      << result.output;
  EXPECT_EQ(occurrences(result.output, "restarting it alone"), 0) << result.output;
  EXPECT_EQ(occurrences(result.output, ": 300 steps"), 3) << result.output;
  expect_committed_steps_match(out, 3, elastic_reference(300));
}

// A steady step makes no store operation, with a secret, over either
// transport: whether it counts is agreed in the step's own world. Counted
// by the job store itself (its key operations; liveness's beats aside).
class FaultToleranceSteadyStep : public ::testing::TestWithParam<std::string> {};

TEST_P(FaultToleranceSteadyStep, MakesNoStoreOperation) {
  ScratchFolder out("ft-steady");
  auto argv = elastic_job(3, 0, 150, out, 0);
  auto result = run_process(argv,
                            {{"LOCKSTEP_TEST_COUNT_STORE", "20:120"},
                             {"LOCKSTEP_TRANSPORT", GetParam()},
                             {"LOCKSTEP_JOB_SECRET", "steady"}},
                            std::chrono::seconds(120));
  ASSERT_TRUE(result.ok()) << result.status() << "\n" << result.output;
  EXPECT_NE(result.output.find("elastic_float64: 0 store key operations in 100 steps"),
            std::string::npos)
      << result.output;
  expect_committed_steps_match(out, 3, elastic_reference(150));
}

INSTANTIATE_TEST_SUITE_P(Transports, FaultToleranceSteadyStep, ::testing::Values("shm", "gloo"));

// Across hosts the ledger of collectives is kept in the job's store
// (LOCKSTEP_STORE=tcp keeps it there on one host too): a rank's progress
// goes there from a thread of its own, at most every 250 ms, never on a
// collective's path. 100 steps of five collectives (three buckets, the
// verdict, the sums) on 3 ranks made two store operations per collective
// per rank (3000); now at most one per rank per 250 ms of the run.
TEST(FaultToleranceSteadyStepAcrossHosts, TheLedgerStaysOffTheCollectivesPath) {
  ScratchFolder out("ft-steady-ledger");
  auto argv = elastic_job(3, 0, 150, out, 0);
  auto start = Clock::now();
  auto result = run_process(argv,
                            {{"LOCKSTEP_TEST_COUNT_STORE", "20:120"},
                             {"LOCKSTEP_STORE", "tcp"},
                             {"LOCKSTEP_TRANSPORT", "gloo"}},
                            std::chrono::seconds(120));
  double wall = std::chrono::duration<double>(Clock::now() - start).count();
  ASSERT_TRUE(result.ok()) << result.status() << "\n" << result.output;
  std::smatch counted;
  std::regex line("elastic_float64: ([0-9]+) store key operations in 100 steps");
  ASSERT_TRUE(std::regex_search(result.output, counted, line)) << result.output;
  double operations = std::stod(counted[1]);
  EXPECT_LE(operations, 3 * (wall / 0.25 + 1)) << "in " << wall << " s";
  EXPECT_LT(operations, 300) << "one or more per step per rank";
  expect_committed_steps_match(out, 3, elastic_reference(150));
}

// One rank calls commit() while the others sum: every rank names the
// misuse (the verdict carries what each sums), none meets a collective of
// another shape.
TEST(FaultTolerance, RanksThatCommitUnlikeAreRefusedByNameOnEveryRank) {
  ScratchFolder out("ft-unlike");
  auto argv = elastic_job(3, 0, 30, out, 0);
  auto result = run_process(argv, {{"LOCKSTEP_TEST_PLAIN_COMMIT", "1"}},
                            std::chrono::seconds(120));
  EXPECT_FALSE(result.ok()) << result.output;
  EXPECT_EQ(occurrences(result.output, "ft.commit(sums) on some ranks of step 5 and ft.commit() "
                                       "on others"),
            3)
      << result.output;
}

// A rank that fails after the loop, before any rank ended, is restarted
// and finds the loop ended: that restart once covered the failure (exit 0
// for the job). Its earlier incarnation was in the last world, so the job
// fails, and says why.
TEST(FaultTolerance, ARankThatFailsAfterTheLoopFailsTheJobThoughItEndsFirst) {
  ScratchFolder out("ft-after-loop");
  auto argv = elastic_job(3, 2, 30, out, 0);
  auto result = run_process(argv, {{"LOCKSTEP_TEST_KILLS", "1:0:0:end"}},
                            std::chrono::seconds(120));
  EXPECT_FALSE(result.ok()) << result.output;
  EXPECT_NE(result.output.find("restarting it alone"), std::string::npos)
      << "the restart this test is about did not happen:\n" << result.output;
  EXPECT_NE(result.output.find("rank 1 (incarnation 0) failed after the job's loop"),
            std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("failed after the job's loop: it was a member of the last world"),
            std::string::npos)
      << result.output;
  EXPECT_EQ(occurrences(result.output, ": 30 steps"), 2) << result.output;
}

// A rank stopped past the heartbeat timeout whose rank is restarted (here by
// hand, as a launcher would) comes back stale: it is refused by name, and
// the job goes on with its newer incarnation.
TEST(FaultTolerance, AStaleIncarnationIsRefusedByName) {
  ScratchFolder out("ft-stale");
  ScratchFolder later("ft-stale-later");
  int port = free_port();
  auto rank_process = [&](int rank, int incarnation, const std::string& folder) {
    return elastic_rank(rank, 3, port, {"300", folder, "10"},
                        {{"LOCKSTEP_INCARNATION", std::to_string(incarnation)}});
  };
  std::vector<Process> ranks;
  for (int rank = 0; rank < 3; ++rank) {
    ranks.push_back(rank_process(rank, 0, out.path()));
  }
  auto deadline = Clock::now() + std::chrono::seconds(120);
  wait_for_lines(out / "rank-2.log", 20, deadline);
  ASSERT_EQ(::kill(ranks[2].pid(), SIGSTOP), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  Process restarted = rank_process(2, 1, later.path());
  while (Clock::now() < deadline && restarted.output().find("received the live state") ==
                                        std::string::npos) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(::kill(ranks[2].pid(), SIGCONT), 0);
  auto stale = ranks[2].wait_until(deadline);
  EXPECT_FALSE(stale.ok());
  EXPECT_NE(stale.output.find("rank 2 (incarnation 0, pid " + std::to_string(ranks[2].pid()) +
                              ") is refused: its rank was restarted since, as incarnation 1"),
            std::string::npos)
      << stale.output;
  for (auto* process : {&ranks[0], &ranks[1], &restarted}) {
    auto result = process->wait_until(deadline);
    EXPECT_TRUE(result.ok()) << result.status() << "\n" << result.output;
    EXPECT_NE(result.output.find(": 300 steps"), std::string::npos) << result.output;
  }
}

// Below min_world_size the survivors wait for the restarted rank instead of
// training on alone; they never form a smaller world.
TEST(FaultTolerance, BelowTheMinimumTheSurvivorsWaitForTheRankToComeBack) {
  ScratchFolder out("ft-minimum");
  auto argv = launch(2, 1);
  for (std::string arg : {std::string(lockstep::testing::elastic_float64_binary()), std::string("200"), out.path(),
                          std::string("10"), std::string("2")}) {
    argv.push_back(arg);
  }
  auto result = run_process(argv, {{"LOCKSTEP_TEST_KILLS", "1:0:20:backward"}},
                            std::chrono::seconds(120));
  ASSERT_TRUE(result.ok()) << result.status() << "\n" << result.output;
  EXPECT_EQ(occurrences(result.output, "received the live state"), 1) << result.output;
  EXPECT_EQ(occurrences(result.output, " of 1 ("), 0) << "a world below the minimum formed:\n"
                                                  << result.output;
  expect_committed_steps_match(out, 2, elastic_reference(200));
}

// ... and raise, naming the minimum, when no rank comes back in time.
TEST(FaultTolerance, BelowTheMinimumForLongerThanTheTimeoutIsAnError) {
  ScratchFolder out("ft-minimum-timeout");
  int port = free_port();
  std::vector<Process> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.push_back(elastic_rank(rank, 2, port, {"200", out.path(), "10", "2", "1500"},
                                 {{"LOCKSTEP_TEST_KILLS", "1:0:20:forward"}}));
  }
  auto deadline = Clock::now() + std::chrono::seconds(60);
  auto killed = ranks[1].wait_until(deadline);
  EXPECT_EQ(killed.signal, SIGKILL) << killed.status();
  auto survivor = ranks[0].wait_until(deadline);
  EXPECT_FALSE(survivor.ok());
  EXPECT_FALSE(survivor.timed_out);
  EXPECT_NE(survivor.output.find("FaultToleranceError"), std::string::npos) << survivor.output;
  EXPECT_NE(survivor.output.find("1 rank(s) can train, fewer than min_world_size 2, and no "
                                 "other came back within FaultToleranceOptions::timeout (1.5 s)"),
            std::string::npos)
      << survivor.output;
}

// lockstep-run hosts the job's store, so that it outlives rank 0, on one
// host (a Unix socket) as across hosts (TCP): rank 0 is killed, restarted
// and rejoins while the others train on; meanwhile another job starts on
// this host (and, clearing the folders of crashed jobs, leaves this one's
// alone).
class StoreOutlivesRankZero : public ::testing::TestWithParam<std::string> {};

TEST_P(StoreOutlivesRankZero, UnderTheLauncher) {
  ScratchFolder out("ft-store");
  auto argv = elastic_job(2, 1, 150, out, 10);
  Process job(argv, {{"LOCKSTEP_TEST_KILLS", "0:0:20:forward"}, {"LOCKSTEP_STORE", GetParam()},
                     {"LOCKSTEP_TIMEOUT", "20"}});
  auto deadline = Clock::now() + std::chrono::seconds(120);
  while (Clock::now() < deadline && job.output().find("restarting it alone") == std::string::npos) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto other = run_process({lockstep::testing::lockstep_run_binary(), "--nproc-per-node", "2", "--", lockstep::testing::hello_binary()},
                           {}, std::chrono::seconds(60));
  EXPECT_TRUE(other.ok()) << other.status() << "\n" << other.output;
  auto result = job.wait_until(deadline);
  ASSERT_TRUE(result.ok()) << result.status() << "\n" << result.output;
  EXPECT_EQ(occurrences(result.output, "received the live state"), 1) << result.output;
  EXPECT_EQ(occurrences(result.output, ": 150 steps"), 2) << result.output;
  expect_committed_steps_match(out, 2, elastic_reference(150));
}

INSTANTIATE_TEST_SUITE_P(Stores, StoreOutlivesRankZero, ::testing::Values("file", "tcp"));

// A rank whose training thread hangs still beats (its heartbeat has a
// thread of its own): the others find it short of the step they finished
// within step_timeout (3 s here; the collectives' own limit is 60 s),
// report it, drop the step and go on; its launcher ends it, and its
// restart rejoins.
TEST(FaultTolerance, AHungRankIsReportedEndedByItsLauncherAndRejoins) {
  ScratchFolder out("ft-hang");
  auto result = run_process(elastic_job(3, 1, 200, out, 10),
                            {{"LOCKSTEP_TEST_KILLS", "2:0:20:hang"},
                             {"LOCKSTEP_TEST_STEP_TIMEOUT_MS", "3000"},
                             {"LOCKSTEP_TIMEOUT", "60"}},
                            std::chrono::seconds(150));
  ASSERT_TRUE(result.ok()) << result.status() << "\n" << result.output;
  EXPECT_EQ(occurrences(result.output, "was judged hung by the others"), 1) << result.output;
  EXPECT_NE(result.output.find("it is hung"), std::string::npos) << result.output;
  EXPECT_EQ(occurrences(result.output, "received the live state"), 1) << result.output;
  EXPECT_EQ(occurrences(result.output, "can train, fewer than"), 0) << result.output;
  EXPECT_EQ(occurrences(result.output, ": 200 steps"), 3) << result.output;
  expect_committed_steps_match(out, 3, elastic_reference(200));
}

// A rank that ends through an exception its program catches (return 1, as
// C++ programs end) is a failure like a crash: restarted, it rejoins.
TEST(FaultTolerance, ARankThatEndsWithAnErrorIsRestartedAndRejoins) {
  ScratchFolder out("ft-throw");
  auto result = run_process(elastic_job(3, 1, 200, out, 10),
                            {{"LOCKSTEP_TEST_KILLS", "1:0:20:throw"}, {"LOCKSTEP_TIMEOUT", "20"}},
                            std::chrono::seconds(120));
  ASSERT_TRUE(result.ok()) << result.status() << "\n" << result.output;
  EXPECT_EQ(occurrences(result.output, "a planned error in forward"), 1) << result.output;
  EXPECT_EQ(occurrences(result.output, "exited with code 1; restarting it alone"), 1)
      << result.output;
  EXPECT_EQ(occurrences(result.output, "received the live state"), 1) << result.output;
  expect_committed_steps_match(out, 3, elastic_reference(200));
}

// A program that keeps state of its own out of the live transfer (here its
// learning-rate schedule): the rank that rejoins steps with another rate
// from its 50th step on, and the check at the end names the likely cause.
TEST(FaultTolerance, ADivergenceAfterARejoinNamesTheLikelyCause) {
  ScratchFolder out("ft-unregistered");
  auto result = run_process(elastic_job(2, 1, 120, out, 10),
                            {{"LOCKSTEP_TEST_KILLS", "1:0:10:forward"},
                             {"LOCKSTEP_TEST_UNREGISTERED_SCHEDULE", "1"},
                             {"LOCKSTEP_TIMEOUT", "20"}},
                            std::chrono::seconds(120));
  EXPECT_FALSE(result.ok()) << result.output;
  EXPECT_EQ(occurrences(result.output, "received the live state"), 1) << result.output;
  EXPECT_NE(result.output.find("the replicas diverged"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("The world re-formed since the last check (a rank failed, or one "
                               "rejoined"),
            std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("must be registered"), std::string::npos) << result.output;
}

struct Footprint {
  int files = 0;
  int threads = 0;
  int mappings = 0;
  int64_t rss_kib = 0;
  int64_t store_keys = 0;
  int64_t store_bytes = 0;
};

int count_entries(const std::string& folder) {
  int count = 0;
  std::error_code ignored;
  for (auto it = std::filesystem::directory_iterator(folder, ignored);
       it != std::filesystem::directory_iterator(); ++it) {
    ++count;
  }
  return count;
}

// What process `pid` holds, and what the job's store (served by the
// launcher in `folder`) holds.
Footprint footprint(int pid, const std::string& socket) {
  Footprint seen;
  std::string proc = "/proc/" + std::to_string(pid);
  seen.files = count_entries(proc + "/fd");
  seen.threads = count_entries(proc + "/task");
  std::ifstream maps(proc + "/maps");
  for (std::string line; std::getline(maps, line);) {
    ++seen.mappings;
  }
  std::ifstream status(proc + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) {
      seen.rss_kib = std::stoll(line.substr(6));
    }
  }
  auto stats = store::StoreClient(store::Endpoint::unix_socket(socket), std::chrono::seconds(5))
                   .stats();
  seen.store_keys = stats.keys;
  seen.store_bytes = stats.key_bytes;
  return seen;
}

// The least of a few looks, 200 ms apart: a world given up is released on
// a thread of its own, which may be at work at any one look.
Footprint settled(int pid, const std::string& socket) {
  Footprint least = footprint(pid, socket);
  for (int look = 0; look < 4; ++look) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    auto now = footprint(pid, socket);
    least.files = std::min(least.files, now.files);
    least.threads = std::min(least.threads, now.threads);
    least.mappings = std::min(least.mappings, now.mappings);
    least.rss_kib = std::min(least.rss_kib, now.rss_kib);
    least.store_keys = std::min(least.store_keys, now.store_keys);
    least.store_bytes = std::min(least.store_bytes, now.store_bytes);
  }
  return least;
}

// A process that reaches the store without the job secret is refused
// every operation but a ping: it can post no note and write no key. Notes
// are not signed: one that holds a proven connection (a bug, a stale
// tool) posts "ft abandon 0" (epoch 0, the one training), with a reason
// written without the secret's proof. Every rank ignores both (and says
// so) and trains on: no step is dropped, and the run equals one process.
TEST(FaultTolerance, AForgedNoteOrReasonToGiveAWorldUpIsIgnored) {
  ScratchFolder out("ft-forged-note");
  int port = free_port();
  std::string error;
  auto socket = store::socket_path(store::job_folder(store::private_base(error), port));
  auto argv = std::vector<std::string>{lockstep::testing::lockstep_run_binary(), "--nproc-per-node",
                                       "3", "--master-port", std::to_string(port), "--",
                                       lockstep::testing::elastic_float64_binary(), "200",
                                       out.path(), "10"};
  Process job(argv, {{"LOCKSTEP_JOB_SECRET", "forged-notes"}});
  auto deadline = Clock::now() + std::chrono::seconds(120);
  wait_for_lines(out / "rank-0.log", 30, deadline);
  store::StoreClient stranger(store::Endpoint::unix_socket(socket), std::chrono::seconds(5));
  EXPECT_THROW(stranger.note("ft abandon 0"), store::UnprovenError);
  EXPECT_THROW(stranger.get_prefix(""), store::UnprovenError);
  EXPECT_THROW(stranger.report(1, 0, "forged"), store::UnprovenError);
  auto proven = store::Endpoint::unix_socket(socket);
  proven.secret = "forged-notes";
  store::StoreClient forger(proven, std::chrono::seconds(5));
  forger.note("ft abandon 0");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // The job's keys are under its prefix: forge the reason wherever one
  // would be, then tell everyone.
  for (const auto& [key, value] : forger.get_prefix("")) {
    auto at = key.find("/ft/epoch");
    if (at != std::string::npos && at + 9 == key.size()) {
      forger.set(key.substr(0, at) + "/ft/e0/abandoned", "forged\nproof 00");
    }
  }
  forger.note("ft abandon 0");
  auto result = job.wait_until(deadline);
  ASSERT_TRUE(result.ok()) << result.status() << "\n" << result.output;
  EXPECT_EQ(occurrences(result.output, "is dropped on every rank"), 0) << result.output;
  EXPECT_EQ(occurrences(result.output, "200 steps, 0 dropped"), 3) << result.output;
  EXPECT_GE(occurrences(result.output, "without a valid proof of the job secret"), 1)
      << result.output;
  expect_committed_steps_match(out, 3, elastic_reference(200));
}

// The short soak (bench/run-soak runs the long one): rank 2 is killed
// twelve times while rank 0 trains on; what rank 0 holds and what the store
// holds after the twelfth failure are what they were after the second, give
// or take what one world being let go of holds for a moment (its segment's
// mappings and its group's sockets are released on a thread of their own).
// A leak of one file, thread or mapping per failure would show ten of them.
TEST(FaultTolerance, ResourcesAndTheStoreStayFlatOverFailures) {
  ScratchFolder out("ft-flat");
  int port = free_port();
  std::string error;
  auto socket = store::socket_path(store::job_folder(store::private_base(error), port));
  constexpr int kKills = 12;
  auto argv = std::vector<std::string>{lockstep::testing::lockstep_run_binary(), "--nproc-per-node", "3",
                                       "--master-port", std::to_string(port), "--restart",
                                       "rank", "--max-restarts", std::to_string(kKills + 2),
                                       "--", lockstep::testing::elastic_float64_binary(), "1000", out.path(), "10"};
  std::string kills;
  for (int kill = 0; kill < kKills; ++kill) {
    kills += (kill ? "," : "") + std::string("2:") + std::to_string(kill) + ":" +
        std::to_string(40 + 60 * kill) + (kill % 2 ? ":backward" : ":forward");
  }
  Process job(argv, {{"LOCKSTEP_TEST_KILLS", kills}, {"LOCKSTEP_TIMEOUT", "20"}});
  auto deadline = Clock::now() + std::chrono::seconds(270);
  wait_for_lines(out / "rank-0.log", 150, deadline); // after the 2nd failure
  int pid = read_pid(out / "pid-0");
  auto first = settled(pid, socket);
  wait_for_lines(out / "rank-0.log", 770, deadline); // after the 12th
  auto last = settled(pid, socket);
  auto result = job.wait_until(deadline);
  ASSERT_TRUE(result.ok()) << result.status() << "\n" << result.output;
  EXPECT_EQ(occurrences(result.output, "received the live state"), kKills) << result.output;
  std::ostringstream seen;
  seen << "after the 2nd failure: " << first.files << " files, " << first.threads
       << " threads, " << first.mappings << " mappings, " << first.rss_kib << " KiB, store "
       << first.store_keys << " keys / " << first.store_bytes << " B; after the 12th: "
       << last.files << ", " << last.threads << ", " << last.mappings << ", " << last.rss_kib
       << " KiB, " << last.store_keys << " / " << last.store_bytes << " B";
  std::cout << seen.str() << std::endl;
  EXPECT_LE(last.files, first.files + 3) << seen.str();
  EXPECT_LE(last.threads, first.threads + 2) << seen.str();
  EXPECT_LE(last.mappings, first.mappings + 4) << seen.str();
  // The store holds the keys of two epochs back at most, whatever the step.
  EXPECT_LE(last.store_keys, first.store_keys + 8) << seen.str();
  EXPECT_LE(last.store_bytes, first.store_bytes + 2048) << seen.str();
  expect_committed_steps_match(out, 3, elastic_reference(1000));
}

TEST(StepSampler, EachSampleOncePerEpochWhateverTheWorldSize) {
  StepSampler sampler(100, StepSamplerOptions().global_batch_size(12).seed(3));
  ASSERT_EQ(sampler.steps_per_epoch(), 8);
  std::vector<int> seen(100, 0);
  for (int64_t step = 0; step < 8; ++step) {
    int size = 1 + static_cast<int>(step % 4); // the world changes every step
    std::vector<int64_t> batch;
    for (int rank = 0; rank < size; ++rank) {
      auto share = sampler.indices(step, rank, size);
      EXPECT_EQ(static_cast<int64_t>(share.size()), 12 / size);
      batch.insert(batch.end(), share.begin(), share.end());
    }
    EXPECT_EQ(batch, sampler.indices(step, 0, 1)) << "the shares make up the global batch";
    for (auto index : batch) {
      ++seen[static_cast<size_t>(index)];
    }
  }
  EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), 96);
  EXPECT_NE(sampler.indices(8, 0, 1), sampler.indices(0, 0, 1)) << "a new order each epoch";
  EXPECT_EQ(StepSampler(100, StepSamplerOptions().global_batch_size(5)).indices(0, 1, 2).size(), 2u)
      << "shares differ by one at most, the first ranks taking the more";
}

TEST(FaultToleranceErrors, MisuseIsAUsageError) {
  auto world = init(WorldOptions().rank(0).size(1));
  Mlp model;
  DDP<Mlp> ddp(model, world);
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  EXPECT_THROW(FaultTolerance(ddp, optimizer, FaultToleranceOptions().min_world_size(0)),
               ConfigError);
  FaultTolerance ft(ddp, optimizer, FaultToleranceOptions().verbose(false));
  expect_error<UsageError>([&] { ft.commit(); }, {"without begin_step()"});
  ft.begin_step();
  expect_error<UsageError>([&] { ft.begin_step(); }, {"twice without commit()"});
  expect_error<UsageError>([&] { ft.commit(); }, {"no synchronised backward"});
  ft.begin_step();
  model->zero_grad();
  ddp(torch::randn({4, 20})).sum().backward();
  EXPECT_TRUE(ft.commit());
  EXPECT_EQ(ft.step(), 1);
  EXPECT_EQ(ft.world().size(), 1);
  ft.begin_step();
  ddp(torch::randn({4, 20})).sum().backward();
  expect_error<UsageError>([&] { ft.commit(torch::Tensor()); }, {"commit(sums) sums a CPU tensor"});
  expect_error<UsageError>([&] { ft.commit(torch::ones({2}, torch::kBool)); },
                           {"commit(sums) sums real numbers"});
  auto figures = torch::tensor({2.5, 4.0}, torch::kDouble);
  auto sums = ft.commit(figures);
  ASSERT_TRUE(sums.has_value());
  EXPECT_TRUE(torch::equal(*sums, figures));
  EXPECT_FALSE(sums->is_same(figures)) << "the caller's tensor is left as it was";
  EXPECT_EQ(ft.step(), 2);

  Mlp other;
  DDP<Mlp> stepping(other, world);
  torch::optim::SGD other_optimizer(other->parameters(), 0.1);
  stepping.step_in_backward(other_optimizer);
  expect_error<UsageError>([&] { FaultTolerance(stepping, other_optimizer); }, {"steps inside backward"});
  // The other way round, and what cannot survive a failure, in any order.
  Mlp later;
  DDP<Mlp> guarded(later, world);
  torch::optim::SGD later_optimizer(later->parameters(), 0.1);
  FaultTolerance first(guarded, later_optimizer, FaultToleranceOptions().verbose(false));
  expect_error<UsageError>([&] { guarded.step_in_backward(later_optimizer); },
                           {"step_in_backward cannot be used under lockstep::FaultTolerance"});
  ZeroRedundancyOptimizer<torch::optim::SGD> zero(later->parameters(), world,
                                                  torch::optim::SGDOptions(0.1));
  expect_error<UsageError>([&] { FaultTolerance(guarded, zero); },
                           {"cannot take a ZeroRedundancyOptimizer"});
  torch::nn::Sequential normed(torch::nn::Linear(20, 4),
                               SyncBatchNorm(torch::nn::BatchNormOptions(4), world));
  DDP<torch::nn::Sequential> synced(normed, world);
  torch::optim::SGD synced_optimizer(normed->parameters(), 0.1);
  expect_error<UsageError>([&] { FaultTolerance(synced, synced_optimizer); },
                           {"cannot take a model with SyncBatchNorm"});
  expect_error<ConfigError>(
      [&] { FaultTolerance(guarded, later_optimizer, FaultToleranceOptions().step_timeout(std::chrono::milliseconds(0))); },
      {"step_timeout must be positive"});
  expect_error<ConfigError>([&] { StepSampler(10, StepSamplerOptions().global_batch_size(11)); }, {"no larger than the dataset"});
  expect_error<UsageError>([&] { StepSampler(10, StepSamplerOptions().global_batch_size(2)).indices(0, 0, 3); }, {"cannot be shared among 3 ranks"});
}

} // namespace
} // namespace lockstep::testing
