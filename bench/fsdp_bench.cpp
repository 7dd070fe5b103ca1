// Memory and time of one model trained five ways: DDP, DDP with a
// ZeroRedundancyOptimizer (ZeRO-1), the same with the gradients sharded
// (DdpOptions::shard_gradients, ZeRO-2), and FullyShardedDataParallel (ZeRO-3)
// with and without resharding after forward. Adam, one intra-op thread per
// rank. Rank 0 prints one CSV line:
//
//   mode,ms_per_step,peak_train_mib,peak_build_mib,state_mib_per_rank,
//       baseline_mib,after_build_mib,ms_fastest,ms_slowest
//
// ms_per_step: the median over ITERATIONS timed steps of the slowest rank;
// ms_fastest and ms_slowest the spread of those steps. baseline_mib: the
// resident set before the model was built; after_build_mib: once wrapped.
// peak_train_mib: the largest resident set over ranks while training,
// counted from after the model was built and wrapped (the kernel's peak is
// reset there, /proc/self/clear_refs): every rank builds the whole model
// first, as LibTorch makes parameters where a module is constructed, and
// that peak is peak_build_mib. state_mib_per_rank: parameters, gradients
// and Adam's two moments that one rank holds, by the mode's own account.
//
//   fsdp_bench MODE [ITERATIONS=10] [WIDTH=1024] [DEPTH=18] [BATCH=16]
//   MODE: ddp | zero1 | zero2 | fsdp | fsdp_kept | fsdp_prefetch | fsdp_frozen |
//         fsdp_unused
//
// fsdp_frozen: the first block frozen whole and every other block's
// LayerNorm frozen (a partly frozen model, as under LoRA); fsdp_unused: the
// last block holds a Linear WIDTH -> WIDTH that its forward never calls (a
// trainable parameter unused in every step). Their state counts gradients
// and Adam moments for the parameters that get gradients only.
//
// MODE checkpoint (FSDP, after ITERATIONS steps; LOCKSTEP_BENCH_DIR names
// the folder, /tmp by default) times the two kinds of checkpoint and the
// largest resident set over ranks while each runs, from the same start:
//
//   checkpoint,consolidated_save_ms,consolidated_peak_mib,sharded_save_ms,
//       sharded_save_peak_mib,sharded_load_ms,sharded_load_peak_mib,trained_mib
//
// The model: DEPTH residual blocks (LayerNorm, Linear WIDTH -> 4 WIDTH,
// GELU, Linear back), each a unit under FSDP, then a Linear head in the
// root; 8 WIDTH^2 parameters per block. WIDTH 1024 and DEPTH 18 make 151M
// parameters: 2.4 GB of parameters, gradients and Adam state in float32.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <optional>
#include <string>

#include <torch/torch.h>

#include <lockstep/fsdp.h>
#include <lockstep/lockstep.h>

namespace {

using namespace lockstep;
using Clock = std::chrono::steady_clock;

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width, bool with_unused = false)
      : norm(register_module("norm", torch::nn::LayerNorm(
                                         torch::nn::LayerNormOptions({width})))),
        up(register_module("up", torch::nn::Linear(width, 4 * width))),
        down(register_module("down", torch::nn::Linear(4 * width, width))) {
    if (with_unused) {
      register_module("unused", torch::nn::Linear(width, width));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x + down(torch::gelu(up(norm(x))));
  }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
};
TORCH_MODULE(Block);

struct StackImpl : torch::nn::Module {
  StackImpl(int64_t width, int64_t depth, bool with_unused = false) {
    for (int64_t i = 0; i < depth; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i),
                                       Sharded<Block>(width, with_unused && i == depth - 1)));
    }
    head = register_module("head", torch::nn::Linear(width, width));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& block : blocks) {
      x = block(x);
    }
    return head(x);
  }
  std::vector<Sharded<Block>> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Stack);

// A field of /proc/self/status in MiB: VmHWM (the peak resident set) or
// VmRSS (the resident set now).
double status_mib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      return std::stod(line.substr(field.size() + 1)) / 1024.0; // kB
    }
  }
  return -1;
}

void reset_peak() {
  std::ofstream("/proc/self/clear_refs") << "5";
}

double largest(World& world, double value) {
  auto tensor = torch::tensor({value}, torch::kDouble);
  world.all_reduce(tensor, ReduceOp::Max);
  return tensor.item<double>();
}

int64_t arg(int argc, char** argv, int index, int64_t fallback) {
  return argc > index ? std::atoll(argv[index]) : fallback;
}

// Runs `body` on every rank; its slowest rank's milliseconds, and the
// largest resident set over ranks while it ran (from a reset peak).
std::pair<double, double> measured(World& world, const std::function<void()>& body) {
  world.barrier();
  reset_peak();
  auto start = Clock::now();
  body();
  double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  world.barrier();
  return {largest(world, ms), largest(world, status_mib("VmHWM"))};
}

int time_checkpoints(World& world, FullyShardedDataParallel<Stack>& fsdp, Stack& model,
                     torch::optim::Optimizer& optimizer) {
  const char* folder = std::getenv("LOCKSTEP_BENCH_DIR");
  // Named by the job's port: a save of its own, generation 1.
  const char* port = std::getenv("MASTER_PORT");
  std::string base = std::string(folder != nullptr ? folder : "/tmp") + "/lockstep-bench-fsdp-" +
      (port != nullptr ? port : "0");
  double trained = largest(world, status_mib("VmRSS"));
  auto consolidated = measured(world, [&] {
    torch::optim::Adam full(model->parameters(), torch::optim::AdamOptions(1e-4));
    fsdp.consolidate_optimizer_state(optimizer, full);
    auto gathered = fsdp.summon_full_parameters();
    save_checkpoint(world, base + ".pt", *model, full);
  });
  auto sharded_save = measured(world, [&] { fsdp.save_sharded(base, optimizer); });
  auto sharded_load = measured(world, [&] { fsdp.load_sharded(base, optimizer); });
  if (world.rank() == 0) {
    std::printf("checkpoint,%.0f,%.0f,%.0f,%.0f,%.0f,%.0f,%.0f\n", consolidated.first,
                consolidated.second, sharded_save.first, sharded_save.second,
                sharded_load.first, sharded_load.second, trained);
    std::fflush(stdout);
  }
  world.barrier();
  if (world.rank() == 0) { // what the two saves wrote: gigabytes
    std::remove((base + ".pt").c_str());
    std::remove(base.c_str());
    for (int r = 0; r < world.size(); ++r) {
      std::remove((base + ".1.rank" + std::to_string(r) + "-of-" +
                   std::to_string(world.size())).c_str());
    }
  }
  return 0;
}

} // namespace

int train(int argc, char** argv) {
  torch::set_num_threads(1);
  std::string mode = argc > 1 ? argv[1] : "fsdp";
  int iterations = static_cast<int>(arg(argc, argv, 2, 10));
  int64_t width = arg(argc, argv, 3, 1024);
  int64_t depth = arg(argc, argv, 4, 18);
  int64_t batch = arg(argc, argv, 5, 16);
  World world = init();
  int ranks = world.size();

  // What a rank holds before the model: LibTorch, the world's connections.
  double baseline = largest(world, status_mib("VmRSS"));
  torch::manual_seed(0);
  Stack model(width, depth, mode == "fsdp_unused");
  if (mode == "fsdp_frozen") {
    for (size_t i = 0; i < model->blocks.size(); ++i) {
      auto& block = *model->blocks[i];
      for (auto& param : i == 0 ? block.parameters() : block.norm->parameters()) {
        param.requires_grad_(false);
      }
    }
  }
  double parameters = 0;
  double trained = 0; // those that get gradients (and Adam's moments)
  for (const auto& item : model->named_parameters()) {
    auto count = static_cast<double>(item.value().numel());
    parameters += count;
    bool unused = item.key().find(".unused.") != std::string::npos;
    trained += item.value().requires_grad() && !unused ? count : 0;
  }
  double mib = 4.0 / (1 << 20); // float32
  std::optional<DistributedDataParallel<Stack>> ddp;
  std::optional<FullyShardedDataParallel<Stack>> fsdp;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  double state = 0;
  if (mode == "ddp" || mode == "zero1" || mode == "zero2") {
    ddp.emplace(model, world, DdpOptions().shard_gradients(mode == "zero2"));
    if (mode == "ddp") {
      optimizer = std::make_unique<torch::optim::Adam>(model->parameters(),
                                                       torch::optim::AdamOptions(1e-4));
      state = 4 * parameters * mib;
    } else {
      auto zero = std::make_unique<ZeroRedundancyOptimizer<torch::optim::Adam>>(
          model->parameters(), world, torch::optim::AdamOptions(1e-4),
          ZeroOptions().partition(ZeroPartition::Elements));
      if (mode == "zero2") {
        ddp->shard_gradients_with(*zero);
        state = (parameters + 3 * parameters / ranks) * mib;
      } else {
        state = (2 * parameters + 2 * parameters / ranks) * mib;
      }
      optimizer = std::move(zero);
    }
  } else if (mode == "fsdp" || mode == "fsdp_kept" || mode == "fsdp_prefetch" ||
             mode == "fsdp_frozen" || mode == "fsdp_unused" || mode == "checkpoint") {
    fsdp.emplace(model, world,
                 FsdpOptions()
                     .reshard_after_forward(mode != "fsdp_kept")
                     .prefetch(mode == "fsdp_prefetch"));
    optimizer = std::make_unique<torch::optim::Adam>(fsdp->parameters(),
                                                     torch::optim::AdamOptions(1e-4));
    state = (parameters + 3 * trained) / ranks * mib;
  } else {
    std::fprintf(stderr, "fsdp_bench: unknown mode %s\n", mode.c_str());
    return 2;
  }
  double build_peak = largest(world, status_mib("VmHWM"));
  double after_build = largest(world, status_mib("VmRSS"));
  world.barrier();
  reset_peak();

  auto generator = at::make_generator<at::CPUGeneratorImpl>(7 + world.rank());
  auto x = at::randn({batch, width}, generator);
  auto y = at::randn({batch, width}, generator);
  std::vector<double> times;
  for (int i = 0; i < iterations + 1; ++i) {
    auto start = Clock::now();
    optimizer->zero_grad();
    auto output = ddp ? (*ddp)(x) : (*fsdp)(x);
    torch::mse_loss(output, y).backward();
    optimizer->step();
    world.barrier();
    if (i > 0) { // the first step makes Adam's state
      times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    }
  }
  if (mode == "checkpoint") {
    return time_checkpoints(world, *fsdp, model, *optimizer);
  }
  // Every step ends at a barrier: each rank's times are the slowest's.
  std::sort(times.begin(), times.end());
  double step_ms = largest(world, times[times.size() / 2]);
  double fastest_ms = largest(world, times.front());
  double slowest_ms = largest(world, times.back());
  double train_peak = largest(world, status_mib("VmHWM"));
  if (world.rank() == 0) {
    std::printf("%s,%.0f,%.0f,%.0f,%.0f,%.0f,%.0f,%.0f,%.0f\n", mode.c_str(), step_ms,
                train_peak, build_peak, state, baseline, after_build, fastest_ms, slowest_ms);
    std::fflush(stdout);
  }
  return 0;
}

// An error (out of memory under bench/run-fsdp's limit) as one line, and
// the exit status that tells the script so.
int main(int argc, char** argv) {
  try {
    return train(argc, argv);
  } catch (const std::exception& e) {
    std::string what = e.what();
    std::fprintf(stderr, "fsdp_bench: rank %s: %s\n", std::getenv("RANK") ? std::getenv("RANK") : "?",
                 what.substr(0, what.find('\n')).c_str());
    return 1;
  }
}
