// The float64 MLP of elastic_float64, trained by replica groups under
// lockstep::FaultTolerance (torchft's FT-HSDP): FSDP inside each group
// (LOCKSTEP_TEST_INNER=ddp: DDP; zero: DDP and a ZeroRedundancyOptimizer
// over the group; zero2: the same, the gradients sharded too; syncbn: DDP
// of the MLP with a SyncBatchNorm, which normalises over the group) of
// LOCKSTEP_TEST_GROUP_SIZE ranks (2 by
// default), fault-tolerant across the groups, for the test that compares
// each committed step with one process (tests/fault_groups_test.cpp):
//   groups_float64 STEPS OUT_DIR [PAUSE_MS]
// It logs as elastic_float64 does (OUT_DIR/rank-R.log, parameters.bin,
// pid-R; with syncbn, each rank's running statistics at the end in
// statistics-R.bin). LOCKSTEP_TEST_KILLS (support/kill_plan.h) kills a rank, at the
// first step from STEP on that every group trains, in PHASE: begin, forward,
// commit (before commit: the others wait in the reduction across groups)
// or step (after commit); or, whatever the step, rejoin (while it receives
// the live state, once the state's transfer has begun).

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include <torch/torch.h>

#include <lockstep/fsdp.h>
#include <lockstep/lockstep.h>

#include "support/kill_plan.h"
#include "support/models.h"
#include "support/normed_mlp.h"

namespace {

int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value ? std::atoi(value) : fallback;
}

} // namespace

int train(int argc, char** argv) {
  int64_t steps = argc > 1 ? std::atoll(argv[1]) : 20;
  std::string out = argc > 2 ? argv[2] : ".";
  int pause_ms = argc > 3 ? std::atoi(argv[3]) : 0;
  const int replica = env_int("RANK", 0);
  const int incarnation = env_int("LOCKSTEP_INCARNATION", 0);
  const int world_size = env_int("WORLD_SIZE", 1);
  const int group_size = env_int("LOCKSTEP_TEST_GROUP_SIZE", 2);
  const char* inner = std::getenv("LOCKSTEP_TEST_INNER");
  const std::string inside = inner != nullptr ? inner : "fsdp";
  const bool zero = inside == "zero" || inside == "zero2";
  const bool normed = inside == "syncbn";
  const bool use_ddp = inside == "ddp" || zero || normed;
  auto kills = lockstep::testing::planned_kills();
  int64_t now_step = 0;
  bool whole = false;
  auto maybe_die = [&](const std::string& phase) {
    for (const auto& kill : kills) {
      if (kill.replica == replica && kill.incarnation == incarnation && kill.phase == phase &&
          (phase == "rejoin" || (whole && now_step >= kill.step))) {
        std::raise(SIGKILL);
      }
    }
  };

  torch::set_num_threads(1);
  std::ofstream(out + "/pid-" + std::to_string(replica)) << ::getpid() << "\n";
  auto world = lockstep::init();
  auto groups = lockstep::replica_groups(world, group_size);
  torch::manual_seed(7);
  lockstep::testing::Mlp model{nullptr};
  lockstep::testing::NormedMlp normed_model{nullptr};
  if (normed) {
    normed_model = lockstep::testing::NormedMlp();
    normed_model->to(torch::kDouble);
  } else {
    model = lockstep::testing::Mlp();
    model->to(torch::kDouble);
  }
  torch::nn::Module& trained = normed ? *normed_model : static_cast<torch::nn::Module&>(*model);
  std::unique_ptr<lockstep::DDP<lockstep::testing::Mlp>> ddp;
  std::unique_ptr<lockstep::DDP<lockstep::testing::NormedMlp>> normed_ddp;
  std::unique_ptr<lockstep::FullyShardedDataParallel<lockstep::testing::Mlp>> fsdp;
  std::vector<torch::Tensor> stepped;
  if (normed) {
    normed_ddp =
        std::make_unique<lockstep::DDP<lockstep::testing::NormedMlp>>(normed_model, groups.replica);
    stepped = normed_model->parameters();
  } else if (use_ddp) {
    ddp = std::make_unique<lockstep::DDP<lockstep::testing::Mlp>>(
        model, groups.replica, lockstep::DdpOptions().shard_gradients(inside == "zero2"));
    stepped = model->parameters();
  } else {
    fsdp = std::make_unique<lockstep::FullyShardedDataParallel<lockstep::testing::Mlp>>(
        model, groups.replica);
    stepped = fsdp->parameters();
  }
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  std::unique_ptr<torch::optim::Optimizer> optimizing;
  if (zero) {
    // Each rank of a group steps its shard; the same place in every group
    // owns the same one.
    optimizing = std::make_unique<lockstep::ZeroRedundancyOptimizer<torch::optim::SGD>>(
        stepped, groups.replica, sgd,
        lockstep::ZeroOptions().partition(inside == "zero2" ? lockstep::ZeroPartition::Elements
                                                            : lockstep::ZeroPartition::Parameters));
    if (inside == "zero2") {
      ddp->shard_gradients_with(*optimizing);
    }
  } else {
    optimizing = std::make_unique<torch::optim::SGD>(stepped, sgd);
  }
  auto& optimizer = *optimizing;
  lockstep::FaultTolerance ft(groups, trained, optimizer,
                              lockstep::FaultToleranceOptions()
                                  .heartbeat_timeout(std::chrono::milliseconds(1000))
                                  .step_timeout(std::chrono::seconds(60))
                                  .timeout(std::chrono::seconds(120)));
  auto scheduler = std::make_unique<torch::optim::StepLR>(optimizer, 50, 0.5);
  int64_t scheduled = 0;
  ft.register_state(
      "scheduler",
      [&](torch::serialize::OutputArchive& archive) {
        archive.write("steps", torch::tensor(scheduled));
      },
      [&](torch::serialize::InputArchive& archive) {
        maybe_die("rejoin");
        torch::Tensor count;
        archive.read("steps", count);
        for (auto& group : optimizer.param_groups()) {
          static_cast<torch::optim::SGDOptions&>(group.options()).lr(0.1);
        }
        scheduler = std::make_unique<torch::optim::StepLR>(optimizer, 50, 0.5);
        for (scheduled = 0; scheduled < count.item<int64_t>(); ++scheduled) {
          scheduler->step();
        }
      });
  // Powers of two: scaling leaves every float64 gradient exact.
  lockstep::amp::GradScaler scaler(lockstep::amp::GradScalerOptions().growth_interval(20));
  ft.register_state("scaler", scaler);

  torch::manual_seed(11);
  auto inputs = torch::randn({120, 20}, torch::kDouble);
  auto targets = torch::randn({120, 5}, torch::kDouble);
  lockstep::StepSampler sampler(120, lockstep::StepSamplerOptions().global_batch_size(12));
  std::ofstream log(out + "/rank-" + std::to_string(replica) + ".log", std::ios::app);
  auto full_parameters = [&] {
    std::vector<torch::Tensor> flat;
    if (use_ddp) {
      for (const auto& param : trained.parameters()) {
        flat.push_back(param.detach().flatten());
      }
    } else {
      for (const auto& item : fsdp->full_parameters()) {
        flat.push_back(item.value().flatten());
      }
    }
    return torch::cat(flat);
  };
  while (ft.step() < steps) {
    now_step = ft.step();
    maybe_die("begin");
    ft.begin_step();
    now_step = ft.step();
    whole = ft.world().size() * group_size == world_size;
    // This rank's share: its group's place among the groups that train.
    int rank = ft.world().rank() * group_size + groups.replica.rank();
    auto index = torch::tensor(
        sampler.indices(ft.step(), rank, ft.world().size() * group_size), torch::kLong);
    optimizer.zero_grad();
    maybe_die("forward");
    auto x = inputs.index_select(0, index);
    auto error = (normed ? (*normed_ddp)(x) : use_ddp ? (*ddp)(x) : (*fsdp)(x)) -
        targets.index_select(0, index);
    scaler.scale(error.pow(2).mean()).backward();
    maybe_die("commit");
    auto totals = ft.commit(torch::stack(
        {error.detach().pow(2).sum(),
         torch::tensor(static_cast<double>(index.numel()), torch::kDouble)}));
    if (!totals) {
      continue;
    }
    maybe_die("step");
    scaler.step(optimizer);
    scaler.update();
    scheduler->step();
    ++scheduled;
    char line[160];
    std::snprintf(line, sizeof(line), "%lld %d %.17g %.17g %g\n",
                  static_cast<long long>(ft.step()), ft.world().size() * group_size,
                  full_parameters().sum().item<double>(), (*totals)[0].item<double>(),
                  (*totals)[1].item<double>());
    log << line << std::flush;
    std::this_thread::sleep_for(std::chrono::milliseconds(whole ? pause_ms : 10 * pause_ms));
  }
  auto last = full_parameters();
  if (ft.world().rank() == 0 && groups.replica.rank() == 0) {
    std::ofstream(out + "/parameters.bin", std::ios::binary)
        .write(static_cast<const char*>(last.data_ptr()), last.numel() * sizeof(double));
  }
  if (normed) {
    auto statistics = normed_model->statistics().contiguous();
    std::ofstream(out + "/statistics-" + std::to_string(replica) + ".bin", std::ios::binary)
        .write(static_cast<const char*>(statistics.data_ptr()),
               statistics.numel() * sizeof(double));
  }
  auto stats = ft.stats();
  std::printf("groups_float64: rank %d: %lld steps, %lld dropped, %lld world(s) formed\n",
              replica, static_cast<long long>(ft.step()),
              static_cast<long long>(stats.aborted_steps),
              static_cast<long long>(stats.worlds_formed));
  return 0;
}

int main(int argc, char** argv) {
  try {
    return train(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "groups_float64: rank %s: %s\n",
                 std::getenv("RANK") ? std::getenv("RANK") : "0", e.what());
    return 1;
  }
}
