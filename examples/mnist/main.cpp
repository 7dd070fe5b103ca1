// The main job: a CNN trained on real MNIST, data-parallel with lockstep.
//
//   lockstep-run --nproc-per-node 2 -- mnist_train --data data/mnist --epochs 1
//
// Each rank trains on its shard (lockstep::DistributedSampler, a new shuffle
// per epoch); rank 0 shows progress. After each epoch the whole test set is
// scored, sharded over the ranks, and a checkpoint is written.

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>

#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include <lockstep/replica_groups.h>

#include "across_replicas.h"
#include "flags.h"
#include "net.h"

namespace {

using mnist::Net;


using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

auto dataset(const std::string& root, torch::data::datasets::MNIST::Mode mode) {
  return torch::data::datasets::MNIST(root, mode)
      .map(torch::data::transforms::Normalize<>(0.1307, 0.3081))
      .map(torch::data::transforms::Stack<>());
}

// Correct predictions over the whole test set, each rank scoring its shard.
double test_accuracy(lockstep::World& world, Net& model, const std::string& root) {
  torch::NoGradGuard no_grad;
  model->eval();
  auto test = dataset(root, torch::data::datasets::MNIST::Mode::kTest);
  size_t size = test.size().value();
  torch::data::samplers::DistributedSequentialSampler sampler(
      size, world.size(), world.rank(), /*allow_duplicates=*/false);
  auto loader = torch::data::make_data_loader(
      std::move(test), std::move(sampler),
      torch::data::DataLoaderOptions().batch_size(500));
  auto counts = torch::zeros({2}, torch::kDouble); // correct, seen
  for (auto& batch : *loader) {
    auto predicted = model(batch.data).argmax(1);
    counts[0] += predicted.eq(batch.target).sum().item<int64_t>();
    counts[1] += batch.target.size(0);
  }
  world.all_reduce(counts);
  model->train();
  return counts[0].item<double>() / counts[1].item<double>();
}

void show_progress(bool terminal, int64_t epoch, int64_t epochs, int64_t step,
                   int64_t steps, double loss, double images_per_second,
                   int64_t log_every) {
  if (terminal) {
    int width = 30;
    int filled = static_cast<int>(width * step / std::max<int64_t>(steps, 1));
    std::printf("\repoch %lld/%lld [%s%s] step %lld/%lld  loss %.4f  %.0f images/s ",
                static_cast<long long>(epoch), static_cast<long long>(epochs),
                std::string(filled, '=').c_str(), std::string(width - filled, ' ').c_str(),
                static_cast<long long>(step), static_cast<long long>(steps), loss,
                images_per_second);
    std::fflush(stdout);
  } else if (step % log_every == 0 || step == steps) {
    std::printf("epoch %lld/%lld step %lld/%lld loss %.4f %.0f images/s\n",
                static_cast<long long>(epoch), static_cast<long long>(epochs),
                static_cast<long long>(step), static_cast<long long>(steps), loss,
                images_per_second);
    std::fflush(stdout);
  }
}

// For the restart tests: LOCKSTEP_MNIST_CRASH="epoch:step:rank" kills that
// rank there, in the first attempt only.
void maybe_crash(const lockstep::World& world, int64_t epoch, int64_t step) {
  const char* spec = std::getenv("LOCKSTEP_MNIST_CRASH");
  const char* attempt = std::getenv("LOCKSTEP_RESTART_COUNT");
  if (spec == nullptr || (attempt != nullptr && std::string(attempt) != "0")) {
    return;
  }
  long crash_epoch = 0, crash_step = 0, crash_rank = 0;
  if (std::sscanf(spec, "%ld:%ld:%ld", &crash_epoch, &crash_step, &crash_rank) == 3 &&
      crash_epoch == epoch && crash_step == step && crash_rank == world.rank()) {
    std::fprintf(stderr, "rank %d: killing itself at epoch %ld step %ld (LOCKSTEP_MNIST_CRASH)\n",
                 world.rank(), crash_epoch, crash_step);
    std::raise(SIGKILL);
  }
}

// SGD with momentum or Adam, whole on each rank or sharded across ranks.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const mnist::Flags& flags,
                                                        std::vector<torch::Tensor> params,
                                                        lockstep::World& world) {
  using lockstep::ZeroRedundancyOptimizer;
  auto sgd = torch::optim::SGDOptions(flags.lr).momentum(0.9);
  auto adam = torch::optim::AdamOptions(flags.lr);
  if (flags.optimizer == "adam") {
    if (flags.zero) {
      return std::make_unique<ZeroRedundancyOptimizer<torch::optim::Adam>>(params, world, adam);
    }
    return std::make_unique<torch::optim::Adam>(params, adam);
  }
  if (flags.zero) {
    return std::make_unique<ZeroRedundancyOptimizer<torch::optim::SGD>>(params, world, sgd);
  }
  return std::make_unique<torch::optim::SGD>(params, sgd);
}

int run(const mnist::Flags& flags) {
  at::set_num_threads(flags.threads);
  mnist::require_data(flags.data);
  std::string checkpoint;
  if (!flags.checkpoint_dir.empty()) {
    std::filesystem::create_directories(flags.checkpoint_dir);
    checkpoint = flags.checkpoint_dir + "/checkpoint.pt";
    mnist::require_writable_checkpoint(checkpoint);
  }
  lockstep::World world = lockstep::init();
  bool lead = world.rank() == 0;
  if (lead) {
    std::printf("%d rank(s); collectives through %s\n", world.size(), world.transport().c_str());
    std::fflush(stdout);
  }
  torch::manual_seed(flags.seed);
  Net model(flags.batch_norm);
  if (flags.sync_bn) {
    lockstep::convert_sync_batchnorm(*model, world);
  }
  // Under --diloco and --local-sgd, DDP runs within a replica only.
  bool replicated = flags.diloco > 0 || flags.local_sgd > 0;
  std::optional<lockstep::ReplicaGroups> groups;
  if (replicated) {
    groups = lockstep::replica_groups(world, static_cast<int>(flags.replica_ranks));
  }
  lockstep::DdpOptions ddp_options;
  if (flags.mixed_precision) {
    ddp_options.mixed_precision(lockstep::MixedPrecision().param_dtype(torch::kBFloat16));
  }
  lockstep::DDP<Net> ddp(model, groups ? groups->replica : world, ddp_options);
  std::optional<lockstep::PowerSGD> power_sgd;
  if (flags.comm_hook == "fp16") {
    ddp.register_comm_hook(lockstep::hooks::fp16_compress());
  } else if (flags.comm_hook == "bf16") {
    ddp.register_comm_hook(lockstep::hooks::bf16_compress());
  } else if (flags.comm_hook == "powersgd") {
    power_sgd.emplace(lockstep::PowerSGDOptions()
                          .matrix_approximation_rank(flags.powersgd_rank)
                          .start_powerSGD_iter(10));
    ddp.register_comm_hook(power_sgd->hook());
  }
  auto owned_optimizer = make_optimizer(flags, model->parameters(), world);
  auto& optimizer = *owned_optimizer;
  if (flags.step_in_backward) {
    ddp.step_in_backward(optimizer);
  }
  std::optional<mnist::AcrossReplicas> across;
  if (replicated) {
    across.emplace(flags, groups->across, *model, optimizer);
  }
  std::ofstream loss_log;
  if (lead && !flags.loss_log.empty()) {
    loss_log.open(flags.loss_log, std::ios::app);
  }
  lockstep::CheckpointItems saved;
  saved.module("model", *model).optimizer("optimizer", optimizer);
  if (power_sgd) {
    saved.hook_state("powersgd", *power_sgd);
  }

  int64_t first_epoch = 1;
  if (flags.resume && !checkpoint.empty() && lockstep::checkpoint_exists(checkpoint)) {
    auto extra = lockstep::load_checkpoint(world, checkpoint, saved);
    first_epoch = extra.epoch + 1;
    if (lead) {
      std::printf("resumed from %s after epoch %lld (test accuracy then %.2f%%)\n",
                  checkpoint.c_str(), static_cast<long long>(extra.epoch),
                  100.0 * extra.values["test_accuracy"]);
    }
  }

  auto train = dataset(flags.data, torch::data::datasets::MNIST::Mode::kTrain);
  size_t train_size = train.size().value();
  bool terminal = lead && ::isatty(STDOUT_FILENO);
  auto start = Clock::now();
  int64_t images = 0;
  int64_t steps_taken = 0;
  double accuracy = 0;
  // Each rank its shard of a new shuffle per epoch, as PyTorch's
  // DistributedSampler draws it; set_epoch reaches the loader's copy.
  lockstep::DistributedSampler sampler(train_size, world,
                                       lockstep::DistributedSamplerOptions().drop_last(true));
  auto loader = torch::data::make_data_loader(
      train, sampler, torch::data::DataLoaderOptions().batch_size(flags.batch_size));
  for (int64_t epoch = first_epoch; epoch <= flags.epochs; ++epoch) {
    sampler.set_epoch(epoch);
    auto shard = static_cast<int64_t>(sampler.size());
    int64_t steps = (shard + flags.batch_size - 1) / flags.batch_size;
    if (flags.max_steps > 0) {
      steps = std::min(steps, flags.max_steps);
    }
    if (flags.uneven) {
      // Ranks that run out shadow the others inside the join guard below.
      steps = std::max<int64_t>(1, steps * std::max(1, 10 - world.rank()) / 10);
    }
    auto epoch_start = Clock::now();
    int64_t step = 0;
    int64_t epoch_images = 0;
    std::optional<lockstep::JoinGuard> join;
    if (flags.uneven) {
      join.emplace(ddp.join(lockstep::JoinOptions().optimizers({&optimizer})));
    }
    for (auto& batch : *loader) {
      if (step == steps) {
        break;
      }
      ++step;
      maybe_crash(world, epoch, step);
      lockstep::TimelineSpan step_span("training step");
      optimizer.zero_grad();
      torch::Tensor loss;
      {
        std::optional<lockstep::amp::Autocast> autocast;
        if (flags.autocast) {
          autocast.emplace(torch::kCPU, torch::kBFloat16);
        }
        // In float32 whatever the forward computed in.
        loss = torch::nll_loss(ddp(batch.data).to(torch::kFloat), batch.target);
      }
      loss.backward();
      if (across) {
        across->step();
      } else if (!flags.step_in_backward) {
        lockstep::TimelineSpan span("optimizer step");
        optimizer.step();
      }
      if (loss_log.is_open()) {
        loss_log << ++steps_taken << " " << loss.item<double>() << "\n";
      }
      images += batch.data.size(0) * world.size();
      epoch_images += batch.data.size(0) * world.size();
      if (lead) {
        double rate = epoch_images / seconds_since(epoch_start);
        show_progress(terminal, epoch, flags.epochs, step, steps, loss.item<double>(),
                      rate, flags.log_every);
      }
    }
    if (terminal) {
      std::printf("\n");
    }
    if (join) {
      join->finish();
      if (lead) {
        std::printf("epoch %lld: every rank finished its batches (rank 0 had %lld, the most); "
                    "replicas joined\n", static_cast<long long>(epoch),
                    static_cast<long long>(steps));
      }
    }
    // Each rank's BatchNorm statistics follow its own shard until the next
    // forward through the wrapper syncs them; the evaluation below goes
    // around it, so every rank takes rank 0's first (nothing without
    // BatchNorm).
    ddp.sync_buffers();
    {
      // Replicas that synchronise every H steps differ between two
      // synchronisations: their mean is scored.
      std::optional<mnist::AveragedParameters> averaged;
      if (replicated) {
        averaged.emplace(world, *model);
      }
      accuracy = test_accuracy(world, model, flags.data);
    }
    if (lead) {
      std::printf("epoch %lld: test accuracy %.2f%%\n", static_cast<long long>(epoch),
                  100.0 * accuracy);
      std::fflush(stdout);
    }
    if (!checkpoint.empty()) {
      lockstep::CheckpointExtra extra;
      extra.epoch = epoch;
      extra.step = step;
      extra.values["test_accuracy"] = accuracy;
      lockstep::save_checkpoint(world, checkpoint, saved, extra);
    }
  }
  double wall = seconds_since(start);
  if (lead) {
    std::printf("final test accuracy %.2f%% | %d ranks | wall time %.1f s | %.0f images/s\n",
                100.0 * accuracy, world.size(), wall, images / wall);
  }
  if (!flags.save_parameters.empty() && lead) {
    // Raw bytes, so that two runs compare bit for bit with cmp.
    std::ofstream out(flags.save_parameters, std::ios::binary);
    for (const auto& param : model->parameters()) {
      auto data = param.detach().contiguous();
      out.write(static_cast<const char*>(data.data_ptr()),
                static_cast<std::streamsize>(data.numel() * data.element_size()));
    }
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  try {
    auto flags = mnist::parse_flags(argc, argv);
    if (flags.help) {
      std::cout << mnist::kUsage;
      return 0;
    }
    return run(flags);
  } catch (const mnist::FlagError& e) {
    std::cerr << "mnist_train: " << e.what() << "\n" << mnist::kUsage;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}
