// A float64 MLP trained under lockstep::FaultTolerance, for the test that
// compares a run with failures, step by step, with a reference that applies
// exactly the committed steps (tests/fault_tolerance_test.cpp):
//   elastic_float64 STEPS OUT_DIR [PAUSE_MS [MIN_WORLD_SIZE [TIMEOUT_MS]]]
// (PAUSE_MS after each step, ten times that while a rank is missing: a
// restarted rank takes a second or more to start, and a plan of kills waits
// for it to have rejoined.)
// Each committed step appends "<step> <world size> <sum of parameters>
// <squared error over the step's batch> <its samples>" to OUT_DIR/rank-R.log
// (the last two summed over the step's world by ft.commit(sums)) (R: the launcher rank); at the end the world's rank 0
// writes OUT_DIR/parameters.bin; each process writes its pid to
// OUT_DIR/pid-R as it starts. LOCKSTEP_TEST_KILLS="R:I:STEP:PHASE,..."
// makes incarnation I of rank R kill itself (SIGKILL) at the first step from
// STEP on that the whole world trains (so that the rank killed before has
// rejoined and holds the state), in PHASE:
// begin (before begin_step), forward, backward (inside it, once the first
// bucket has left), commit (before commit) or step (after commit, before
// optimizer.step); or, in forward, hang (its training thread sleeps for
// ever; its heartbeat goes on) or throw (an exception that main catches,
// exiting with 1 as C++ programs do); or, whether or not the world is whole,
// send (while it sends the live state to a rank that rejoins, after the
// model's and the optimizer's) or rejoin (while it receives it).
// The loss is scaled by a lockstep::amp::GradScaler, registered too.
// The learning rate follows a StepLR (halved every 50 steps) whose step
// count is registered with FaultTolerance::register_state, so that a rank
// that rejoins continues the schedule (unless
// LOCKSTEP_TEST_UNREGISTERED_SCHEDULE=1). LOCKSTEP_TEST_STEP_TIMEOUT_MS sets
// FaultToleranceOptions::step_timeout; LOCKSTEP_TEST_STATE_PIECE_BYTES its
// state_piece_bytes. At the end each rank prints the bytes of live state
// it sent and received.

#include <algorithm>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "store/client.h"
#include "support/kill_plan.h"
#include "support/models.h"
#include "world/epoch_world.h"

using lockstep::testing::Kill;
using lockstep::testing::planned_kills;

int train(int argc, char** argv) {
  int64_t steps = argc > 1 ? std::atoll(argv[1]) : 20;
  std::string out = argc > 2 ? argv[2] : ".";
  int pause_ms = argc > 3 ? std::atoi(argv[3]) : 0;
  int min_world_size = argc > 4 ? std::atoi(argv[4]) : 1;
  auto timeout = std::chrono::milliseconds(argc > 5 ? std::atoll(argv[5]) : 300000);
  int replica = std::atoi(std::getenv("RANK") ? std::getenv("RANK") : "0");
  int incarnation =
      std::atoi(std::getenv("LOCKSTEP_INCARNATION") ? std::getenv("LOCKSTEP_INCARNATION") : "0");
  auto kills = planned_kills();
  int64_t now_step = 0;
  bool whole = false;
  auto maybe_die = [&](const char* phase) {
    for (const auto& kill : kills) {
      // Inside a rejoin the world is not whole yet.
      bool in_rejoin = kill.phase == "send" || kill.phase == "rejoin";
      bool due = kill.replica == replica && kill.incarnation == incarnation &&
          (whole || in_rejoin) && now_step >= kill.step;
      if (due && kill.phase == phase) {
        std::raise(SIGKILL);
      }
      if (due && std::string(phase) == "forward" && kill.phase == "hang") {
        while (true) {
          std::this_thread::sleep_for(std::chrono::hours(1));
        }
      }
      if (due && std::string(phase) == "forward" && kill.phase == "throw") {
        throw std::runtime_error("elastic_float64: a planned error in forward");
      }
    }
  };

  torch::set_num_threads(1);
  std::ofstream(out + "/pid-" + std::to_string(replica)) << ::getpid() << "\n";
  auto world = lockstep::init();
  int world_size = std::atoi(std::getenv("WORLD_SIZE") ? std::getenv("WORLD_SIZE") : "1");
  torch::manual_seed(7);
  lockstep::testing::Mlp model;
  model->to(torch::kDouble);
  // A bucket per layer, so that a rank dies with buckets in flight.
  lockstep::DDP<lockstep::testing::Mlp> ddp(
      model, world, lockstep::DdpOptions().bucket_cap_mb(0.001).first_bucket_cap_mb(0.001));
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const char* step_timeout = std::getenv("LOCKSTEP_TEST_STEP_TIMEOUT_MS");
  const char* piece_bytes = std::getenv("LOCKSTEP_TEST_STATE_PIECE_BYTES");
  lockstep::FaultTolerance ft(
      ddp, optimizer,
      lockstep::FaultToleranceOptions()
          .heartbeat_timeout(std::chrono::milliseconds(1000))
          .step_timeout(std::chrono::milliseconds(step_timeout ? std::atoll(step_timeout)
                                                               : 300000))
          .min_world_size(min_world_size)
          .timeout(timeout)
          .state_piece_bytes(piece_bytes ? std::strtoull(piece_bytes, nullptr, 10)
                                         : size_t{64} << 20));
  // The schedule moves with the model to a rank that rejoins: its step
  // count is saved, and replayed on a fresh StepLR where it is loaded.
  auto scheduler = std::make_unique<torch::optim::StepLR>(optimizer, 50, 0.5);
  int64_t scheduled = 0;
  // LOCKSTEP_TEST_UNREGISTERED_SCHEDULE=1: the mistake of a program that
  // keeps its schedule to itself; a rank that rejoins then starts it anew.
  const char* unregistered = std::getenv("LOCKSTEP_TEST_UNREGISTERED_SCHEDULE");
  if (unregistered == nullptr || std::string(unregistered) != "1") ft.register_state(
      "scheduler",
      [&](torch::serialize::OutputArchive& archive) {
        maybe_die("send");
        archive.write("steps", torch::tensor(scheduled));
      },
      [&](torch::serialize::InputArchive& archive) {
        maybe_die("rejoin");
        torch::Tensor steps;
        archive.read("steps", steps);
        // The sender's rate, which the optimizer's loading brought back
        // (LibTorch's own loading keeps the rate the optimizer was built with).
        std::printf("elastic_float64: rank %d received lr %.17g after %lld scheduled steps\n",
                    replica, optimizer.param_groups()[0].options().get_lr(),
                    static_cast<long long>(steps.item<int64_t>()));
        std::fflush(stdout); // this incarnation may be killed before it exits
        // From the initial rate, whatever the optimizer's loading restored.
        for (auto& group : optimizer.param_groups()) {
          static_cast<torch::optim::SGDOptions&>(group.options()).lr(0.1);
        }
        scheduler = std::make_unique<torch::optim::StepLR>(optimizer, 50, 0.5);
        for (scheduled = 0; scheduled < steps.item<int64_t>(); ++scheduled) {
          scheduler->step();
        }
      });
  // Loss scaling, its state registered as PyTorch's docs ask: a rank that
  // rejoins scales as the others do. Powers of two, so that scaling and
  // unscaling leave every float64 gradient exact (the reference does
  // without).
  lockstep::amp::GradScaler scaler(lockstep::amp::GradScalerOptions().growth_interval(20));
  ft.register_state("scaler", scaler);
  model->fc1->weight.register_hook([&](torch::Tensor grad) {
    maybe_die("backward");
    return grad;
  });

  torch::manual_seed(11);
  auto inputs = torch::randn({120, 20}, torch::kDouble);
  auto targets = torch::randn({120, 5}, torch::kDouble);
  lockstep::StepSampler sampler(120, lockstep::StepSamplerOptions().global_batch_size(12));
  std::ofstream log(out + "/rank-" + std::to_string(replica) + ".log", std::ios::app);
  // LOCKSTEP_TEST_COUNT_STORE="FROM:TO": rank 0 says how many key
  // operations the job's store served (its own statistics) between the
  // commits of steps FROM and TO.
  long long count_from = -1, count_to = -1;
  if (const char* count = std::getenv("LOCKSTEP_TEST_COUNT_STORE")) {
    std::sscanf(count, "%lld:%lld", &count_from, &count_to);
  }
  auto store_counter = replica == 0 && count_from >= 0
      ? lockstep::detail::WorldAccess::store_client(world)
      : nullptr;
  int64_t counted_from = 0;
  const char* plain = std::getenv("LOCKSTEP_TEST_PLAIN_COMMIT");
  int plain_commit = plain ? std::atoi(plain) : -1;
  while (ft.step() < steps) {
    now_step = ft.step();
    maybe_die("begin");
    ft.begin_step();
    now_step = ft.step();
    whole = ft.world().size() == world_size;
    auto index = torch::tensor(sampler.indices(ft.step(), ft.world().rank(), ft.world().size()),
                               torch::kLong);
    optimizer.zero_grad();
    maybe_die("forward");
    auto error = ddp(inputs.index_select(0, index)) - targets.index_select(0, index);
    auto loss = error.pow(2).mean();
    scaler.scale(loss).backward();
    maybe_die("commit");
    auto figures = torch::stack({error.detach().pow(2).sum(),
                                 torch::tensor(static_cast<double>(index.numel()), torch::kDouble)});
    // LOCKSTEP_TEST_PLAIN_COMMIT=R: launcher rank R calls commit() from
    // step 5 on while the others sum (a misuse every rank must name).
    std::optional<torch::Tensor> totals;
    if (plain_commit == replica && now_step >= 5) {
      if (ft.commit()) {
        totals = figures;
      }
    } else {
      totals = ft.commit(figures);
    }
    if (!totals) {
      continue;
    }
    if (store_counter && ft.step() == count_from) {
      counted_from = store_counter->stats().key_operations;
    }
    if (store_counter && ft.step() == count_to) {
      std::printf("elastic_float64: %lld store key operations in %lld steps\n",
                  static_cast<long long>(store_counter->stats().key_operations - counted_from),
                  count_to - count_from);
      std::fflush(stdout);
    }
    maybe_die("step");
    scaler.step(optimizer);
    scaler.update();
    scheduler->step();
    ++scheduled;
    double sum = 0;
    for (const auto& param : model->parameters()) {
      sum += param.sum().item<double>();
    }
    char line[160];
    std::snprintf(line, sizeof(line), "%lld %d %.17g %.17g %g\n",
                  static_cast<long long>(ft.step()), ft.world().size(), sum,
                  (*totals)[0].item<double>(), (*totals)[1].item<double>());
    log << line << std::flush;
    // Slower while a rank is missing, so that its restart (a second or
    // more on a loaded machine) rejoins before the run ends.
    std::this_thread::sleep_for(std::chrono::milliseconds(whole ? pause_ms : 10 * pause_ms));
  }
  ddp.check_replicas();
  maybe_die("end");
  // The others linger after a kill planned after the loop, so that the
  // killed rank ends first: its restart then finds no rank ended yet.
  if (std::any_of(kills.begin(), kills.end(), [](const Kill& k) { return k.phase == "end"; })) {
    std::this_thread::sleep_for(std::chrono::seconds(3));
  }
  if (ft.world().rank() == 0) {
    auto flat = torch::cat({model->fc1->weight.flatten(), model->fc1->bias, model->fc2->weight.flatten(),
                            model->fc2->bias, model->fc3->weight.flatten(), model->fc3->bias});
    std::ofstream(out + "/parameters.bin", std::ios::binary)
        .write(static_cast<const char*>(flat.data_ptr()), flat.numel() * sizeof(double));
  }
  auto stats = ft.stats();
  std::printf("elastic_float64: rank %d: %lld steps, %lld dropped, %lld world(s) formed, "
              "loss scale %.17g\n",
              replica, static_cast<long long>(ft.step()),
              static_cast<long long>(stats.aborted_steps),
              static_cast<long long>(stats.worlds_formed), scaler.get_scale());
  std::printf("elastic_float64: rank %d incarnation %d: live state sent %lld bytes, received "
              "%lld bytes\n",
              replica, incarnation, static_cast<long long>(stats.state_bytes_sent),
              static_cast<long long>(stats.state_bytes_received));
  return 0;
}

int main(int argc, char** argv) {
  try {
    return train(argc, argv);
  } catch (const lockstep::FaultToleranceError& e) {
    std::fprintf(stderr, "elastic_float64: FaultToleranceError: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "elastic_float64: %s\n", e.what());
    return 1;
  }
}
