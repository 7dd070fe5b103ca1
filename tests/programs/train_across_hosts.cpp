// DDP training of an MLP with one bucket per layer, on a world formed from
// the environment. The two-host test runs it as 2 hosts x 2 ranks in
// network namespaces:
//   train_across_hosts STEPS [HOOK]  trains STEPS steps and exits (with
//                              LOCKSTEP_TIMELINE set, for the timeline of
//                              buckets crossing the link); with HOOK (none,
//                              fp16, bf16, powersgd:RANK), checks after
//                              every step that the replicas are
//                              bit-identical;
//   train_across_hosts 0       trains until a collective fails, then says
//                              when (the wall clock in ms, to compare with
//                              the moment the test killed a rank or cut its
//                              host off) and why, and stays alive 30 s,
//                              holding its connections, as a program that
//                              saves or logs after an error would.

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <thread>

#include <lockstep/lockstep.h>
#include <torch/torch.h>

namespace {

int64_t wall_clock_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

} // namespace

int main(int argc, char** argv) {
  int64_t steps = argc > 1 ? std::atoll(argv[1]) : 0;
  std::string hook = argc > 2 ? argv[2] : "";
  int rank = -1;
  // Outside the try: rank 0 hosts the store, and its world's destructor
  // waits for the others to close before the error could be printed.
  std::optional<lockstep::World> world;
  try {
    world = lockstep::init();
    rank = world->rank();
    torch::manual_seed(0);
    // 1 MiB of float32 a layer, 1 MiB buckets: a bucket a layer, each
    // ready soon after the one before, as in a deep model.
    torch::nn::Sequential net;
    for (int layer = 0; layer < 6; ++layer) {
      net->push_back(torch::nn::Linear(512, 512));
      net->push_back(torch::nn::ReLU());
    }
    lockstep::DDP<torch::nn::Sequential> ddp(
        net, *world, lockstep::DdpOptions().bucket_cap_mb(1).first_bucket_cap_mb(1));
    std::optional<lockstep::PowerSGD> power_sgd;
    if (hook == "fp16") {
      ddp.register_comm_hook(lockstep::hooks::fp16_compress());
    } else if (hook == "bf16") {
      ddp.register_comm_hook(lockstep::hooks::bf16_compress());
    } else if (hook.rfind("powersgd:", 0) == 0) {
      power_sgd.emplace(lockstep::PowerSGDOptions()
                            .matrix_approximation_rank(std::atoi(hook.c_str() + 9))
                            .start_powerSGD_iter(2));
      ddp.register_comm_hook(power_sgd->hook());
    }
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01));
    torch::manual_seed(1 + rank);
    for (int64_t step = 1; steps == 0 || step <= steps; ++step) {
      optimizer.zero_grad();
      ddp(torch::randn({16, 512})).square().mean().backward();
      optimizer.step();
      if (!hook.empty()) {
        ddp.check_replicas();
      }
      if (rank == 0 && step % 10 == 0) {
        std::cout << "step " << step << std::endl;
      }
    }
    std::cout << "rank " << rank << ": done";
    if (!hook.empty()) {
      std::cout << ", " << steps << " steps with " << hook
                << ", the replicas bit-identical after each";
    }
    std::cout << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cout << "rank " << rank << " failed at " << wall_clock_ms() << " ms: " << e.what()
              << std::endl;
    if (steps == 0) {
      std::this_thread::sleep_for(std::chrono::seconds(30));
    }
    return 1;
  }
}
