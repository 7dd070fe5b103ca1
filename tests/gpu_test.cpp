// The CUDA path, where a GPU is: one rank per GPU (at most 2; one rank
// where the machine has one GPU, which still runs NCCL, device buckets and
// every device read), against one process on the same GPU in float64.
// Skipped where there is none (a CPU LibTorch, or no device); the model on
// two devices is refused on any machine.

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "support/expect_error.h"
#include "support/models.h"
#include "support/multiprocess.h"
#include "support/optimizers.h"
#include "support/scratch_folder.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

int gpu_ranks() {
  return static_cast<int>(std::min<size_t>(torch::cuda::device_count(), 2));
}

#define SKIP_WITHOUT_A_GPU()                                                        \
  if (gpu_ranks() == 0) {                                                           \
    GTEST_SKIP() << "no GPU here (torch::cuda::device_count() is 0): the CUDA path " \
                    "runs where one is";                                            \
  }

torch::Device gpu_of(const World& world) {
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(world.local_rank()));
}

TEST(Gpu, DdpMatchesOneProcessOnTheGpuInFloat64) {
  SKIP_WITHOUT_A_GPU();
  run_ranks(gpu_ranks(), [](int) {
    World world = init();
    SideBySide setup;
    setup.device = gpu_of(world);
    for (auto optimizer : {OptimizerKind::Sgd, OptimizerKind::Adam}) {
      setup.optimizer = optimizer;
      for (const auto& options :
           {DdpOptions(), DdpOptions().bucket_cap_mb(0).first_bucket_cap_mb(0),
            DdpOptions().find_unused_parameters(true).gradient_as_bucket_view(false)}) {
        train_side_by_side<Mlp>(world, [] { return Mlp(); }, options, setup, plain_forward);
        SideBySide cnn = setup;
        cnn.input_shape = {1, 12, 12};
        train_side_by_side<Cnn>(world, [] { return Cnn(); }, options, cnn, plain_forward);
      }
    }
  });
}

TEST(Gpu, SyncBatchNormMatchesOneBatchNormOnTheGpu) {
  SKIP_WITHOUT_A_GPU();
  run_ranks(gpu_ranks(), [](int rank) {
    World world = init();
    auto device = gpu_of(world);
    int n = world.size();
    const int64_t channels = 3, rows = 4;
    SyncBatchNorm sync(torch::nn::BatchNormOptions(channels), world);
    torch::nn::BatchNorm2d reference(channels);
    sync->to(device, torch::kDouble);
    reference->to(device, torch::kDouble);
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(50 + step);
      auto x = (torch::randn({rows * n, channels, 5, 4}, torch::kDouble) * 3 + 1e3).to(device);
      auto g = torch::randn({rows * n, channels, 5, 4}, torch::kDouble).to(device);
      auto x_mine = x.narrow(0, rank * rows, rows).clone().requires_grad_(true);
      auto x_all = x.clone().requires_grad_(true);
      auto y = sync(x_mine);
      auto y_all = reference(x_all);
      (y * g.narrow(0, rank * rows, rows)).sum().backward();
      (y_all * g).sum().backward();
      EXPECT_TRUE(y.allclose(y_all.narrow(0, rank * rows, rows), 0, kFloat64Tolerance));
      EXPECT_TRUE(x_mine.grad().allclose(x_all.grad().narrow(0, rank * rows, rows), 0,
                                         kFloat64Tolerance));
      EXPECT_TRUE(sync->running_var.allclose(reference->running_var, 0, kFloat64Tolerance));
      EXPECT_EQ(sync->running_mean.device(), device);
    }
  });
}

TEST(Gpu, BucketsLeaveWhileBackwardGoesOn) {
  SKIP_WITHOUT_A_GPU();
  run_ranks(gpu_ranks(), [](int rank) {
    World world = init();
    auto device = gpu_of(world);
    torch::manual_seed(4);
    Mlp model(256, 512, 256);
    model->to(device);
    DDP<Mlp> ddp(model, world, DdpOptions().first_bucket_cap_mb(0.25).bucket_cap_mb(0.5));
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = global_batch(step, 64 * world.size(), {256});
      model->zero_grad();
      ddp(x.narrow(0, 64 * rank, 64).to(device)).pow(2).mean().backward();
    }
    auto stats = ddp.stats();
    ASSERT_GT(stats.bucket_launch_ms.size(), 2u);
    EXPECT_LT(stats.bucket_launch_ms.front(), stats.backward_end_ms);
    EXPECT_LT(stats.bucket_launch_ms[1], stats.backward_end_ms);
  });
}

TEST(Gpu, HooksCompressOnTheDevice) {
  SKIP_WITHOUT_A_GPU();
  run_ranks(gpu_ranks(), [](int rank) {
    World world = init();
    auto device = gpu_of(world);
    PowerSGD power_sgd(PowerSGDOptions().start_powerSGD_iter(2));
    for (auto [name, hook] : {std::pair{"fp16", hooks::fp16_compress()},
                              {"bf16", hooks::bf16_compress()},
                              {"fp16 wrapper", hooks::fp16_wrapper(hooks::allreduce())},
                              {"PowerSGD", power_sgd.hook()}}) {
      torch::manual_seed(5);
      Mlp model;
      model->to(device);
      DDP<Mlp> ddp(model, world);
      ddp.register_comm_hook(hook);
      for (int step = 0; step < 4; ++step) {
        auto [x, y] = global_batch(step, 4 * world.size(), {20});
        model->zero_grad();
        torch::mse_loss(ddp(x.narrow(0, 4 * rank, 4).to(device)),
                        y.narrow(0, 4 * rank, 4).to(device))
            .backward();
      }
      std::vector<torch::Tensor> grads;
      for (const auto& param : model->parameters()) {
        grads.push_back(param.grad());
      }
      auto gradients = flatten(grads);
      EXPECT_TRUE(torch::isfinite(gradients).all().item<bool>()) << name;
      expect_same_on_every_rank(world, gradients, name);
    }
  });
}

// ZeRO's broadcasts and the step inside backward move device tensors:
// each way must step the parameters exactly as plain DDP and Adam do on
// the same GPU (the same arithmetic in the same order: bit for bit).
TEST(Gpu, ZeroAndTheStepInBackwardMatchPlainDdpBitForBit) {
  SKIP_WITHOUT_A_GPU();
  run_ranks(gpu_ranks(), [](int rank) {
    World world = init();
    auto device = gpu_of(world);
    auto train = [&](std::optional<Way> way) {
      Mlp model = float64_mlp(11);
      model->to(device);
      DDP<Mlp> ddp(model, world, one_parameter_per_bucket());
      auto optimizer = way ? optimizer_of(*way, Kind::Adam, ddp, world)
                           : plain_optimizer(Kind::Adam, model->parameters());
      for (int step = 0; step < 4; ++step) {
        auto [x, y] = batch(step, world.size());
        optimizer->zero_grad();
        torch::mse_loss(ddp(shard(x, rank, kPerRank).to(device)),
                        shard(y, rank, kPerRank).to(device))
            .backward();
        if (!way || *way == Way::Zero) {
          optimizer->step();
        }
      }
      return model;
    };
    Mlp expected = train(std::nullopt);
    for (auto way : {Way::InBackward, Way::Zero, Way::ZeroInBackward}) {
      Mlp actual = train(way);
      expect_bit_identical(*actual, *expected, name_of(way));
      expect_same_on_every_rank(world, flatten(actual->parameters()), name_of(way));
    }
  });
}

TEST(Gpu, CheckReplicasReadsTheDeviceTensors) {
  SKIP_WITHOUT_A_GPU();
  run_ranks(gpu_ranks(), [](int rank) {
    World world = init();
    torch::manual_seed(3);
    Mlp model;
    model->to(gpu_of(world));
    DDP<Mlp> ddp(model, world, DdpOptions().verify_every(1));
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    for (int step = 0; step < 2; ++step) {
      optimizer.zero_grad();
      auto [x, y] = global_batch(step, 4, {20});
      torch::mse_loss(ddp(x.to(gpu_of(world))), y.to(gpu_of(world))).backward();
      optimizer.step();
    }
    ddp.check_replicas();
    if (world.size() > 1) {
      {
        torch::NoGradGuard no_grad;
        if (rank == 1) {
          model->parameters()[0].add_(1.0);
        }
      }
      expect_error<UsageError>([&] { ddp.check_replicas(); }, {"differ"});
    }
  });
}

TEST(Gpu, ACheckpointGoesFromTheGpuToTheCpuAndBack) {
  SKIP_WITHOUT_A_GPU();
  ScratchFolder folder("gpu-checkpoint");
  auto result = launch_ranks(with_shared_folder(1, folder.path()), [](int) {
    World world = init();
    std::string dir = shared_folder();
    auto train = [&](Mlp& model, torch::optim::SGD& optimizer, torch::Device device) {
      auto [x, y] = global_batch(0, 4, {20});
      optimizer.zero_grad();
      torch::mse_loss(model(x.to(device)), y.to(device)).backward();
      optimizer.step();
    };
    auto make = [](torch::Device device) {
      torch::manual_seed(device.is_cuda() ? 1 : 2); // different, so that loading shows
      Mlp model;
      model->to(device);
      return model;
    };
    auto sgd = [](Mlp& model) {
      return torch::optim::SGD(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    };
    auto same = [](Mlp& a, Mlp& b) {
      auto pa = a->parameters(), pb = b->parameters();
      for (size_t i = 0; i < pa.size(); ++i) {
        EXPECT_TRUE(pa[i].to(torch::kCPU).equal(pb[i].to(torch::kCPU))) << "parameter " << i;
      }
    };
    torch::Device gpu = gpu_of(world);
    Mlp on_gpu = make(gpu);
    auto gpu_optimizer = sgd(on_gpu);
    train(on_gpu, gpu_optimizer, gpu);
    save_checkpoint(world, dir + "/from-gpu.pt", *on_gpu, gpu_optimizer);

    Mlp on_cpu = make(torch::kCPU);
    auto cpu_optimizer = sgd(on_cpu);
    load_checkpoint(world, dir + "/from-gpu.pt", *on_cpu, cpu_optimizer);
    same(on_cpu, on_gpu);
    // The momentum came along: one more step agrees on both.
    train(on_cpu, cpu_optimizer, torch::kCPU);
    train(on_gpu, gpu_optimizer, gpu);
    for (size_t i = 0; i < on_cpu->parameters().size(); ++i) {
      EXPECT_TRUE(on_cpu->parameters()[i].allclose(on_gpu->parameters()[i].to(torch::kCPU),
                                                   1e-5, 1e-6));
    }
    save_checkpoint(world, dir + "/from-cpu.pt", *on_cpu, cpu_optimizer);
    Mlp back = make(gpu);
    auto back_optimizer = sgd(back);
    load_checkpoint(world, dir + "/from-cpu.pt", *back, back_optimizer);
    same(back, on_cpu);
    EXPECT_EQ(back->parameters()[0].device(), gpu);
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

struct TwoDevicesImpl : torch::nn::Module {
  TwoDevicesImpl() {
    register_parameter("on_cpu", torch::zeros({3}));
    register_parameter("on_meta", torch::empty({3}, torch::kMeta));
  }
  torch::Tensor forward(torch::Tensor x) {
    return x;
  }
};
TORCH_MODULE(TwoDevices);

TEST(Devices, AModelOnTwoDevicesIsRefusedByName) {
  // The meta device stands for a second device on any machine.
  run_ranks(1, [](int) {
    World world = init();
    TwoDevices model;
    expect_error<UsageError>(
        [&] { DDP<TwoDevices> ddp(model, world); },
        {"the model's tensors live on more than one device: 'on_cpu' on cpu and 'on_meta' on "
         "meta", "module->to(device) before wrapping it"});
  });
}

} // namespace
} // namespace lockstep::testing
