// Bad input to DistributedDataParallel: each raises, on every rank, an error
// whose text says what, where and how to fix it; none hangs.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "support/expect_error.h"
#include "support/models.h"
#include "support/multiprocess.h"
#include "support/optimizers.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

using torch::nn::Linear;
using torch::nn::ReLU;
using torch::nn::Sequential;

class DdpErrors : public ::testing::TestWithParam<int> {};

// Every rank but the last builds `usual`; the last builds `odd`. Every rank
// must raise the same error.
void expect_model_mismatch(
    World& world,
    const std::function<Sequential()>& usual,
    const std::function<Sequential()>& odd,
    std::initializer_list<std::string> fragments) {
  int last = world.size() - 1;
  Sequential model = world.rank() == last ? odd() : usual();
  expect_error<UsageError>([&] { DDP<Sequential> ddp(model, world); }, fragments);
}

TEST_P(DdpErrors, ModelsThatDiffer) {
  run_ranks(GetParam(), [](int) {
    World world = init();
    std::string last = "rank " + std::to_string(world.size() - 1) + ": ";
    auto usual = [] { return Sequential(Linear(20, 32), ReLU(), Linear(32, 5)); };
    auto fragments_for = [&](const std::string& mine, const std::string& theirs) {
      return std::vector<std::string>{
          "the model differs across ranks at entry", "rank 0", mine,
          last + theirs, "Every rank must build the same model"};
    };
    {
      SCOPED_TRACE("width");
      auto f = fragments_for("parameter '0.weight': Float [32, 20]",
                             "parameter '0.weight': Float [33, 20]");
      expect_model_mismatch(
          world, usual,
          [] { return Sequential(Linear(20, 33), ReLU(), Linear(33, 5)); },
          {f[0], f[1], f[2], f[3], f[4]});
    }
    {
      SCOPED_TRACE("an extra layer");
      auto f = fragments_for("nothing (fewer entries)",
                             "parameter '3.weight': Float [5, 5]");
      expect_model_mismatch(
          world, usual,
          [] { return Sequential(Linear(20, 32), ReLU(), Linear(32, 5), Linear(5, 5)); },
          {"at entry 4", f[2], f[3], "rank 0 has 4 entries"});
    }
    {
      SCOPED_TRACE("other names");
      auto f = fragments_for("parameter '0.weight'", "parameter 'input.weight'");
      expect_model_mismatch(
          world, usual,
          [] {
            return Sequential({{"input", Linear(20, 32)},
                               {"act", ReLU()},
                               {"output", Linear(32, 5)}});
          },
          {f[0], f[2], f[3]});
    }
    {
      SCOPED_TRACE("another dtype");
      auto f = fragments_for("parameter '0.weight': Float [32, 20]",
                             "parameter '0.weight': Double [32, 20]");
      expect_model_mismatch(
          world, usual,
          [&] {
            auto model = usual();
            model->to(torch::kDouble);
            return model;
          },
          {f[0], f[2], f[3]});
    }
  });
}

TEST_P(DdpErrors, StaticGraphViolationNamesTheParameter) {
  run_ranks(GetParam(), [](int rank) {
    World world = init();
    torch::manual_seed(7);
    Branchy model;
    DDP<Branchy> ddp(model, world, DdpOptions().static_graph(true));
    for (int step = 0; step < 2; ++step) {
      auto [x, y] = global_batch(step, 4 * world.size(), {20});
      // Step 1: rank 0 alone switches to another head.
      int64_t head = step == 1 && rank == 0 ? 1 : 0;
      auto loss = torch::mse_loss(ddp(x.narrow(0, 4 * rank, 4), head),
                                  y.narrow(0, 4 * rank, 4));
      if (step == 0) {
        loss.backward();
        continue;
      }
      expect_error<UsageError>(
          [&] { loss.backward(); },
          {"iteration 2 broke a rule on 1 rank(s):\n  rank 0: parameter",
           "parameter 'head_b.weight' got a gradient in iteration 2 but not "
           "in the first one, which static_graph froze.",
           "parameter 'head_a.weight' got no gradient in iteration 2 but did "
           "in the first one"});
    }
  });
}

TEST_P(DdpErrors, BypassAsAnError) {
  run_ranks(GetParam(), [](int rank) {
    World world = init();
    torch::manual_seed(8);
    Mlp model;
    DDP<Mlp> ddp(model, world, DdpOptions().bypass(Bypass::Error));
    auto [x, y] = global_batch(0, 4 * world.size(), {20});
    auto shard = x.narrow(0, 4 * rank, 4);
    auto target = y.narrow(0, 4 * rank, 4);
    expect_error<UsageError>(
        [&] { torch::mse_loss(ddp.module()(shard), target).backward(); },
        {"rank " + std::to_string(rank) + ": backward reached the parameters",
         "without a forward through the wrapper", "Call ddp(input) instead"});
    // The wrapper stays usable: the next iteration, done right, syncs.
    model->zero_grad();
    torch::mse_loss(ddp(shard), target).backward();
    expect_same_on_every_rank(world, model->fc1->weight.grad(), "gradient");
    EXPECT_EQ(ddp.stats().iterations, 1);
  });
}

TEST_P(DdpErrors, ADivergedReplicaIsNamed) {
  run_ranks(GetParam(), [](int rank) {
    World world = init();
    int last = world.size() - 1;
    std::string on_last = "on rank " + std::to_string(last) + " differs from rank 0's";
    torch::manual_seed(9);
    Mlp model;
    DDP<Mlp> ddp(model, world);
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    auto [x, y] = global_batch(0, 4 * world.size(), {20});
    auto shard = x.narrow(0, 4 * rank, 4);
    auto target = y.narrow(0, 4 * rank, 4);
    torch::mse_loss(ddp(shard), target).backward();
    optimizer.step();
    ddp.check_replicas(); // identical so far
    if (rank == last) {
      torch::NoGradGuard no_grad;
      model->fc2->weight[0][1] += 1e-3; // outside the optimizer
    }
    expect_error<UsageError>([&] { ddp.check_replicas(); },
                             {"the replicas diverged: 'fc2.weight' " + on_last,
                              "outside the optimizer step"});

    torch::manual_seed(9);
    Mlp checked;
    DDP<Mlp> verified(checked, world, DdpOptions().verify_every(1));
    torch::mse_loss(verified(shard), target).backward();
    if (rank == last) {
      torch::NoGradGuard no_grad;
      checked->fc3->bias[2] -= 1e-3;
    }
    expect_error<UsageError>([&] { verified(shard); },
                             {"the replicas diverged: 'fc3.bias' " + on_last});
  });
}

TEST(DdpDetail, ARankThatSkipsABackwardIsAnErrorNotAHang) {
  LaunchOptions options;
  options.world_size = 2;
  options.environment = [](int, RankEnvironment& env) {
    env["LOCKSTEP_DEBUG"] = "DETAIL";
    env["LOCKSTEP_TIMEOUT"] = "10";
  };
  auto result = launch_ranks(options, [](int rank) {
    World world = init();
    torch::manual_seed(3);
    ConstantBufferMlp model;
    DDP<ConstantBufferMlp> ddp(model, world, DdpOptions().broadcast_buffers(BufferSync::Always));
    auto [x, y] = global_batch(0, 8, {20});
    auto step = [&] {
      return torch::mse_loss(ddp(x.narrow(0, 4 * rank, 4)), y.narrow(0, 4 * rank, 4));
    };
    step().backward();
    std::vector<std::string> fragments{"the ranks are out of step at collective #",
                                       "rank 0 is doing all_reduce of bucket 0 of iteration 2",
                                       "rank 1 is doing broadcast of the buffers before forward 3",
                                       "Every rank must run the same forwards, backwards and collectives"};
    if (rank == 0) {
      auto loss = step();
      expect_error<CollectiveError>([&] { loss.backward(); }, fragments);
    } else {
      step(); // no backward here...
      expect_error<CollectiveError>([&] { step(); }, fragments);
    }
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

INSTANTIATE_TEST_SUITE_P(WorldSize, DdpErrors, ::testing::Values(2, 3),
                         [](const auto& info) {
                           return "world" + std::to_string(info.param);
                         });

// The optimizer inside the reduction, misused (docs/ddp.md).
TEST(StepInBackwardErrors, EachMisuseIsNamed) {
  run_ranks(2, [](int rank) {
    World world = init();
    {
      DDP<Mlp> ddp(float64_mlp(3), world);
      torch::optim::Adam adam(ddp.module()->parameters(), adam_options());
      ddp.step_in_backward(adam);
      expect_error<UsageError>([&] { ddp.step_in_backward(adam); },
                               {"already steps inside backward", "twice"});
      auto [x, y] = batch(0, 2);
      adam.zero_grad();
      torch::mse_loss(ddp(shard(x, rank, kPerRank)), shard(y, rank, kPerRank)).backward();
      // Each gradient was freed once its parameter stepped, so a stray
      // step (the mistake at the end of a loop) changes nothing.
      auto stepped = flatten(ddp.module()->parameters()).clone();
      for (const auto& param : ddp.module()->parameters()) {
        EXPECT_FALSE(param.grad().defined());
      }
      adam.step();
      EXPECT_TRUE(flatten(ddp.module()->parameters()).equal(stepped));
      {
        torch::NoGradGuard no_grad; // any other write in place is a second step
        ddp.module()->fc1->weight.add_(1.0);
      }
      expect_error<UsageError>([&] { ddp(shard(x, rank, kPerRank)); },
                               {"changed in place after the step inside backward",
                                "optimizer.step() was called", "Remove the call"});
    }
    {
      DDP<Mlp> ddp(float64_mlp(3), world);
      auto [x, y] = batch(0, 2);
      ddp(shard(x, rank, kPerRank));
      torch::optim::SGD sgd(ddp.module()->parameters(), sgd_options());
      expect_error<UsageError>([&] { ddp.step_in_backward(sgd); },
                               {"before the first forward"});
    }
    {
      DDP<Mlp> ddp(float64_mlp(3), world);
      auto stranger = torch::zeros({3}, torch::requires_grad());
      torch::optim::SGD sgd({stranger}, sgd_options());
      expect_error<UsageError>([&] { ddp.step_in_backward(sgd); },
                               {"not a parameter of the wrapped module", "never step"});
    }
    {
      DDP<Mlp> ddp(float64_mlp(3), world);
      ZeroRedundancyOptimizer<torch::optim::Adam> zero(ddp.module()->parameters(), world,
                                                       adam_options());
      ddp.step_in_backward(zero);
      auto [x, y] = batch(0, 2);
      zero.zero_grad();
      torch::mse_loss(ddp(shard(x, rank, kPerRank)), shard(y, rank, kPerRank)).backward();
      expect_error<UsageError>([&] { zero.step(); },
                               {"already steps inside backward", "twice"});
      torch::serialize::OutputArchive archive;
      expect_error<UsageError>([&] { zero.save(archive); },
                               {"consolidate_state_dict(", "on every rank first"});
      expect_error<UsageError>([&] { zero.consolidated(); }, {"consolidate_state_dict"});
      zero.consolidate_state_dict(1);
      if (rank == 1) {
        EXPECT_EQ(zero.consolidated().param_groups().front().params().size(), ddp.module()->parameters().size());
      }
    }
  });
}

} // namespace
} // namespace lockstep::testing
