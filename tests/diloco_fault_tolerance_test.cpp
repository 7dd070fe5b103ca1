// Streaming DiLoCo under lockstep::FaultTolerance: a replica killed
// (SIGKILL) between synchronisations or with a fragment's in flight, or
// stopped (SIGSTOP) past the heartbeat timeout and continued, under
// lockstep-run --restart rank. The run must equal, in float64, a reference
// of three simulated replicas that loses exactly one synchronisation (the
// one in flight, else the next), leaves the dead replica out until it
// rejoins, and then gives it the state of the replica that sent it: its
// parameters, the global ones, the inner and outer optimizers' states and
// the local step.

#include <signal.h>

#include <fstream>
#include <regex>
#include <thread>
#include <set>
#include <sstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "support/diloco_setup.h"
#include "support/job_output.h"
#include "support/process.h"
#include "support/scratch_folder.h"
#include "support/paths.h"

namespace lockstep::testing {
namespace {

constexpr int kReplicas = 3;
constexpr int kKilled = 2;
constexpr int64_t kInterval = 4; // H = 8 over 2 fragments
constexpr double kAlpha = 0.5;

/// What the job reported.
struct Events {
  int64_t kill_after = 0;      // inner steps the killed replica took
  std::set<int64_t> lost;      // local steps whose synchronisation was lost
  int64_t joined_at = -1;      // the local step its restart joined at
  int source = -1;             // the replica that sent it the live state
};

void copy_state(torch::optim::SGD& from, torch::optim::SGD& to) {
  std::stringstream bytes;
  torch::save(from, bytes);
  torch::load(to, bytes);
}

/// Each replica's parameters after `steps` inner steps of diloco_float64's
/// schedule, given what the job reported.
std::vector<torch::Tensor> reference(const Events& events, int64_t steps) {
  std::vector<Mlp> models;
  std::vector<std::unique_ptr<torch::optim::SGD>> inners;
  for (int r = 0; r < kReplicas; ++r) {
    models.push_back(float64_mlp()); // rank 0's parameters, which DiLoCo broadcasts
    inners.push_back(
        std::make_unique<torch::optim::SGD>(models.back()->parameters(), inner_options()));
  }
  Mlp global = float64_mlp();
  auto global_fragments = fragments_of(global, 2);
  std::vector<std::unique_ptr<torch::optim::SGD>> outers;
  for (const auto& fragment : global_fragments) {
    outers.push_back(std::make_unique<torch::optim::SGD>(fragment, outer_options()));
  }
  // Whether replica r holds a model at inner step t, and whether it trains
  // it: a replica that joins takes the live state instead of a step.
  auto alive = [&](int r, int64_t t) {
    return r != kKilled || t <= events.kill_after ||
        (events.joined_at > 0 && t >= events.joined_at);
  };
  auto trains = [&](int r, int64_t t) {
    return alive(r, t) && !(r == kKilled && t == events.joined_at);
  };
  int64_t syncs = 0;
  std::vector<torch::Tensor> in_flight;
  double participants = 0;
  for (int64_t t = 1; t <= steps; ++t) {
    for (int r = 0; r < kReplicas; ++r) {
      if (trains(r, t)) {
        auto [x, y] = replica_batch(t - 1, kReplicas, r);
        inners[r]->zero_grad();
        torch::mse_loss(models[r](x), y).backward();
        inners[r]->step();
      }
    }
    torch::NoGradGuard no_grad;
    size_t k = static_cast<size_t>(syncs % 2);
    if ((t + 1) % kInterval == 0) {
      if (t == events.joined_at) {
        auto from = models[events.source]->parameters();
        auto to = models[kKilled]->parameters();
        for (size_t i = 0; i < from.size(); ++i) {
          to[i].copy_(from[i]);
        }
        copy_state(*inners[events.source], *inners[kKilled]);
      }
      in_flight.clear();
      participants = 0;
      for (const auto& g : global_fragments[k]) {
        in_flight.push_back(torch::zeros_like(g));
      }
      for (int r = 0; r < kReplicas; ++r) {
        if (!trains(r, t)) {
          continue; // dead, or it has just received the live state: it sends zeros
        }
        participants += 1;
        auto local = fragments_of(models[r], 2)[k];
        for (size_t i = 0; i < local.size(); ++i) {
          in_flight[i] += global_fragments[k][i] - local[i];
        }
      }
    }
    if (t % kInterval == 0) {
      bool counts = events.lost.count(t) == 0;
      if (counts) {
        for (size_t i = 0; i < global_fragments[k].size(); ++i) {
          global_fragments[k][i].mutable_grad() = in_flight[i] / participants;
        }
        outers[k]->step();
        ++syncs;
      }
      for (int r = 0; r < kReplicas; ++r) {
        if (!alive(r, t)) {
          continue;
        }
        // Back to the global parameters; the local ones merged in only
        // where the synchronisation counted (torchft's perform_sync).
        auto local = fragments_of(models[r], 2)[k];
        for (size_t i = 0; i < local.size(); ++i) {
          auto kept = local[i].clone();
          local[i].copy_(global_fragments[k][i]);
          if (counts) {
            local[i].lerp_(kept, kAlpha);
          }
        }
      }
    }
  }
  std::vector<torch::Tensor> result;
  for (auto& model : models) {
    result.push_back(flatten(model->parameters()));
  }
  return result;
}

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream file(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(file, line);) {
    lines.push_back(line);
  }
  return lines;
}

torch::Tensor parameters_of(const ScratchFolder& out, int replica, int64_t numel) {
  std::ifstream file(out / ("parameters-" + std::to_string(replica) + ".bin"), std::ios::binary);
  std::vector<double> values(static_cast<size_t>(numel));
  file.read(reinterpret_cast<char*>(values.data()),
            static_cast<std::streamsize>(values.size() * sizeof(double)));
  EXPECT_TRUE(file) << "replica " << replica << " wrote no final parameters";
  return torch::tensor(values, torch::kDouble);
}

struct KillPlan {
  /// LOCKSTEP_TEST_KILLS of diloco_float64: rank 2, incarnation 0.
  int64_t step;
  std::string phase;
};

class DiLoCoFaultTolerance : public ::testing::TestWithParam<KillPlan> {};

TEST_P(DiLoCoFaultTolerance, AFailedReplicaCostsOneSyncAndRejoinsWithTheLiveState) {
  const auto plan = GetParam();
  ScratchFolder out("diloco-kills");
  constexpr int64_t kSteps = 160;
  std::vector<std::string> argv{lockstep::testing::lockstep_run_binary(), "--nproc-per-node",
                                std::to_string(kReplicas), "--restart", "rank",
                                "--max-restarts", "1", "--", lockstep::testing::diloco_float64_binary(),
                                std::to_string(kSteps), out.path(), "10"};
  auto kills = "2:0:" + std::to_string(plan.step) + ":" + plan.phase;
  Process job(argv, {{"LOCKSTEP_TEST_KILLS", kills}, {"LOCKSTEP_TIMEOUT", "20"},
                     {"LOCKSTEP_JOB_SECRET", "diloco-kills"}});
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  bool stopped = plan.phase == "stop";
  if (stopped) {
    // Continued once a survivor has said why it dropped the stopped replica
    // (after the heartbeat timeout, 1 s) and the survivors have committed a
    // synchronisation without it: it is then behind, and rejoins as a
    // restarted one does. (Continued before, it would rejoin as an equal,
    // with its own parameters: also right, but another reference.)
    auto committed_without_it = [&] {
      for (const auto& line : lines_of(out / "rank-0.log")) {
        int64_t syncs = 0, local_step = 0, size = 0;
        if (std::sscanf(line.c_str(), "sync %ld %ld %ld", &syncs, &local_step, &size) == 3 &&
            size == kReplicas - 1) {
          return true;
        }
      }
      return false;
    };
    while ((job.output().find("sent no heartbeat for ") == std::string::npos ||
            !committed_without_it()) &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    std::ifstream pid_file(out / "pid-2");
    int pid = 0;
    pid_file >> pid;
    ASSERT_GT(pid, 0);
    ASSERT_EQ(::kill(pid, SIGCONT), 0);
  }
  auto result = job.wait_until(deadline);
  ASSERT_TRUE(result.ok()) << result.status() << "\n" << result.output;
  EXPECT_EQ(occurrences(result.output, "killed by signal 9"), stopped ? 0 : 1) << result.output;
  EXPECT_EQ(occurrences(result.output, "received the live state"), 1) << result.output;

  Events events;
  events.kill_after = plan.step;
  std::smatch match;
  ASSERT_TRUE(std::regex_search(result.output, match,
                                std::regex("received the live state of rank ([0-9]+)")))
      << result.output;
  events.source = std::stoi(match[1]);
  EXPECT_NE(events.source, kKilled);
  // The survivors agree on what was lost: at most the synchronisation in
  // flight when the replica died.
  std::set<int64_t> lost_by[kReplicas];
  for (int r = 0; r < kReplicas; ++r) {
    for (const auto& line : lines_of(out / ("rank-" + std::to_string(r) + ".log"))) {
      if (line.rfind("lost ", 0) == 0) {
        lost_by[r].insert(std::stoll(line.substr(5)));
      }
      if (r == kKilled && line.rfind("joined ", 0) == 0) {
        events.joined_at = std::stoll(line.substr(7));
      }
    }
  }
  EXPECT_EQ(lost_by[0], lost_by[1]);
  events.lost = lost_by[0];
  int64_t next_apply = (plan.step / kInterval + 1) * kInterval;
  // One synchronisation is lost: the one in flight, or else the next one,
  // which the survivors begin in the world of the dead replica (a failure
  // that one of them has seen and another not yet must not move them to
  // a new world at different steps).
  EXPECT_EQ(events.lost, std::set<int64_t>{next_apply});
  ASSERT_GT(events.joined_at, events.kill_after) << "the restarted replica never joined";
  EXPECT_EQ((events.joined_at + 1) % kInterval, 0) << "it joins where a fragment is sent";
  // The restarted replica's own losses are those after it joined.
  for (auto step : lost_by[kKilled]) {
    EXPECT_TRUE(events.lost.count(step)) << step;
  }
  auto expected = reference(events, kSteps);
  for (int r = 0; r < kReplicas; ++r) {
    auto actual = parameters_of(out, r, expected[r].numel());
    EXPECT_TRUE(torch::allclose(actual, expected[r], 0, kFloat64Tolerance))
        << "replica " << r << ": largest difference "
        << (actual - expected[r]).abs().max().item<double>() << "; lost " << events.lost.size()
        << ", joined at " << events.joined_at << " from replica " << events.source;
    auto syncs = kSteps / kInterval - static_cast<int64_t>(events.lost.size());
    EXPECT_EQ(occurrences(result.output, "rank " + std::to_string(r) + ": " +
                                             std::to_string(kSteps) + " steps, " +
                                             std::to_string(syncs) + " syncs"),
              1)
        << result.output;
  }
}

INSTANTIATE_TEST_SUITE_P(Plans, DiLoCoFaultTolerance,
                         ::testing::Values(KillPlan{5, "inner"}, KillPlan{11, "in-flight"},
                                           KillPlan{5, "stop"}),
                         [](const ::testing::TestParamInfo<KillPlan>& info) {
                           const auto& phase = info.param.phase;
                           return std::string(phase == "inner"       ? "KilledBetweenSyncs"
                                              : phase == "in-flight" ? "KilledWithASyncInFlight"
                                                                     : "StoppedPastTheHeartbeat");
                         });

} // namespace
} // namespace lockstep::testing
