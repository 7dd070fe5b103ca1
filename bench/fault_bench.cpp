// What a failure costs, with the 10.5M MLP (bench_models.h), batch 64 per
// rank, SGD: bench/run-fault-tolerance kills a rank mid-run and reads the
// lines this prints ("rank R pid P step S wall MS size N" after each step).
//   bench_fault elastic STEPS          lockstep::FaultTolerance, under
//                                      lockstep-run --restart rank
//   bench_fault checkpoint STEPS EVERY DIR   plain DDP, a checkpoint every
//                                      EVERY steps, resumed from at start
//                                      (lockstep-run --restart all)
//   bench_fault steady STEPS FT [SIMULATED=0] [GROUP=1] [HEARTBEAT_MS=2000]
//                                      what a steady step costs: a small
//                                      MLP (256-256-10, batch 32), plain
//                                      DDP (FT 0) or under FaultTolerance
//                                      (FT 1, that heartbeat timeout);
//                                      rank 0 prints "steady ft F ranks N
//                                      p50 MS p99 MS store_ops K simulated
//                                      M group G sim_failures F" over the
//                                      STEPS after 20 untimed. SIMULATED:
//                                      that many more members beat in the
//                                      job's liveness from the last rank's
//                                      process (as a job of that many
//                                      ranks loads the store and every
//                                      rank's view), in either mode;
//                                      sim_failures: how many of them the
//                                      store judged failed by the end (a
//                                      member starved past its heartbeat
//                                      timeout). GROUP: replica groups of
//                                      that many ranks, DDP inside each;
//                                      FT 1 averages across them fault-
//                                      tolerantly, FT 0 by one plain
//                                      all-reduce of the flat gradients
//   bench_fault rejoin STEPS WIDTH LAYERS   what a rejoin costs in memory:
//                                      LAYERS Linear(WIDTH, WIDTH), Adam,
//                                      batch 4, under FaultTolerance (each
//                                      step reported as in elastic); at
//                                      the end "rank R incarnation I sent
//                                      B received B" (bytes of live state)

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>
#include <sys/resource.h>
#include <unistd.h>

#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "bench_models.h"
#include "store/client.h"
#include "world/epoch_world.h"
#include "world/liveness.h"
#include "world/process_identity.h"

namespace {

double wall_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int launcher_rank() {
  return std::getenv("RANK") ? std::atoi(std::getenv("RANK")) : 0;
}

void report(int64_t step, int size) {
  std::printf("rank %d pid %d step %lld wall %.1f size %d\n", launcher_rank(),
              static_cast<int>(::getpid()), static_cast<long long>(step), wall_ms(), size);
  std::fflush(stdout);
}

double percentile(std::vector<double> values, double p) {
  std::sort(values.begin(), values.end());
  return values[std::min(values.size() - 1,
                         static_cast<size_t>(p * static_cast<double>(values.size() - 1) + 0.5))];
}

// `count` more members of the job's liveness, in this process: each beats
// for a slot past the launcher's on a thread and connection of its own, as
// the ranks of a job that many larger would. Returns once one of them sees
// every one's hello, and a heartbeat later (every watcher has taken the
// burst of views the hellos caused), so that the hellos fall before the
// timed steps.
std::vector<std::shared_ptr<lockstep::detail::Liveness>> simulate_members(
    const lockstep::World& world, int count, std::chrono::milliseconds heartbeat) {
  using lockstep::detail::WorldAccess;
  // Two connections a member.
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  files.rlim_cur = files.rlim_max;
  setrlimit(RLIMIT_NOFILE, &files);
  std::vector<std::shared_ptr<lockstep::detail::Liveness>> members;
  auto endpoint = WorldAccess::store_client(world)->endpoint();
  const int first = WorldAccess::slots(world);
  for (int i = 0; i < count; ++i) {
    // On no machine of the job: never judged gone by its pid.
    lockstep::detail::ProcessIdentity identity{"sim", "sim", 100000 + i, 0};
    members.push_back(std::make_shared<lockstep::detail::Liveness>(
        endpoint, std::chrono::seconds(60),
        lockstep::detail::Liveness::Process{first + i, 0, identity.to_record()}, heartbeat));
  }
  auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  for (int i = 0; i < count; ++i) {
    while (members.front()->incarnation_of(first + i) < 0) {
      if (std::chrono::steady_clock::now() > limit) {
        std::fprintf(stderr, "bench_fault: simulated member %d said no hello in 120 s\n", i);
        std::exit(1);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  std::this_thread::sleep_for(heartbeat);
  return members;
}

// How many of the simulated members the store has judged failed.
int simulated_failures(const lockstep::World& world,
                       const std::vector<std::shared_ptr<lockstep::detail::Liveness>>& members) {
  const int first = lockstep::detail::WorldAccess::slots(world);
  int failed = 0;
  for (int i = 0; i < static_cast<int>(members.size()); ++i) {
    failed += members.front()->failed(first + i, 0) ? 1 : 0;
  }
  return failed;
}

int steady(lockstep::World& world, int64_t steps, bool fault_tolerant, int simulated,
           int group_size, std::chrono::milliseconds heartbeat) {
  torch::nn::Sequential model(torch::nn::Linear(256, 256), torch::nn::ReLU(),
                              torch::nn::Linear(256, 10));
  std::optional<lockstep::ReplicaGroups> groups;
  if (group_size > 1) {
    groups = lockstep::replica_groups(world, group_size);
  }
  lockstep::DDP<torch::nn::Sequential> ddp(model, groups ? groups->replica : world);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01));
  auto x = torch::randn({32, 256});
  auto y = torch::randint(0, 10, {32});
  std::optional<lockstep::FaultTolerance> ft;
  auto options = lockstep::FaultToleranceOptions().heartbeat_timeout(heartbeat);
  if (fault_tolerant && groups) {
    ft.emplace(*groups, *model, optimizer, options);
  } else if (fault_tolerant) {
    ft.emplace(ddp, optimizer, options);
  }
  // Without fault tolerance, the groups' average is one plain all-reduce
  // of the flat gradients: what FaultTolerance's commit does, less the
  // fault tolerance.
  auto average_across_groups = [&] {
    std::vector<torch::Tensor> grads;
    for (auto& parameter : model->parameters()) {
      grads.push_back(parameter.grad().view(-1));
    }
    auto flat = torch::cat(grads);
    groups->across.all_reduce(flat, lockstep::ReduceOp::Average);
    int64_t offset = 0;
    for (auto& parameter : model->parameters()) {
      auto n = parameter.grad().numel();
      parameter.grad().view(-1).copy_(flat.narrow(0, offset, n));
      offset += n;
    }
  };
  std::vector<std::shared_ptr<lockstep::detail::Liveness>> members;
  if (simulated > 0 && world.rank() == world.size() - 1) {
    members = simulate_members(world, simulated, heartbeat);
  }
  world.barrier();
  auto store = lockstep::detail::WorldAccess::store_client(world);
  std::vector<double> times;
  int64_t ops_from = 0;
  for (int64_t step = 0; step < steps + 20; ++step) {
    if (step == 20) {
      world.barrier();
      ops_from = store->stats().key_operations;
    }
    auto start = std::chrono::steady_clock::now();
    if (ft) {
      ft->begin_step();
    }
    optimizer.zero_grad();
    torch::cross_entropy_loss(ddp->forward(x), y).backward();
    if (!ft && groups) {
      average_across_groups();
    }
    if (!ft || ft->commit()) {
      optimizer.step();
    }
    if (step >= 20) {
      times.push_back(std::chrono::duration<double, std::milli>(
                          std::chrono::steady_clock::now() - start)
                          .count());
    }
  }
  int64_t ops = store->stats().key_operations - ops_from;
  // The last rank's count of failed members reaches rank 0's line.
  auto failures = torch::tensor({static_cast<double>(simulated_failures(world, members))});
  world.all_reduce(failures, lockstep::ReduceOp::Max);
  if (world.rank() == 0) {
    std::printf("steady ft %d ranks %d p50 %.3f p99 %.3f store_ops %lld simulated %d group %d "
                "sim_failures %d\n",
                fault_tolerant ? 1 : 0, world.size(), percentile(times, 0.5),
                percentile(times, 0.99), static_cast<long long>(ops), simulated, group_size,
                static_cast<int>(failures.item<double>()));
  }
  world.barrier();
  for (auto& member : members) {
    member->goodbye();
  }
  members.clear();
  return 0;
}

int rejoin(lockstep::World& world, int64_t steps, int64_t width, int64_t layers) {
  torch::nn::Sequential model;
  for (int64_t layer = 0; layer < layers; ++layer) {
    model->push_back(torch::nn::Linear(torch::nn::LinearOptions(width, width).bias(false)));
    model->push_back(torch::nn::Tanh());
  }
  lockstep::DDP<torch::nn::Sequential> ddp(model, world);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-4));
  lockstep::FaultTolerance ft(
      ddp, optimizer,
      lockstep::FaultToleranceOptions().heartbeat_timeout(std::chrono::milliseconds(2000)));
  auto x = torch::randn({4, width});
  while (ft.step() < steps) {
    ft.begin_step();
    optimizer.zero_grad();
    ddp->forward(x).pow(2).mean().backward();
    if (ft.commit()) {
      optimizer.step();
      report(ft.step(), ft.world().size());
    }
    if (ft.world().size() < world.size()) {
      // A rank is missing: its restart (seconds to start) rejoins before
      // the run ends.
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  const char* incarnation = std::getenv("LOCKSTEP_INCARNATION");
  std::printf("rank %d incarnation %s sent %lld received %lld\n", launcher_rank(),
              incarnation ? incarnation : "0",
              static_cast<long long>(ft.stats().state_bytes_sent),
              static_cast<long long>(ft.stats().state_bytes_received));
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "elastic";
  int64_t steps = argc > 2 ? std::atoll(argv[2]) : 100;
  std::printf("rank %d pid %d\n", launcher_rank(), static_cast<int>(::getpid()));
  std::fflush(stdout);
  auto world = lockstep::init();
  torch::manual_seed(0);
  if (mode == "steady") {
    return steady(world, steps, argc > 3 && std::atoi(argv[3]) == 1,
                  argc > 4 ? std::atoi(argv[4]) : 0, argc > 5 ? std::atoi(argv[5]) : 1,
                  std::chrono::milliseconds(argc > 6 ? std::atoi(argv[6]) : 2000));
  }
  if (mode == "rejoin") {
    return rejoin(world, steps, argc > 3 ? std::atoll(argv[3]) : 4096,
                  argc > 4 ? std::atoll(argv[4]) : 16);
  }
  lockstep::bench::Mlp model;
  lockstep::DDP<lockstep::bench::Mlp> ddp(model, world);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto x = torch::randn({64, 1024});
  auto y = torch::randint(0, 10, {64});
  auto train = [&] {
    optimizer.zero_grad();
    torch::cross_entropy_loss(ddp(x), y).backward();
  };

  if (mode == "elastic") {
    lockstep::FaultTolerance ft(ddp, optimizer,
                                lockstep::FaultToleranceOptions().heartbeat_timeout(
                                    std::chrono::milliseconds(1000)));
    while (ft.step() < steps) {
      ft.begin_step();
      train();
      if (ft.commit()) {
        optimizer.step();
        report(ft.step(), ft.world().size());
      }
    }
    std::printf("rank %d dropped %lld\n", launcher_rank(),
                static_cast<long long>(ft.stats().aborted_steps));
    return 0;
  }

  int64_t every = argc > 3 ? std::atoll(argv[3]) : 50;
  std::string path = std::string(argc > 4 ? argv[4] : ".") + "/checkpoint.pt";
  int64_t first = 0;
  if (std::filesystem::exists(path)) {
    torch::serialize::InputArchive archive;
    archive.load_from(path);
    model->load(archive);
    optimizer.load(archive);
    torch::Tensor step;
    archive.read("step", step);
    first = step.item<int64_t>();
    std::printf("rank %d resumed at step %lld\n", launcher_rank(), static_cast<long long>(first));
  }
  for (int64_t step = first; step < steps;) {
    train();
    optimizer.step();
    ++step;
    report(step, world.size());
    if (step % every == 0 && world.rank() == 0) {
      torch::serialize::OutputArchive archive;
      model->save(archive);
      optimizer.save(archive);
      archive.write("step", torch::tensor(step));
      archive.save_to(path + ".tmp");
      std::filesystem::rename(path + ".tmp", path);
    }
  }
  return 0;
}
