// lockstep-run: environment, output, failure handling, signals, restarts,
// bad command lines.

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "support/process.h"
#include "support/scratch_folder.h"
#include "world/process_identity.h"
#include "support/paths.h"

namespace lockstep::testing {
namespace {

using Clock = std::chrono::steady_clock;

ProcessExit launch(std::vector<std::string> args, const Environment& env = {},
                   std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  args.insert(args.begin(), lockstep::testing::lockstep_run_binary());
  return run_process(args, env, timeout);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(Launcher, GivesEveryRankItsVariablesAndPrefixesItsLines) {
  auto result = launch({"--nproc-per-node", "3", "--", "sh", "-c",
                        "echo rank=$RANK size=$WORLD_SIZE local=$LOCAL_RANK/$LOCAL_WORLD_SIZE "
                        "master=$MASTER_ADDR:$MASTER_PORT attempt=$LOCKSTEP_RESTART_COUNT"});
  ASSERT_TRUE(result.ok()) << result.output;
  for (int rank = 0; rank < 3; ++rank) {
    std::string r = std::to_string(rank);
    EXPECT_TRUE(contains(result.output, "[" + r + "] rank=" + r + " size=3 local=" + r +
                                            "/3 master=127.0.0.1:"))
        << result.output;
  }
  EXPECT_TRUE(contains(result.output, "attempt=0"));
  EXPECT_FALSE(contains(result.output, "master=127.0.0.1:0 ")) << "no port was picked";
}

TEST(Launcher, GivesEachRankOneThreadUnlessTold) {
  auto result = launch({"--nproc-per-node", "2", "--", "sh", "-c", "echo omp=$OMP_NUM_THREADS"},
                       {{"OMP_NUM_THREADS", ""}});
  ASSERT_TRUE(result.ok()) << result.output;
  EXPECT_TRUE(contains(result.output, "[0] omp=1")) << result.output;
  EXPECT_TRUE(contains(result.output, "[1] omp=1")) << result.output;
  EXPECT_TRUE(contains(result.output, "lockstep-run: OMP_NUM_THREADS is not set: each of the 2 "
                                      "ranks on this machine gets OMP_NUM_THREADS=1"))
      << result.output;
  auto told = launch({"--nproc-per-node", "2", "--", "sh", "-c", "echo omp=$OMP_NUM_THREADS"},
                     {{"OMP_NUM_THREADS", "3"}});
  EXPECT_TRUE(contains(told.output, "[1] omp=3")) << told.output;
  EXPECT_FALSE(contains(told.output, "OMP_NUM_THREADS is not set")) << told.output;
}

TEST(Launcher, PrefixesEverySegmentOfAProgressLine) {
  auto result = launch({"--nproc-per-node", "1", "--", "sh", "-c",
                        "printf 'step 1\\rstep 2\\rstep 3\\n'"});
  ASSERT_TRUE(result.ok()) << result.output;
  EXPECT_TRUE(contains(result.output, "[0] step 1\r[0] step 2\r[0] step 3\n")) << result.output;
}

// torchrun's --local-ranks-filter: the lines of the ranks named, and of a
// rank left out only when it fails (its last 20, so that the failure says
// something).
TEST(Launcher, ShowsTheLinesOfTheFilteredRanksAndOfAFailure) {
  auto quiet = launch({"--nproc-per-node", "3", "--ranks-filter", "0,2", "--", "sh", "-c",
                       "echo hello from $RANK"});
  ASSERT_TRUE(quiet.ok()) << quiet.output;
  EXPECT_TRUE(contains(quiet.output, "[0] hello from 0")) << quiet.output;
  EXPECT_TRUE(contains(quiet.output, "[2] hello from 2")) << quiet.output;
  EXPECT_FALSE(contains(quiet.output, "[1] ")) << quiet.output;
  auto failing = launch({"--nproc-per-node", "2", "--ranks-filter", "0", "--", "sh", "-c",
                         "for i in $(seq 1 30); do echo line $i of $RANK; done; "
                         "if [ $RANK = 1 ]; then exit 3; fi; sleep 60"});
  EXPECT_EQ(failing.exit_code, 1);
  EXPECT_TRUE(contains(failing.output, "[1] line 30 of 1\n")) << failing.output;
  EXPECT_TRUE(contains(failing.output, "[1] line 11 of 1\n")) << failing.output;
  EXPECT_FALSE(contains(failing.output, "[1] line 10 of 1\n")) << failing.output;
  EXPECT_LT(failing.output.find("[1] line 30 of 1"),
            failing.output.find("lockstep-run: rank 1 exited with code 3"))
      << failing.output;
}

TEST(Launcher, NamesAnUncaughtException) {
  auto result = launch({"--nproc-per-node", "2", "--", "sh", "-c",
                        "if [ $RANK = 1 ]; then kill -ABRT $$; fi; sleep 5"});
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_TRUE(contains(result.output,
                       "lockstep-run: rank 1 was aborted (signal 6, SIGABRT), most likely by an "
                       "uncaught exception: its message (\"terminate called after throwing "
                       "...\") is in the rank's output above; stopping the other ranks"))
      << result.output;
}

TEST(Launcher, PassesTheJobId) {
  // Replacing the value it inherited.
  auto result = launch({"--nproc-per-node", "2", "--job-id", "nightly-7", "--", "sh", "-c",
                        "echo job=$LOCKSTEP_JOB_ID"},
                       {{"LOCKSTEP_JOB_ID", "inherited"}});
  ASSERT_TRUE(result.ok()) << result.output;
  EXPECT_TRUE(contains(result.output, "[0] job=nightly-7")) << result.output;
  EXPECT_TRUE(contains(result.output, "[1] job=nightly-7")) << result.output;
}

TEST(Launcher, NodeRankShiftsTheGlobalRanks) {
  auto result = launch({"--nproc-per-node", "2", "--nnodes", "3", "--node-rank", "2",
                        "--master-addr", "127.0.0.1", "--master-port", "29999", "--",
                        "sh", "-c", "echo rank=$RANK size=$WORLD_SIZE local=$LOCAL_RANK"});
  ASSERT_TRUE(result.ok()) << result.output;
  EXPECT_TRUE(contains(result.output, "[4] rank=4 size=6 local=0"));
  EXPECT_TRUE(contains(result.output, "[5] rank=5 size=6 local=1"));
}

TEST(Launcher, AFailingRankStopsTheOthersQuickly) {
  auto start = Clock::now();
  auto result = launch({"--nproc-per-node", "3", "--", "sh", "-c",
                        "if [ $RANK = 1 ]; then exit 3; fi; sleep 60"});
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_TRUE(contains(result.output, "lockstep-run: rank 1 exited with code 3; stopping the other ranks"))
      << result.output;
}

TEST(Launcher, AKilledRankIsNamedWithItsSignal) {
  auto result = launch({"--nproc-per-node", "2", "--", "sh", "-c",
                        "if [ $RANK = 0 ]; then kill -9 $$; fi; sleep 60"});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_TRUE(contains(result.output, "rank 0 was killed by signal 9 (Killed)")) << result.output;
}

TEST(Launcher, ARankThatIgnoresSigtermIsKilledAfterTheGrace) {
  auto start = Clock::now();
  auto result = launch({"--nproc-per-node", "2", "--grace", "1", "--", "sh", "-c",
                        "if [ $RANK = 0 ]; then exit 1; fi; trap '' TERM; sleep 60"});
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(result.exit_code, 1);
}

TEST(Launcher, ALauncherKilledWhileItStartsItsRanksLeavesNoneBehind) {
  // A rank dies with its launcher (PR_SET_PDEATHSIG), including one forked
  // just before the launcher died, before the rank could ask for that: it
  // looks at its parent once more after asking. Killed at moments spread
  // over the start of 4 ranks.
  ScratchFolder folder("orphans");
  ASSERT_FALSE(folder.path().empty());
  for (int delay_ms : {0, 1, 2, 3, 5, 8, 12, 20}) {
    SCOPED_TRACE(delay_ms);
    std::string marks = folder / std::to_string(delay_ms);
    ASSERT_EQ(::mkdir(marks.c_str(), 0700), 0);
    Process launcher({lockstep::testing::lockstep_run_binary(), "--nproc-per-node", "4", "--", "sh", "-c",
                      "echo $$ > " + marks + "/pid-$RANK; exec sleep 30"},
                     {});
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    ::kill(launcher.pid(), SIGKILL);
    launcher.wait_until(Clock::now() + std::chrono::seconds(10));
    // A rank that outlived it has written its pid by then.
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    for (int rank = 0; rank < 4; ++rank) {
      int pid = 0;
      std::ifstream(marks + "/pid-" + std::to_string(rank)) >> pid;
      if (pid > 0 && ::kill(pid, 0) == 0 && detail::process_state(pid) != 'Z') {
        ADD_FAILURE() << "rank " << rank << " (pid " << pid << ") outlived its launcher";
        ::kill(pid, SIGKILL);
      }
    }
  }
}

TEST(Launcher, ForwardsSigintToEveryRank) {
  ScratchFolder folder("launcher");
  ASSERT_FALSE(folder.path().empty());
  const std::string& marks = folder.path();
  Process launcher({lockstep::testing::lockstep_run_binary(), "--nproc-per-node", "2", "--", "sh", "-c",
                    "trap 'echo got > " + marks + "/int-$RANK; exit 0' INT; "
                    "touch " + marks + "/ready-$RANK; while true; do sleep 0.1; done"},
                   {});
  auto deadline = Clock::now() + std::chrono::seconds(10);
  while (!(::access((marks + "/ready-0").c_str(), F_OK) == 0 &&
           ::access((marks + "/ready-1").c_str(), F_OK) == 0) &&
         Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(launcher.pid(), SIGINT);
  auto result = launcher.wait_until(Clock::now() + std::chrono::seconds(10));
  EXPECT_EQ(result.exit_code, 128 + SIGINT) << result.output;
  EXPECT_EQ(::access((marks + "/int-0").c_str(), F_OK), 0) << result.output;
  EXPECT_EQ(::access((marks + "/int-1").c_str(), F_OK), 0) << result.output;
  EXPECT_TRUE(contains(result.output, "passing it to every rank"));
}

TEST(Launcher, WritesOneLogPerRank) {
  ScratchFolder folder("launcher");
  ASSERT_FALSE(folder.path().empty());
  std::string logs = folder / "logs";
  auto result = launch({"--nproc-per-node", "2", "--log-dir", logs, "--", "sh", "-c",
                        "echo hello from $RANK"});
  ASSERT_TRUE(result.ok()) << result.output;
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream log(logs + "/rank-" + std::to_string(rank) + ".log");
    std::string line;
    std::getline(log, line);
    EXPECT_EQ(line, "hello from " + std::to_string(rank));
  }
}

TEST(Launcher, RestartsEveryRankAfterAFailure) {
  auto result = launch({"--nproc-per-node", "2", "--max-restarts", "2", "--", "sh", "-c",
                        "if [ $LOCKSTEP_RESTART_COUNT = 0 ] && [ $RANK = 1 ]; then exit 1; fi; "
                        "echo done attempt $LOCKSTEP_RESTART_COUNT"});
  EXPECT_TRUE(result.ok()) << result.output;
  EXPECT_TRUE(contains(result.output, "restarting every rank (restart 1 of 2)"));
  EXPECT_TRUE(contains(result.output, "[0] done attempt 1"));
  EXPECT_TRUE(contains(result.output, "[1] done attempt 1"));
}

TEST(Launcher, GivesUpAfterItsRestarts) {
  auto result = launch({"--nproc-per-node", "1", "--max-restarts", "1", "--", "false"});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_TRUE(contains(result.output, "the job failed after 1 restart(s)")) << result.output;
}

// With --restart rank, a rank that crashes once another has finished is
// not restarted (the job is ending), but the job fails: it said 0 before.
TEST(Launcher, UnderRestartRankACrashAfterTheLoopFailsTheJob) {
  auto result = launch({"--nproc-per-node", "2", "--restart", "rank", "--max-restarts", "2",
                        "--", "sh", "-c",
                        "if [ $RANK = 1 ]; then sleep 0.5; kill -SEGV $$; fi"});
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_TRUE(contains(result.output, "rank 1 was killed by signal 11")) << result.output;
  EXPECT_TRUE(contains(result.output, "the others finish, and the job fails")) << result.output;
  EXPECT_FALSE(contains(result.output, "restarting it alone")) << result.output;
}

// The launcher hosts the job's store (on node 0), and hands its ranks the
// endpoint: on one host a Unix socket in the job's private folder, removed
// when the job ends.
TEST(Launcher, HostsTheJobsStoreAndRemovesItsFolder) {
  ScratchFolder tmp("launcher-store");
  auto result = launch({"--nproc-per-node", "2", "--", "sh", "-c",
                        "echo endpoint=$LOCKSTEP_STORE_ENDPOINT; test -S ${LOCKSTEP_STORE_ENDPOINT#unix:}"},
                       {{"TMPDIR", tmp.path()}});
  ASSERT_TRUE(result.ok()) << result.output;
  EXPECT_TRUE(contains(result.output, "[0] endpoint=unix:" + tmp.path() + "/lockstep-"))
      << result.output;
  auto across = launch({"--nproc-per-node", "1", "--", "sh", "-c",
                        "echo endpoint=$LOCKSTEP_STORE_ENDPOINT"},
                       {{"LOCKSTEP_STORE", "tcp"}});
  EXPECT_TRUE(contains(across.output, "[0] endpoint=tcp:127.0.0.1:")) << across.output;
  std::error_code ignored;
  int left = 0;
  for (auto it = std::filesystem::recursive_directory_iterator(tmp.path(), ignored);
       it != std::filesystem::recursive_directory_iterator(); ++it) {
    left += it->is_regular_file() || it->is_socket();
  }
  EXPECT_EQ(left, 0) << "the job's folder stayed behind";
}

TEST(Launcher, BadCommandLinesExitWithUsage) {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--bogus", "--", "true"},
           {"--nproc-per-node", "0", "--", "true"},
           {"--nproc-per-node", "two", "--", "true"},
           {"--nnodes", "2", "--", "true"},
           {"--nnodes", "2", "--node-rank", "2", "--master-addr", "a", "--master-port", "1", "--", "true"},
           {"--nproc-per-node", "2"},
           {"--ranks-filter", "0,x", "--", "true"},
           {"--nproc-per-node", "2", "--ranks-filter", "2", "--", "true"},
           {"--store-successors", "b:29500", "--", "true"},
           {"--nnodes", "2", "--master-addr", "a", "--master-port", "1", "--store-successors",
            "b", "--", "true"},
           {"--nnodes", "2", "--master-addr", "a", "--master-port", "1", "--store-successors",
            "b:1,c:2", "--", "true"}}) {
    auto result = launch(args);
    EXPECT_EQ(result.exit_code, 2) << args.front();
    EXPECT_TRUE(contains(result.output, "usage: lockstep-run")) << result.output;
  }
  auto help = launch({"--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_TRUE(contains(help.output, "--max-restarts R"));
}

TEST(Launcher, RunsTheHelloJob) {
  auto result = launch({"--nproc-per-node", "2", "--", lockstep::testing::hello_binary()});
  ASSERT_TRUE(result.ok()) << result.output;
  EXPECT_TRUE(contains(result.output, "[1] [rank 1] contributed 2, all_reduce(sum) gave 3"));
}

} // namespace
} // namespace lockstep::testing
