// Where mixed precision meets the rest: BatchNorm and SyncBatchNorm under
// DDP's bfloat16 policy (kept in full precision, as PyTorch's FSDP keeps
// _BatchNorm), the GradScaler's reads of the device, and DiLoCo stepping
// through a GradScaler.

#include <atomic>
#include <limits>

#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/diloco.h>
#include <lockstep/fault_tolerance.h>
#include <lockstep/lockstep.h>

#include "support/expect_error.h"
#include "support/models.h"
#include "support/small_cnn.h"
#include "support/multiprocess.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

// What the wrapper must compute: a bfloat16 copy of the masters in which
// BatchNorm's parameters (and statistics) stay float32, each gradient
// averaged in bfloat16 (divided, rounded once, summed in float32), the
// masters stepped. Two ranks: every sum has two terms, exact in any order.
// `Model` is Cnn (plain BatchNorm2d, inputs 1x12x12) or SmallCnn
// (SyncBatchNorm, bound by the wrapper; 1x8x8).
template <typename Model>
void expect_hand_cast_loop(const std::function<Model()>& build, int64_t side) {
  run_ranks(2, [&build, side](int rank) {
    World world = init();
    Model model = build();
    Model masters = build();
    DDP<Model> ddp(model, world,
                   DdpOptions().mixed_precision(
                       lockstep::MixedPrecision().param_dtype(torch::kBFloat16)));
    // The hand's SyncBatchNorms normalise over the same world.
    for (const auto& module : masters->modules()) {
      if (auto* norm = dynamic_cast<SyncBatchNormImpl*>(module.get())) {
        norm->world = world;
      }
    }
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05));
    torch::optim::SGD reference(masters->parameters(), torch::optim::SGDOptions(0.05));
    auto is_norm = [](const std::string& name) {
      return name.rfind("bn", 0) == 0 || name.find(".norm.") != std::string::npos;
    };
    for (int64_t step = 0; step < 3; ++step) {
      auto [x, y] = global_batch(step, 8, {1, side, side});
      x = x.narrow(0, 4 * rank, 4).clone();
      y = y.narrow(0, 4 * rank, 4).clone();
      // By hand: the masters themselves, the others cast for the forward.
      std::vector<torch::Tensor> kept;
      {
        torch::NoGradGuard no_grad;
        for (auto& item : masters->named_parameters()) {
          kept.push_back(item.value().detach().clone());
          if (!is_norm(item.key())) {
            item.value().set_data(item.value().to(torch::kBFloat16));
          }
        }
      }
      torch::mse_loss(masters(x.to(torch::kBFloat16)).to(torch::kFloat), y).backward();
      {
        torch::NoGradGuard no_grad;
        size_t i = 0;
        for (auto& item : masters->named_parameters()) {
          auto gradient = item.value().grad().to(torch::kFloat);
          auto wire = (gradient / 2).to(torch::kBFloat16);
          world.all_reduce(wire, ReduceOp::Sum);
          item.value().set_data(kept[i++]);
          item.value().mutable_grad() = wire.to(torch::kFloat);
        }
      }
      reference.step();
      reference.zero_grad();
      // Through the wrapper.
      optimizer.zero_grad();
      auto output = ddp(x);
      EXPECT_EQ(output.scalar_type(), torch::kBFloat16);
      torch::mse_loss(output.to(torch::kFloat), y).backward();
      optimizer.step();
      for (const auto& item : masters->named_parameters()) {
        torch::Tensor ours = model->named_parameters()[item.key()];
        torch::Tensor theirs = item.value();
        ASSERT_EQ(ours.scalar_type(), torch::kFloat) << item.key();
        ASSERT_TRUE(torch::equal(ours, theirs))
            << item.key() << " after step " << step << " differs by "
            << (ours - theirs).abs().max().item<double>();
      }
      for (const auto& item : model->named_buffers()) {
        EXPECT_NE(item.value().scalar_type(), torch::kBFloat16) << item.key();
      }
    }
  });
}

class BatchNormUnderThePolicy : public ::testing::TestWithParam<bool> {};

TEST_P(BatchNormUnderThePolicy, RunsInFullPrecisionAsAHandCastLoop) {
  if (GetParam()) {
    expect_hand_cast_loop<SmallCnn>(
        [] {
          torch::manual_seed(7);
          return SmallCnn();
        },
        8);
  } else {
    expect_hand_cast_loop<Cnn>(
        [] {
          torch::manual_seed(7);
          return Cnn(/*batch_norm=*/true);
        },
        12);
  }
}

INSTANTIATE_TEST_SUITE_P(Norms, BatchNormUnderThePolicy, ::testing::Values(false, true),
                         [](const auto& info) {
                           return info.param ? "sync_batch_norm" : "batch_norm";
                         });

TEST(BatchNormUnderThePolicy, CastOnlyWithStatisticsOfItsDtype) {
  run_ranks(2, [](int) {
    World world = init();
    auto cast = lockstep::MixedPrecision().param_dtype(torch::kBFloat16).batch_norm_in_full_precision(false);
    expect_error<ConfigError>([&] { DDP<Cnn> ddp(Cnn(true), world, DdpOptions().mixed_precision(cast)); },
                              {"batch_norm_in_full_precision(false) computes 'bn1' (a BatchNorm) "
                               "in BFloat16", "set buffer_dtype(BFloat16)"});
    Cnn model(true);
    DDP<Cnn> ddp(model, world,
                 DdpOptions().mixed_precision(cast.buffer_dtype(torch::kBFloat16)));
    auto loss = ddp(torch::ones({4, 1, 12, 12})).to(torch::kFloat).sum();
    loss.backward();
    EXPECT_EQ(model->bn1->running_mean.scalar_type(), torch::kBFloat16);
  });
}

// The found-inf check reads the device once per step (PyTorch's
// _amp_foreach_non_finite_check_and_unscale_ makes none before the step),
// not once per parameter: counted as ATen's reads of a tensor's value.
TEST(GradScaler, ReadsTheDeviceOncePerStep) {
  Mlp model;
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  amp::GradScaler scaler;
  scaler.scale(model(torch::ones({2, 20})).sum()).backward();
  static std::atomic<int> reads{0};
  auto handle = at::addGlobalCallback(
      at::RecordFunctionCallback([](const at::RecordFunction& fn)
                                     -> std::unique_ptr<at::ObserverContext> {
        if (std::string(fn.name()) == "aten::_local_scalar_dense") {
          ++reads;
        }
        return nullptr;
      }).needsInputs(false));
  reads = 0;
  EXPECT_TRUE(scaler.step(optimizer));
  at::removeCallback(handle);
  EXPECT_EQ(model->parameters().size(), 6u);
  EXPECT_EQ(reads.load(), 1);
}

// Under FaultTolerance a rank that rejoins must receive the scale the
// others learned: a scaler that steps a guarded optimizer unregistered is
// refused by name, and steps once registered.
TEST(GradScaler, UnderFaultToleranceTravelsWithTheStateOrIsRefused) {
  auto world = init(WorldOptions().rank(0).size(1));
  Mlp model;
  DDP<Mlp> ddp(model, world);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  FaultTolerance ft(ddp, optimizer, FaultToleranceOptions().verbose(false));
  amp::GradScaler unregistered;
  amp::GradScaler registered;
  ft.register_state("grad_scaler", registered);
  ft.begin_step();
  registered.scale(ddp(torch::ones({2, 20})).sum()).backward();
  ASSERT_TRUE(ft.commit());
  expect_error<UsageError>([&] { unregistered.step(optimizer); },
                           {"is not registered with it", "ft.register_state(\"grad_scaler\", scaler)"});
  EXPECT_TRUE(registered.step(optimizer));
  registered.update();
}

// DiLoCo's inner step through a GradScaler: a replica whose step is skipped
// keeps its parameters, and the replicas still synchronise at the same
// calls (a skipped step counts), holding the same global parameters then.
TEST(DiLoCo, StepsThroughAGradScaler) {
  run_ranks(2, [](int rank) {
    World world = init();
    torch::manual_seed(3);
    Mlp model;
    torch::optim::SGD inner(model->parameters(), torch::optim::SGDOptions(0.05));
    torch::optim::SGD outer(model->parameters(),
                            torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
    DiLoCo diloco(world, {model->parameters()}, inner, {&outer},
                  DiLoCoOptions().sync_every(2));
    amp::GradScaler scaler(amp::GradScalerOptions().init_scale(256));
    for (int64_t step = 0; step < 6; ++step) {
      auto [x, y] = global_batch(step, 8, {20});
      x = x.narrow(0, 4 * rank, 4).clone();
      if (step == 2 && rank == 1) {
        x[0][0] = std::numeric_limits<float>::infinity();
      }
      inner.zero_grad();
      scaler.scale(torch::mse_loss(model(x), y.narrow(0, 4 * rank, 4))).backward();
      auto before = flatten(model->parameters());
      diloco.step(scaler);
      scaler.update();
      if (step == 2 && rank == 1) {
        EXPECT_TRUE(torch::equal(before, flatten(model->parameters()))) << "stepped on inf";
        EXPECT_EQ(scaler.get_scale(), 128.0);
      }
      EXPECT_EQ(diloco.local_step(), step + 1);
      if ((step + 1) % 2 == 0) {
        expect_same_on_every_rank(world, flatten(model->parameters()),
                                  "the global parameters after step " + std::to_string(step));
      }
    }
    EXPECT_EQ(diloco.syncs(), 3);
  });
}

} // namespace
} // namespace lockstep::testing
