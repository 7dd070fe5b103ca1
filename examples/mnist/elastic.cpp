// MNIST with a dead rank costing one step, not the job: the loop of
// lockstep::FaultTolerance, under lockstep-run --restart rank.
//
//   lockstep-run --nproc-per-node 3 --restart rank --max-restarts 10 --
//       mnist_elastic --data data/mnist --steps 400
//
// Each step trains on global batch `step` of lockstep::StepSampler (through
// a lockstep::StepLoader), shared among the ranks that take part, so a world that shrinks or grows still
// sees every sample once per epoch. Kill a rank (kill -9): the others drop
// that step and go on; lockstep-run restarts it, and it rejoins with the
// live state. --phase-dir lets a test see what each rank is doing (and kill
// it there); --checkpoint-every writes checkpoints for whole-job failures.

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "net.h"

namespace {

struct Flags {
  std::string data = "data/mnist";
  int64_t steps = 400;
  int64_t global_batch = 96;
  double lr = 0.05;
  uint64_t seed = 1;
  int min_world_size = 1;
  int heartbeat_ms = 2000;
  std::string phase_dir;
  std::string checkpoint;
  int64_t checkpoint_every = 0;
  int64_t log_every = 50;
};

const char* const kUsage = R"(usage: mnist_elastic [flags]
  --data DIR              MNIST IDX files (default data/mnist)
  --steps N               committed steps to train (default 400)
  --global-batch N        samples per step over all ranks (default 96)
  --lr X                  SGD learning rate, momentum 0.9 (default 0.05)
  --seed N                model initialisation and data order (default 1)
  --min-world-size N      FaultToleranceOptions::min_world_size (default 1)
  --heartbeat-ms N        FaultToleranceOptions::heartbeat_timeout (default 2000)
  --phase-dir DIR         keep DIR/rank-R up to date: "<phase> <pid> <step>"
  --checkpoint FILE       rank 0 of the world writes FILE every --checkpoint-every steps
  --checkpoint-every N    (default 0: never)
  --log-every N           a progress line every N steps (default 50)
)";

Flags parse(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        throw std::runtime_error(arg + " needs a value");
      }
      return argv[++i];
    };
    if (arg == "--data") flags.data = value();
    else if (arg == "--steps") flags.steps = std::stoll(value());
    else if (arg == "--global-batch") flags.global_batch = std::stoll(value());
    else if (arg == "--lr") flags.lr = std::stod(value());
    else if (arg == "--seed") flags.seed = std::stoull(value());
    else if (arg == "--min-world-size") flags.min_world_size = std::stoi(value());
    else if (arg == "--heartbeat-ms") flags.heartbeat_ms = std::stoi(value());
    else if (arg == "--phase-dir") flags.phase_dir = value();
    else if (arg == "--checkpoint") flags.checkpoint = value();
    else if (arg == "--checkpoint-every") flags.checkpoint_every = std::stoll(value());
    else if (arg == "--log-every") flags.log_every = std::stoll(value());
    else throw std::runtime_error("unknown flag " + arg + "\n" + kUsage);
  }
  return flags;
}

// What this rank is doing, where a test can read it without asking.
class Phase {
 public:
  Phase(const std::string& dir, int replica) {
    if (!dir.empty()) {
      std::filesystem::create_directories(dir);
      fd_ = ::open((dir + "/rank-" + std::to_string(replica)).c_str(),
                   O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    }
  }
  ~Phase() {
    if (fd_ >= 0) {
      ::close(fd_);
    }
  }
  void operator()(const char* phase, int64_t step) const {
    if (fd_ < 0) {
      return;
    }
    char line[64];
    int length = std::snprintf(line, sizeof(line), "%-10s %8d %8lld\n", phase,
                               static_cast<int>(::getpid()), static_cast<long long>(step));
    [[maybe_unused]] auto written = ::pwrite(fd_, line, length, 0);
  }

 private:
  int fd_ = -1;
};

double wall_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

} // namespace

int main(int argc, char** argv) {
  Flags flags;
  try {
    flags = parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "mnist_elastic: " << e.what() << std::endl;
    return 2;
  }
  torch::set_num_threads(1);
  int replica = std::getenv("RANK") ? std::atoi(std::getenv("RANK")) : 0;
  Phase phase(flags.phase_dir, replica);
  phase("starting", 0);

  auto world = lockstep::init();
  torch::manual_seed(flags.seed);
  mnist::Net model(/*batch_norm=*/false);
  lockstep::DDP<mnist::Net> ddp(model, world);
  torch::optim::SGD optimizer(model->parameters(),
                              torch::optim::SGDOptions(flags.lr).momentum(0.9));
  lockstep::FaultTolerance ft(
      ddp, optimizer,
      lockstep::FaultToleranceOptions()
          .min_world_size(flags.min_world_size)
          .heartbeat_timeout(std::chrono::milliseconds(flags.heartbeat_ms))
          .seed(flags.seed));

  auto train = torch::data::datasets::MNIST(flags.data, torch::data::datasets::MNIST::Mode::kTrain)
                   .map(torch::data::transforms::Normalize<>(0.1307, 0.3081))
                   .map(torch::data::transforms::Stack<>());
  lockstep::StepLoader loader(std::move(train), lockstep::StepSamplerOptions()
                                                    .global_batch_size(flags.global_batch)
                                                    .seed(flags.seed));

  int64_t formed = ft.stats().worlds_formed;
  // The job's loss summed and its samples, over the committed steps since
  // the last line (since this rank joined, on a rank that rejoined).
  auto since_log = torch::zeros({2}, torch::kDouble);
  while (ft.step() < flags.steps) {
    phase("begin", ft.step());
    ft.begin_step();
    bool reformed = ft.stats().worlds_formed != formed;
    formed = ft.stats().worlds_formed;
    auto batch = loader.batch(ft); // this rank's share of the step's batch, in this world
    optimizer.zero_grad();
    phase("forward", ft.step());
    auto loss = torch::nll_loss(ddp(batch.data), batch.target);
    phase("backward", ft.step());
    loss.backward();
    phase("commit", ft.step());
    // This rank's loss summed and its samples, summed over the step's
    // world: only for a step that counts.
    auto figures = torch::stack({loss.detach().to(torch::kDouble) * batch.data.size(0),
                                 torch::tensor(static_cast<double>(batch.data.size(0)),
                                               torch::kDouble)});
    auto sums = ft.commit(figures);
    if (!sums) {
      continue;
    }
    since_log += *sums;
    phase("step", ft.step());
    optimizer.step();
    if (reformed) {
      std::printf("mnist_elastic: rank %d steps again at step %lld in a world of %d, "
                  "wall %.0f ms\n",
                  replica, static_cast<long long>(ft.step()), ft.world().size(), wall_ms());
    }
    if (!flags.checkpoint.empty() && flags.checkpoint_every > 0 &&
        ft.step() % flags.checkpoint_every == 0 && ft.world().rank() == 0) {
      // For a whole-job failure; a single rank's comes back from its peers.
      phase("checkpoint", ft.step());
      torch::serialize::OutputArchive archive;
      model->save(archive);
      optimizer.save(archive);
      archive.write("step", torch::tensor(ft.step()));
      archive.save_to(flags.checkpoint + ".tmp");
      std::filesystem::rename(flags.checkpoint + ".tmp", flags.checkpoint);
    }
    if (ft.step() % flags.log_every == 0 && since_log[1].item<double>() > 0) {
      lockstep::on_rank_zero(ft.world())
          << "step " << ft.step() << "/" << flags.steps << " loss "
          << (since_log[0] / since_log[1]).item<double>() << " (world of "
          << ft.world().size() << ")" << std::endl;
      since_log.zero_();
    }
  }
  phase("done", ft.step());

  ddp.check_replicas();
  torch::NoGradGuard no_grad;
  model->eval();
  torch::data::datasets::MNIST test(flags.data, torch::data::datasets::MNIST::Mode::kTest);
  auto test_images = (test.images() - 0.1307) / 0.3081;
  int64_t n = test_images.size(0);
  int64_t rank = ft.world().rank(), size = ft.world().size();
  int64_t begin = n * rank / size, end = n * (rank + 1) / size;
  auto predicted = model(test_images.slice(0, begin, end)).argmax(1);
  auto correct = torch::tensor({predicted.eq(test.targets().slice(0, begin, end)).sum().item<double>()},
                               torch::kDouble);
  auto world_now = ft.world();
  world_now.all_reduce(correct);
  auto stats = ft.stats();
  std::printf("mnist_elastic: rank %d done: %lld committed steps, %lld dropped, %lld world(s) "
              "formed after the first (%.3f s in all); replicas identical; test accuracy "
              "%.2f%%\n",
              replica, static_cast<long long>(ft.step()),
              static_cast<long long>(stats.aborted_steps),
              static_cast<long long>(stats.worlds_formed), stats.reform_seconds,
              100.0 * correct.item<double>() / static_cast<double>(n));
  return 0;
}
