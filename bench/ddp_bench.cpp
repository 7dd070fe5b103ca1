// One training configuration, timed: zero_grad + forward + loss + backward +
// SGD step, batch 64 per rank, one intra-op thread. Rank 0 prints one CSV
// line: model, mode, median ms, peak RSS MiB (the largest over ranks).
//
//   ddp_bench MODEL MODE [ITERATIONS] [WARMUP]
//   MODEL: mlp | cnn | cnn_bn | cnn_syncbn | mlp_const | emb_sparse | emb_dense (a 1M x 64
//          embedding table with sparse or dense gradients) | transformer
//   MODE:  lockstep (DistributedDataParallel) | manual (all-reduce each
//          gradient after backward, as C++ users do by hand) | single (one
//          process, no communication) | detail_ab (lockstep, switching
//          LOCKSTEP_DEBUG=DETAIL's comparison off and on every 5 iterations:
//          two lines, lockstep_ab and lockstep_detail, timed side by side in
//          one process so that the machine's drift cancels out) |
//          lockstep_join (lockstep inside a join guard, every rank with the
//          same batches: what the guard's agreement costs)
// BENCH_OPTIMIZER=adam steps with Adam instead of SGD (the mode gets
// "_adam"); BENCH_ZERO=1 shards it (ZeroRedundancyOptimizer, "_zero"; =slices
// in equal slices of the elements, "_zero_slices") and
// BENCH_STEP_IN_BACKWARD=1 steps it inside backward ("_in_backward"): rank
// 0 prints "state,MODEL,MODE,BYTES" to stderr, the optimizer state's bytes
// on the rank that holds the most; BENCH_BUCKET_CAP_MB overrides lockstep's
// bucket cap, to explore its effect;
// BENCH_HOOK registers a communication hook (the mode gets its name, and
// rank 0 prints the bytes of the last iteration to stderr). BENCH_NET_DEVICE
// names the network device that leaves this rank's host: rank 0 prints
// "wire,MODEL,MODE,BYTES" to stderr, what the device's own counter says
// the host sent per timed iteration (the largest over hosts), not what
// lockstep believes it sent. BENCH_DEVICE=cuda trains on cuda:LOCAL_RANK
// (NCCL), each iteration timed up to the end of its device work.
// BENCH_AMP=autocast computes forward and loss under bfloat16 autocast
// (lockstep::amp::Autocast, mode "_autocast"); BENCH_AMP=policy under DDP's
// mixed-precision policy in bfloat16 ("_policy"), and rank 0 prints
// "bytes,MODEL,MODE,BYTES", what one iteration reduced.
// BENCH_DILOCO=H:F:DELAY[:bf16|fp16] (mode lockstep): replicas of a host's
// ranks (DDP within, over shared memory) and Streaming DiLoCo across them
// with sync_every H, F fragments (consecutive parameters), that
// fragment_sync_delay and wire type; H = 0 leaves the replicas apart (the
// link unused: what a host computes alone beside the others). The mode
// gets "_diloco_hH_fF_dD[_wire]", and the time reported is the mean per
// inner step (a synchronisation is one step in H), over ITERATIONS, which
// should be a multiple of H.

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include <torch/cuda.h>
#include <torch/torch.h>

#include <lockstep/diloco.h>
#include <lockstep/lockstep.h>
#include <lockstep/replica_groups.h>

#include "bench_models.h"

namespace {

using namespace lockstep;

// Rank 0 prints the CSV line: the median over the slowest rank, and the
// largest peak RSS.
void report(World& world, const std::string& model_name, const std::string& mode,
            std::vector<double> times) {
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  auto medians = torch::tensor({times[times.size() / 2]}, torch::kDouble);
  world.all_reduce(medians, ReduceOp::Max);
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto rss = torch::tensor({static_cast<double>(usage.ru_maxrss) / 1024.0},
                           torch::kDouble);
  world.all_reduce(rss, ReduceOp::Max);
  if (world.rank() == 0) {
    std::printf("%s,%s,%.2f,%.0f\n", model_name.c_str(), mode.c_str(),
                medians.item<double>(), rss.item<double>());
    std::fflush(stdout);
  }
}

// The bytes BENCH_NET_DEVICE has sent, from the kernel's counter; -1
// when no device is named.
double wire_bytes() {
  const char* device = std::getenv("BENCH_NET_DEVICE");
  if (device == nullptr) {
    return -1;
  }
  std::ifstream counter(std::string("/sys/class/net/") + device + "/statistics/tx_bytes");
  double bytes = -1;
  counter >> bytes;
  return bytes;
}

// What `optimizer` saves, in bytes: its state.
int64_t saved_bytes(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return static_cast<int64_t>(out.str().size());
}

template <typename ModelType>
void run(World& world, ModelType model, const std::string& model_name,
         const std::string& mode, std::vector<int64_t> input_shape,
         int iterations, int warmup) {
  lockstep::bench::deterministic_init(*model);
  // BENCH_DEVICE=cuda: one GPU per rank, the batch on it, and each
  // iteration's clock stopped once the device has finished its work.
  bool cuda = std::getenv("BENCH_DEVICE") && std::string(std::getenv("BENCH_DEVICE")) == "cuda";
  torch::Device device = cuda ? torch::Device(torch::kCUDA,
                                              static_cast<c10::DeviceIndex>(world.local_rank()))
                              : torch::Device(torch::kCPU);
  model->to(device);
  std::optional<DDP<ModelType>> ddp;
  bool alternate = mode == "detail_ab";
  bool joined = mode == "lockstep_join";
  const char* diloco_setting = std::getenv("BENCH_DILOCO");
  int64_t sync_every = 0, fragment_count = 1, delay = 0;
  char wire_name[8] = {0};
  std::optional<ReplicaGroups> groups;
  if (diloco_setting != nullptr) {
    std::sscanf(diloco_setting, "%ld:%ld:%ld:%7s", &sync_every, &fragment_count, &delay,
                wire_name);
    groups = replica_groups(world);
  }
  std::string precision = std::getenv("BENCH_AMP") ? std::getenv("BENCH_AMP") : "";
  if (mode == "lockstep" || joined || alternate) {
    DdpOptions options;
    if (precision == "policy") {
      options.mixed_precision(MixedPrecision().param_dtype(at::kBFloat16));
    }
    if (const char* cap = std::getenv("BENCH_BUCKET_CAP_MB")) {
      options.bucket_cap_mb(std::atof(cap));
    }
    ddp.emplace(model, groups ? groups->replica : world, options);
  }
  // BENCH_HOOK=allreduce|fp16|bf16|powersgd:R: lockstep with that communication hook
  // (PowerSGD from the 3rd iteration, within the warm-up).
  std::string hook_name = std::getenv("BENCH_HOOK") ? std::getenv("BENCH_HOOK") : "";
  std::optional<PowerSGD> power_sgd;
  if (ddp && !hook_name.empty()) {
    if (hook_name == "allreduce") {
      ddp->register_comm_hook(hooks::allreduce());
    } else if (hook_name == "fp16") {
      ddp->register_comm_hook(hooks::fp16_compress());
    } else if (hook_name == "bf16") {
      ddp->register_comm_hook(hooks::bf16_compress());
    } else {
      int64_t r = std::atoll(hook_name.substr(hook_name.find(':') + 1).c_str());
      power_sgd.emplace(PowerSGDOptions().matrix_approximation_rank(r).start_powerSGD_iter(2));
      ddp->register_comm_hook(power_sgd->hook());
    }
  }
  // BENCH_OPTIMIZER=adam: Adam (two state tensors per parameter, read and
  // written at every step) instead of SGD without momentum.
  bool adam = std::getenv("BENCH_OPTIMIZER") && std::string(std::getenv("BENCH_OPTIMIZER")) == "adam";
  // BENCH_ZERO=1: that optimizer sharded (ZeroRedundancyOptimizer);
  // BENCH_STEP_IN_BACKWARD=1: it steps inside backward.
  std::string zero_setting = std::getenv("BENCH_ZERO") ? std::getenv("BENCH_ZERO") : "";
  bool zero = zero_setting == "1" || zero_setting == "slices";
  auto zero_options = ZeroOptions().partition(zero_setting == "slices" ? ZeroPartition::Elements
                                                                       : ZeroPartition::Parameters);
  bool in_backward = std::getenv("BENCH_STEP_IN_BACKWARD") &&
                     std::string(std::getenv("BENCH_STEP_IN_BACKWARD")) == "1";
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (adam && zero) {
    optimizer = std::make_unique<ZeroRedundancyOptimizer<torch::optim::Adam>>(
        model->parameters(), world, torch::optim::AdamOptions(1e-4), zero_options);
  } else if (adam) {
    optimizer = std::make_unique<torch::optim::Adam>(model->parameters(),
                                                     torch::optim::AdamOptions(1e-4));
  } else if (zero) {
    optimizer = std::make_unique<ZeroRedundancyOptimizer<torch::optim::SGD>>(
        model->parameters(), world, torch::optim::SGDOptions(1e-4), zero_options);
  } else {
    optimizer = std::make_unique<torch::optim::SGD>(model->parameters(),
                                                    torch::optim::SGDOptions(1e-4));
  }
  if (in_backward) {
    ddp->step_in_backward(*optimizer);
  }
  std::vector<std::unique_ptr<torch::optim::SGD>> outer;
  std::optional<DiLoCo> diloco;
  if (sync_every > 0) {
    auto parameters = model->parameters();
    std::vector<std::vector<torch::Tensor>> fragments(static_cast<size_t>(fragment_count));
    for (size_t i = 0; i < parameters.size(); ++i) {
      fragments[i * fragments.size() / parameters.size()].push_back(parameters[i]);
    }
    std::vector<torch::optim::Optimizer*> outer_pointers;
    for (const auto& fragment : fragments) {
      outer.push_back(std::make_unique<torch::optim::SGD>(
          fragment, torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true)));
      outer_pointers.push_back(outer.back().get());
    }
    auto options = DiLoCoOptions().sync_every(sync_every).fragment_sync_delay(delay);
    if (std::string(wire_name) == "bf16") {
      options.wire_dtype(at::kBFloat16);
    } else if (std::string(wire_name) == "fp16") {
      options.wire_dtype(at::kHalf);
    }
    diloco.emplace(groups->across, fragments, *optimizer, outer_pointers, options);
  }
  auto [x_host, y_host] = model_name == "transformer" ? lockstep::bench::deterministic_tokens()
                         : input_shape.empty()       ? lockstep::bench::deterministic_ids()
                                                     : lockstep::bench::deterministic_batch(input_shape);
  auto x = x_host.to(device);
  auto y = y_host.to(device);
  std::vector<double> times;
  std::vector<double> detail_times;
  // What a join guard costs when every rank has the same batches: one
  // agreement per forward.
  std::optional<JoinGuard> join;
  if (joined) {
    join.emplace(ddp->join());
  }
  double wire_at_start = -1;
  for (int i = 0; i < warmup + iterations; ++i) {
    if (i == warmup) {
      world.barrier();
      wire_at_start = wire_bytes();
    }
    // Every rank switches at the same iteration, as set_debug requires.
    bool detail = alternate && i >= warmup && ((i - warmup) / 5) % 2 == 1;
    if (alternate) {
      world.set_debug(detail ? DebugLevel::Detail : DebugLevel::Off);
    }
    auto start = std::chrono::steady_clock::now();
    optimizer->zero_grad();
    torch::Tensor loss;
    {
      std::optional<amp::Autocast> autocast;
      if (precision == "autocast") {
        autocast.emplace(device.type(), at::kBFloat16);
      }
      auto out = ddp ? (*ddp)(x) : model(x);
      loss = torch::nn::functional::cross_entropy(out.to(at::kFloat), y);
    }
    loss.backward();
    if (mode == "manual") {
      for (auto& param : model->parameters()) {
        world.all_reduce(param.mutable_grad(), ReduceOp::Average);
      }
    }
    if (diloco) {
      diloco->step();
    } else if (!in_backward) {
      optimizer->step();
    }
    if (cuda) {
      torch::cuda::synchronize(device.index());
    }
    if (i >= warmup) {
      (detail ? detail_times : times)
          .push_back(std::chrono::duration<double, std::milli>(
                         std::chrono::steady_clock::now() - start)
                         .count());
    }
  }
  auto wire = torch::tensor({(wire_bytes() - wire_at_start) / iterations}, torch::kDouble);
  if (join) {
    join->finish();
  }
  std::string reported = alternate ? "lockstep_ab" : mode;
  if (adam) {
    reported += "_adam";
  }
  if (zero) {
    reported += zero_setting == "slices" ? "_zero_slices" : "_zero";
  }
  if (in_backward) {
    reported += "_in_backward";
  }
  if (!precision.empty()) {
    reported += "_" + precision;
  }
  if (diloco_setting != nullptr) {
    reported += "_diloco_h" + std::to_string(sync_every) + "_f" + std::to_string(fragment_count) +
        "_d" + std::to_string(delay) + (wire_name[0] ? std::string("_") + wire_name : "");
    // A synchronisation costs one step in H: the mean, not the median.
    double total = 0;
    for (double t : times) {
      total += t;
    }
    times = {total / static_cast<double>(times.size())};
  }
  // The optimizer's state on this rank, as it saves (the largest over ranks).
  auto& stateful = zero ? dynamic_cast<lockstep::detail::ShardedOptimizer&>(*optimizer)
                              .local_optimizer()
                        : *optimizer;
  auto state_bytes =
      torch::tensor({static_cast<double>(saved_bytes(stateful))}, torch::kDouble);
  world.all_reduce(state_bytes, ReduceOp::Max);
  if (world.rank() == 0) {
    std::fprintf(stderr, "state,%s,%s,%.0f\n", model_name.c_str(), reported.c_str(),
                 state_bytes.item<double>());
  }
  if (!hook_name.empty()) {
    reported += "_" + hook_name.substr(0, hook_name.find(':'));
  }
  // What one iteration reduced, where a hook or the policy shapes it.
  if (ddp && (!hook_name.empty() || !precision.empty())) {
    if (world.rank() == 0) {
      std::fprintf(stderr, "bytes,%s,%s,%lld\n", model_name.c_str(), reported.c_str(),
                   static_cast<long long>(ddp->stats().last.bytes_reduced));
    }
  }
  if (wire_at_start >= 0) {
    world.all_reduce(wire, ReduceOp::Max);
    if (world.rank() == 0) {
      std::fprintf(stderr, "wire,%s,%s,%.0f\n", model_name.c_str(), reported.c_str(),
                   wire.item<double>());
    }
  }
  report(world, model_name, reported, times);
  if (alternate) {
    report(world, model_name, "lockstep_detail", detail_times);
  }
  if (ddp && !alternate && world.rank() == 0) {
    auto stats = ddp->stats();
    double n = static_cast<double>(stats.iterations);
    std::fprintf(stderr,
                 "%s: per iteration %.2f ms forward, %.2f ms backward of which "
                 "%.2f ms waiting for communication; %zu buckets\n",
                 model_name.c_str(), stats.total.forward_ms / n,
                 stats.total.backward_ms / n, stats.total.comm_wait_ms / n,
                 stats.bucket_bytes.size());
  }
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: ddp_bench MODEL MODE [ITERATIONS] [WARMUP]\n";
    return 2;
  }
  std::string model = argv[1];
  std::string mode = argv[2];
  int iterations = argc > 3 ? std::atoi(argv[3]) : 100;
  int warmup = argc > 4 ? std::atoi(argv[4]) : 10;
  at::set_num_threads(1);
  World world = init();
  using namespace lockstep::bench;
  if (model == "mlp" || model == "mlp_const") {
    run(world, Mlp(model == "mlp_const"), model, mode, {1024}, iterations, warmup);
  } else if (model == "cnn" || model == "cnn_bn") {
    run(world, Cnn(model == "cnn_bn"), model, mode, {1, 28, 28}, iterations, warmup);
  } else if (model == "cnn_syncbn") {
    Cnn cnn(/*batch_norm=*/true);
    convert_sync_batchnorm(*cnn, world);
    run(world, cnn, model, mode, {1, 28, 28}, iterations, warmup);
  } else if (model == "transformer") {
    run(world, Transformer(), model, mode, {}, iterations, warmup);
  } else if (model == "emb_sparse" || model == "emb_dense") {
    run(world, Recommender(model == "emb_sparse"), model, mode, {}, iterations, warmup);
  } else {
    std::cerr << "unknown model " << model << "\n";
    return 2;
  }
  return 0;
}
