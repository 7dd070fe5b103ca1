// Streaming DiLoCo in float64 under lockstep::FaultTolerance, one replica
// per rank of a job under lockstep-run --restart rank, for
// tests/diloco_fault_tolerance_test.cpp: 2 fragments, H = 8,
// fragment_sync_delay 1, fragment_update_alpha 0.5, each replica its own
// batches (by its launcher rank), each outer optimizer SGD with Nesterov
// momentum.
//
// diloco_float64 STEPS OUT_DIR PAUSE_MS
//
// LOCKSTEP_TEST_KILLS="R:I:STEP:PHASE" makes incarnation I of rank R kill
// itself (SIGKILL) once it has taken STEP inner steps: before its next one
// (inner), or just after the step that sent a fragment (in-flight); or stop
// itself (SIGSTOP) before its next one (stop), for the test to continue it
// (it writes its pid to OUT_DIR/pid-R). Each
// rank appends to OUT_DIR/rank-R.log a line per synchronisation that
// counted ("sync SYNCS LOCAL_STEP REPLICAS"), per one lost ("lost
// LOCAL_STEP"), and "joined LOCAL_STEP" where a restarted replica received
// the live state; at the end it writes its parameters to
// OUT_DIR/parameters-R.bin.

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include <torch/torch.h>

#include <lockstep/diloco.h>
#include <lockstep/lockstep.h>

#include "support/diloco_setup.h"

namespace {

int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value ? std::atoi(value) : fallback;
}

int train(int argc, char** argv) {
  using namespace lockstep::testing;
  int64_t steps = argc > 1 ? std::atoll(argv[1]) : 40;
  std::string out = argc > 2 ? argv[2] : ".";
  int pause_ms = argc > 3 ? std::atoi(argv[3]) : 0;
  int replica = env_int("RANK", 0);
  int incarnation = env_int("LOCKSTEP_INCARNATION", 0);
  int replicas = env_int("WORLD_SIZE", 1);
  int kill_replica = -1;
  int kill_incarnation = 0;
  long long kill_step = 0;
  char kill_phase[32] = {0};
  if (const char* plan = std::getenv("LOCKSTEP_TEST_KILLS")) {
    std::sscanf(plan, "%d:%d:%lld:%31s", &kill_replica, &kill_incarnation, &kill_step,
                kill_phase);
  }
  auto maybe_die = [&](const std::string& phase, int64_t local_step) {
    if (kill_replica != replica || kill_incarnation != incarnation || local_step != kill_step) {
      return;
    }
    if (phase == kill_phase) {
      std::raise(SIGKILL);
    }
    if (phase == "inner" && std::string(kill_phase) == "stop") {
      std::raise(SIGSTOP);
    }
  };

  torch::set_num_threads(1);
  std::ofstream(out + "/pid-" + std::to_string(replica)) << ::getpid() << "\n";
  auto world = lockstep::init();
  Mlp model = float64_mlp(3 + static_cast<uint64_t>(replica));
  torch::optim::SGD inner(model->parameters(), inner_options());
  auto fragments = fragments_of(model, 2);
  torch::optim::SGD outer_first(fragments[0], outer_options());
  torch::optim::SGD outer_second(fragments[1], outer_options());
  lockstep::DiLoCo diloco(world, fragments, inner, {&outer_first, &outer_second},
                          lockstep::DiLoCoOptions().sync_every(8).fragment_sync_delay(1)
                              .fragment_update_alpha(0.5));
  lockstep::FaultTolerance ft(diloco, inner,
                              lockstep::FaultToleranceOptions()
                                  .heartbeat_timeout(std::chrono::milliseconds(1000))
                                  .timeout(std::chrono::seconds(60)));
  std::ofstream log(out + "/rank-" + std::to_string(replica) + ".log", std::ios::app);
  while (diloco.local_step() < steps) {
    int64_t before = diloco.local_step();
    int64_t syncs = diloco.syncs();
    maybe_die("inner", before);
    auto [x, y] = replica_batch(before, 3, replica);
    inner.zero_grad();
    torch::mse_loss(model(x), y).backward();
    diloco.step();
    int64_t now = diloco.local_step();
    if (now != before + 1) {
      log << "joined " << now << std::endl;
    }
    if (diloco.syncs() > syncs) {
      log << "sync " << diloco.syncs() << " " << now << " " << ft.world().size() << std::endl;
    } else if (now % 4 == 0) {
      log << "lost " << now << std::endl;
    }
    maybe_die("in-flight", now);
    // Slower while a replica is missing, so that its restart (a second or
    // more on a loaded machine) rejoins before the run ends.
    std::this_thread::sleep_for(
        std::chrono::milliseconds(ft.world().size() == replicas ? pause_ms : 5 * pause_ms));
  }
  auto flat = flatten(model->parameters());
  std::ofstream(out + "/parameters-" + std::to_string(replica) + ".bin", std::ios::binary)
      .write(static_cast<const char*>(flat.data_ptr()), flat.numel() * sizeof(double));
  std::printf("diloco_float64: rank %d: %lld steps, %lld syncs\n", replica,
              static_cast<long long>(diloco.local_step()),
              static_cast<long long>(diloco.syncs()));
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  try {
    return train(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "diloco_float64: %s\n", e.what());
    return 1;
  }
}
