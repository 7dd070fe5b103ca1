// The chaos test of lockstep::FaultTolerance: mnist_elastic on 3 ranks for
// 1000 steps (enough for ten kills, each after every rank trains again)
// under lockstep-run --restart rank, while a driver kills
// (SIGKILL) a random rank 10 times at chosen moments (in forward, in the
// middle of a bucket's reduction, during optimizer.step(), during a
// checkpoint save, during a recovery), or stops ranks (SIGSTOP, then
// SIGCONT after the heartbeat timeout). The job must finish with the
// replicas bit-identical (mnist_elastic checks them) and >= 97% accuracy,
// and its log must show each failure and each rejoin. mnist_elastic never
// reads a checkpoint: what a restarted rank holds came from a live peer.

#include <signal.h>
#include <unistd.h>

#include <fstream>
#include <random>
#include <regex>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "support/job_output.h"
#include "support/process.h"
#include "support/scratch_folder.h"
#include "support/paths.h"

namespace lockstep::testing {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kRanks = 3;

struct RankPhase {
  std::string phase;
  int pid = 0;
  long long step = 0;
};

RankPhase read_phase(const std::string& dir, int rank) {
  RankPhase now;
  std::ifstream(dir + "/rank-" + std::to_string(rank)) >> now.phase >> now.pid >> now.step;
  return now;
}

// Running, and not a zombie that its launcher has yet to reap.
bool alive(int pid) {
  if (pid <= 0 || ::kill(pid, 0) != 0) {
    return false;
  }
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  auto state = line.find(") ");
  return state != std::string::npos && line[state + 2] != 'Z';
}

bool have_mnist() {
  return ::access((mnist_dir() + "/train-images-idx3-ubyte").c_str(), R_OK) == 0;
}

class Chaos {
 public:
  Chaos(const ScratchFolder& folder, unsigned seed) : phases_(folder / "phases"), random_(seed) {}

  // Waits until every rank trains (a restarted one has rejoined and
  // stepped): the state lives on every rank again.
  bool all_training(Clock::time_point deadline) {
    while (Clock::now() < deadline) {
      int training = 0;
      for (int rank = 0; rank < kRanks; ++rank) {
        // A killed rank's file shows its last phase until its restart has
        // started and written its own: only a live process counts.
        auto now = read_phase(phases_, rank);
        training += (now.phase == "forward" || now.phase == "backward" || now.phase == "step" ||
                     now.phase == "commit") &&
                    now.step > 0 && alive(now.pid);
      }
      if (training == kRanks) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }

  // Sends `signo` to a rank found in `phase` (any rank with -1) within
  // `patience`; else to a random rank in whatever it does. Returns what it
  // hit, as "rank R in PHASE at step S".
  std::string strike(int signo, const std::string& phase, int only_rank,
                     std::chrono::milliseconds patience) {
    auto until = Clock::now() + patience;
    int first = static_cast<int>(random_() % kRanks);
    while (Clock::now() < until) {
      for (int k = 0; k < kRanks; ++k) {
        int rank = (first + k) % kRanks;
        if (only_rank >= 0 && rank != only_rank) {
          continue;
        }
        auto now = read_phase(phases_, rank);
        if (now.phase == phase && alive(now.pid) && ::kill(now.pid, signo) == 0) {
          return describe(rank, now, signo);
        }
      }
    }
    int rank = only_rank >= 0 ? only_rank : first;
    auto now = read_phase(phases_, rank);
    ::kill(now.pid, signo);
    return describe(rank, now, signo) + " (no rank was " + phase + " within " +
        std::to_string(patience.count()) + " ms)";
  }

  std::string phases_;
  std::mt19937 random_;

 private:
  static std::string describe(int rank, const RankPhase& now, int signo) {
    return std::string(signo == SIGKILL ? "killed" : "stopped") + " rank " +
        std::to_string(rank) + " (pid " + std::to_string(now.pid) + ") in " + now.phase +
        " at step " + std::to_string(now.step);
  }
};

std::vector<std::string> elastic_job(const ScratchFolder& folder, int restarts, int steps) {
  return {lockstep::testing::lockstep_run_binary(), "--nproc-per-node", std::to_string(kRanks), "--restart", "rank",
          "--max-restarts", std::to_string(restarts), "--", lockstep::testing::mnist_elastic_binary(), "--data",
          mnist_dir(), "--steps", std::to_string(steps), "--phase-dir", folder / "phases", "--checkpoint",
          folder / "checkpoint.pt", "--checkpoint-every", "10", "--heartbeat-ms", "1000",
          "--log-every", "100"};
}

void expect_finished_well(const ProcessExit& result, int steps) {
  ASSERT_TRUE(result.ok()) << result.status() << "\n" << result.output;
  EXPECT_EQ(occurrences(result.output, std::to_string(steps) + " committed steps"), kRanks)
      << result.output;
  EXPECT_EQ(occurrences(result.output, "replicas identical"), kRanks) << result.output;
  std::smatch accuracy;
  ASSERT_TRUE(std::regex_search(result.output, accuracy, std::regex("test accuracy ([0-9.]+)%")))
      << result.output;
  EXPECT_GE(std::stod(accuracy[1]), 97.0) << result.output;
}

TEST(Chaos, TenKillsAtChosenMomentsCostOneStepEachAndTheJobFinishes) {
  if (!have_mnist()) {
    GTEST_SKIP() << "no MNIST at " << mnist_dir() << " (scripts/setup fetches it)";
  }
  ScratchFolder folder("chaos");
  unsigned seed = static_cast<unsigned>(std::random_device{}());
  Chaos chaos(folder, seed);
  Process job(elastic_job(folder, 12, 1000), {{"LOCKSTEP_TIMEOUT", "20"}});
  auto deadline = Clock::now() + std::chrono::seconds(280);
  // Ten kills: a recovery takes two.
  const std::vector<std::string> moments{"forward", "backward", "step", "checkpoint",
                                         "recovery", "forward", "backward", "step",
                                         "checkpoint"};
  std::vector<std::string> struck;
  for (const auto& moment : moments) {
    ASSERT_TRUE(chaos.all_training(deadline)) << "seed " << seed << "\n" << job.output();
    std::this_thread::sleep_for(std::chrono::milliseconds(200 + chaos.random_() % 800));
    if (moment == "recovery") {
      // A rank dies, and while its restart joins the others (begin, until it
      // has the state), one of the ranks in that recovery dies too.
      struck.push_back(chaos.strike(SIGKILL, "forward", -1, std::chrono::seconds(2)));
      struck.push_back(chaos.strike(SIGKILL, "begin", -1, std::chrono::seconds(10)) +
                       " (during the recovery)");
    } else {
      struck.push_back(chaos.strike(SIGKILL, moment, -1, std::chrono::seconds(5)));
    }
  }
  auto result = job.wait_until(deadline);
  std::string story = "seed " + std::to_string(seed) + ":";
  for (const auto& line : struck) {
    story += "\n  " + line;
  }
  std::cout << story << std::endl;
  expect_finished_well(result, 1000);
  // Checkpoints were written beside (mnist_elastic has no way to read one).
  EXPECT_EQ(::access((folder / "checkpoint.pt").c_str(), R_OK), 0);
  EXPECT_EQ(occurrences(result.output, "killed by signal 9"), 10) << story << "\n" << result.output;
  EXPECT_EQ(occurrences(result.output, "restarting it alone"), 10) << story << "\n" << result.output;
  // Each failure is named by the survivors, and every rank that rejoined
  // says so (a restart killed during its recovery never got there).
  EXPECT_GE(occurrences(result.output, "is dropped on every rank") +
                occurrences(result.output, "did not form"),
            1)
      << result.output;
  EXPECT_GE(occurrences(result.output, "received the live state"), 8) << story << "\n"
                                                                 << result.output;
}

TEST(Chaos, StoppedRanksAreDroppedThenRejoin) {
  if (!have_mnist()) {
    GTEST_SKIP() << "no MNIST at " << mnist_dir() << " (scripts/setup fetches it)";
  }
  ScratchFolder folder("chaos-stop");
  unsigned seed = static_cast<unsigned>(std::random_device{}());
  Chaos chaos(folder, seed);
  Process job(elastic_job(folder, 0, 400), {{"LOCKSTEP_TIMEOUT", "20"}});
  auto deadline = Clock::now() + std::chrono::seconds(240);
  std::vector<std::string> struck;
  for (const char* moment : {"backward", "forward", "step"}) {
    ASSERT_TRUE(chaos.all_training(deadline)) << "seed " << seed << "\n" << job.output();
    std::this_thread::sleep_for(std::chrono::milliseconds(200 + chaos.random_() % 800));
    auto line = chaos.strike(SIGSTOP, moment, -1, std::chrono::seconds(5));
    struck.push_back(line);
    int pid = std::stoi(line.substr(line.find("(pid ") + 5));
    // Past the heartbeat timeout (1 s): the others drop it and go on.
    std::this_thread::sleep_for(std::chrono::milliseconds(1600));
    ::kill(pid, SIGCONT);
  }
  auto result = job.wait_until(deadline);
  for (const auto& line : struck) {
    std::cout << "  " << line << std::endl;
  }
  expect_finished_well(result, 400);
  EXPECT_EQ(occurrences(result.output, "restarting it alone"), 0) << result.output;
  EXPECT_GE(occurrences(result.output, "sent no heartbeat for"), 3) << result.output;
  EXPECT_GE(occurrences(result.output, "received the live state"), 3) << result.output;
}

} // namespace
} // namespace lockstep::testing
