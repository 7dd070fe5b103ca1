// What DistributedDataParallel does beyond averaging: buffers, the bypassed
// wrapper of reference/002, no_sync, overlap with backward, statistics and
// the module types it wraps.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "support/expect_error.h"
#include "support/models.h"
#include "support/multiprocess.h"
#include "support/training.h"
#include "support/warnings.h"

namespace lockstep::testing {
namespace {

class Behaviour : public ::testing::TestWithParam<WorldSetup> {};

TEST_P(Behaviour, BatchNormBuffersFollowRankZero) {
  run_ranks(GetParam(), [](int rank) {
    World world = init();
    torch::manual_seed(1);
    Cnn model(/*batch_norm=*/true);
    DDP<Cnn> ddp(model, world);
    torch::optim::SGD optimizer(model->parameters(), 0.05);
    std::vector<torch::Tensor> buffers = model->buffers();
    for (int step = 0; step < 4; ++step) {
      auto [x, y] = global_batch(step, 8 * world.size(), {1, 12, 12});
      optimizer.zero_grad();
      torch::mse_loss(ddp(x.narrow(0, 8 * rank, 8)), y.narrow(0, 8 * rank, 8))
          .backward();
      optimizer.step();
      expect_same_on_every_rank(world, flatten(model->parameters()),
                                "parameters after step " + std::to_string(step));
      // Every rank's running statistics moved with its own shard...
      auto own = flatten(buffers);
      auto gathered = world.all_gather(own);
      if (world.size() > 1) {
        EXPECT_FALSE(gathered[1].equal(gathered[0]));
      }
      // ...and the next forward starts from rank 0's.
      model->eval();
      {
        torch::NoGradGuard no_grad;
        ddp(x.narrow(0, 0, 2));
      }
      model->train();
      expect_same_on_every_rank(world, flatten(buffers),
                                "buffers after the forward of step " + std::to_string(step));
      EXPECT_TRUE(flatten(buffers).equal(gathered[0]));
    }
    EXPECT_EQ(ddp.stats().total.buffer_broadcasts, 4);
    // An evaluation around the wrapper after the last step scores with each
    // rank's own statistics; after sync_buffers, with rank 0's on every rank
    // (docs/ddp.md, "Evaluating after training").
    auto [x, y] = global_batch(4, 8 * world.size(), {1, 12, 12});
    optimizer.zero_grad();
    torch::mse_loss(ddp(x.narrow(0, 8 * rank, 8)), y.narrow(0, 8 * rank, 8)).backward();
    optimizer.step();
    auto evaluate = [&] {
      torch::NoGradGuard no_grad;
      model->eval();
      auto output = model(x.narrow(0, 0, 4));
      model->train();
      return world.all_gather(output);
    };
    if (world.size() > 1) {
      EXPECT_FALSE(evaluate()[1].equal(evaluate()[0]));
    }
    ddp.sync_buffers();
    expect_same_on_every_rank(world, evaluate()[rank], "an evaluation after sync_buffers");
  });
}

TEST_P(Behaviour, ConstantBuffersAreNeverBroadcast) {
  run_ranks(GetParam(), [](int) {
    World world = init();
    auto make = [] { return ConstantBufferMlp(); };
    auto when_changed = train_side_by_side<ConstantBufferMlp>(
        world, make, DdpOptions(), SideBySide(), plain_forward);
    EXPECT_EQ(when_changed.total.buffer_broadcasts, 0);
    auto always = train_side_by_side<ConstantBufferMlp>(
        world, make, DdpOptions().broadcast_buffers(BufferSync::Always),
        SideBySide(), plain_forward);
    EXPECT_EQ(always.total.buffer_broadcasts, 5);
    auto never = train_side_by_side<ConstantBufferMlp>(
        world, make, DdpOptions().broadcast_buffers(BufferSync::Never),
        SideBySide(), plain_forward);
    EXPECT_EQ(never.total.buffer_broadcasts, 0);
  });
}

// reference/002: the loss is computed on the unwrapped module.
struct ThroughTheModule {
  template <typename ModelType>
  torch::Tensor operator()(DDP<ModelType>& ddp, torch::Tensor x, int64_t, int) const {
    return ddp.module()(x);
  }
  template <typename ModelType>
  torch::Tensor operator()(ModelType& model, torch::Tensor x, int64_t, int) const {
    return model(x);
  }
};

TEST_P(Behaviour, BypassedWrapperStillAveragesAndWarnsOnce) {
  run_ranks(GetParam(), [](int rank) {
    World world = init();
    CountingWarnings warnings;
    WarningHandlerGuard guard(&warnings);
    // Replicas stay bit-identical and equal to one process on the whole
    // batch, where PyTorch's silently diverged.
    train_side_by_side<Mlp>(world, [] { return Mlp(); }, DdpOptions(),
                            SideBySide(), ThroughTheModule());
    ASSERT_EQ(warnings.messages.size(), 1u);
    EXPECT_NE(warnings.messages[0].find(
                  "rank " + std::to_string(rank) +
                  ": backward reached the parameters of the module wrapped in "
                  "DistributedDataParallel without a forward through the wrapper"),
              std::string::npos)
        << warnings.messages[0];
    EXPECT_NE(warnings.messages[0].find("Bypass::Ignore"), std::string::npos);
  });
}

/// Linear, BatchNorm1d, ReLU, Linear, and a constant mask: the model of a
/// user whose check_replicas() once cried wolf on every step.
struct NormedImpl : torch::nn::Module {
  NormedImpl()
      : body(register_module("body", torch::nn::Sequential(torch::nn::Linear(20, 16),
                                                         torch::nn::BatchNorm1d(16),
                                                         torch::nn::ReLU(),
                                                         torch::nn::Linear(16, 5)))),
        mask(register_buffer("mask", torch::ones({20}))) {}
  torch::Tensor forward(torch::Tensor x) {
    return body->forward(x * mask);
  }
  torch::nn::Sequential body;
  torch::Tensor mask;
};
TORCH_MODULE(Normed);

TEST_P(Behaviour, CheckReplicasPassesBetweenStepsOfAHealthyBatchNormModel) {
  run_ranks(GetParam(), [](int rank) {
    World world = init();
    torch::manual_seed(21);
    Normed model;
    DDP<Normed> ddp(model, world, DdpOptions().verify_every(1));
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    for (int step = 0; step < 4; ++step) {
      auto [x, y] = global_batch(step, 8 * world.size(), {20});
      optimizer.zero_grad();
      torch::mse_loss(ddp(x.narrow(0, 8 * rank, 8)), y.narrow(0, 8 * rank, 8)).backward();
      optimizer.step();
      ddp.check_replicas(); // each rank's running statistics moved with its shard: fine
    }
    if (world.size() == 1) {
      return;
    }
    // A buffer that should be equal, changed on one rank without counting as
    // a change (raw memory): caught, as a buffer, with what to call.
    if (rank == 1) {
      model->mask.data_ptr<float>()[3] = 2.0f;
    }
    expect_error<UsageError>(
        [&] { ddp.check_replicas(); },
        {"the replicas diverged: buffer 'mask' on rank 1 differs from rank 0's, though no "
         "rank changed it since the buffers were last synchronised. Buffers are synchronised "
         "from rank 0 before each forward after which some rank changed one",
         "Call ddp.sync_buffers() to give every rank rank 0's buffers now, or "
         "ddp.check_replicas(ReplicaCheck::Parameters) to check the parameters alone."});
    ddp.check_replicas(ReplicaCheck::Parameters);
    ddp.sync_buffers();
    ddp.check_replicas();
    // A parameter is always compared.
    if (rank == 1) {
      torch::NoGradGuard no_grad;
      model->body[0]->as<torch::nn::Linear>()->bias.add_(1e-3);
    }
    expect_error<UsageError>([&] { ddp.check_replicas(ReplicaCheck::Parameters); },
                             {"the replicas diverged: 'body.0.bias' on rank 1 differs"});
  });
}

TEST_P(Behaviour, ABackwardThatBypassedTheWrapperKeepsBuffersInStep) {
  run_ranks(GetParam(), [](int rank) {
    World world = init();
    torch::manual_seed(22);
    Normed model;
    CountingWarnings warnings; // the bypass's one warning
    WarningHandlerGuard guard(&warnings);
    DDP<Normed> ddp(model, world);
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = global_batch(step, 8 * world.size(), {20});
      model->zero_grad();
      // ddp.module(): the wrapper sees no forward; backward still syncs.
      torch::mse_loss(ddp.module()(x.narrow(0, 8 * rank, 8)), y.narrow(0, 8 * rank, 8))
          .backward();
      expect_same_on_every_rank(world, flatten(model->buffers()),
                                "buffers after bypassing backward " + std::to_string(step));
    }
  });
}

TEST_P(Behaviour, BypassIgnoreKeepsGradientsLocal) {
  run_ranks(GetParam(), [](int rank) {
    World world = init();
    torch::manual_seed(3);
    Mlp model;
    DDP<Mlp> ddp(model, world, DdpOptions().bypass(Bypass::Ignore));
    auto [x, y] = global_batch(0, 4 * world.size(), {20});
    torch::mse_loss(ddp.module()(x.narrow(0, 4 * rank, 4)), y.narrow(0, 4 * rank, 4))
        .backward();
    auto grads = world.all_gather(model->fc1->weight.grad().contiguous());
    if (world.size() > 1) {
      EXPECT_FALSE(grads[1].equal(grads[0]));
    }
    EXPECT_EQ(ddp.stats().iterations, 0);
  });
}

TEST_P(Behaviour, NoSyncAccumulatesThenAveragesTheSum) {
  run_ranks(GetParam(), [](int rank) {
    World world = init();
    int n = world.size();
    torch::manual_seed(5);
    Branchy model;
    torch::manual_seed(5);
    Branchy reference;
    model->to(torch::kDouble);
    reference->to(torch::kDouble);
    DDP<Branchy> ddp(model, world);
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    torch::optim::SGD reference_optimizer(reference->parameters(), 0.1);
    for (int step = 0; step < 3; ++step) {
      optimizer.zero_grad();
      reference_optimizer.zero_grad();
      // Micro-batch m uses head m: head_a only in the first, local one.
      for (int micro = 0; micro < 3; ++micro) {
        auto [x, y] = global_batch(10 * step + micro, 4 * n, {20});
        x = x.to(torch::kDouble);
        y = y.to(torch::kDouble);
        auto shard = [&](const torch::Tensor& t) { return t.narrow(0, 4 * rank, 4); };
        if (micro < 2) {
          auto guard = ddp.no_sync();
          torch::mse_loss(ddp(shard(x), micro), shard(y)).backward();
        } else {
          torch::mse_loss(ddp(shard(x), micro), shard(y)).backward();
        }
        torch::mse_loss(reference(x, micro), y).backward();
      }
      optimizer.step();
      reference_optimizer.step();
      std::string context = "after step " + std::to_string(step);
      expect_close_parameters(*model, *reference, kFloat64Tolerance, context);
      expect_same_on_every_rank(world, flatten(model->parameters()), context);
    }
    EXPECT_EQ(ddp.stats().iterations, 3);
  });
}

TEST_P(Behaviour, StatsDescribeTheIterations) {
  run_ranks(GetParam(), [](int rank) {
    World world = init();
    torch::manual_seed(2);
    Branchy model;
    DDP<Branchy> ddp(model, world, DdpOptions().first_bucket_cap_mb(0).bucket_cap_mb(0));
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = global_batch(step, 4 * world.size(), {20});
      optimizer.zero_grad();
      torch::mse_loss(ddp(x.narrow(0, 4 * rank, 4), 1), y.narrow(0, 4 * rank, 4))
          .backward();
      optimizer.step();
    }
    auto stats = ddp.stats();
    EXPECT_EQ(stats.iterations, 3);
    EXPECT_TRUE(stats.buckets_rebuilt);
    ASSERT_EQ(stats.bucket_bytes.size(), 8u); // one parameter per bucket
    int64_t layout_bytes = 0;
    for (auto bytes : stats.bucket_bytes) {
      layout_bytes += bytes;
    }
    // A world of one sends nothing, and says so.
    int64_t sent = world.size() > 1 ? layout_bytes : 0;
    EXPECT_EQ(stats.last.bytes_reduced, sent);
    EXPECT_EQ(stats.total.bytes_reduced, 3 * sent);
    EXPECT_GT(stats.last.forward_ms, 0);
    EXPECT_GT(stats.last.backward_ms, 0);
    EXPECT_GE(stats.last.comm_wait_ms, 0);
    EXPECT_GE(stats.total.backward_ms, stats.last.backward_ms);
    // Rebuilt in the order gradients became ready: head_b first, the heads
    // that never got one last.
    EXPECT_EQ(stats.bucket_parameters.front().front().rfind("head_b.", 0), 0u);
    EXPECT_EQ(stats.unused_parameters,
              (std::vector<std::string>{"head_a.weight", "head_a.bias",
                                        "head_c.weight", "head_c.bias"}));
  });
}

LaunchResult run_with_debug(const std::string& level) {
  LaunchOptions options;
  options.world_size = 2;
  options.environment = [level](int, RankEnvironment& env) { env["LOCKSTEP_DEBUG"] = level; };
  return launch_ranks(options, [](int rank) {
    World world = init();
    torch::manual_seed(2);
    Branchy model;
    DDP<Branchy> ddp(model, world);
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = global_batch(step, 8, {20});
      model->zero_grad();
      torch::mse_loss(ddp(x.narrow(0, 4 * rank, 4), rank + step), y.narrow(0, 4 * rank, 4))
          .backward();
    }
  });
}

TEST(DdpDebug, InfoLogsTheLayoutAndTheUnusedParameters) {
  auto result = run_with_debug("INFO");
  ASSERT_TRUE(result.ok()) << result.report();
  const auto& log = result.ranks[1].output;
  for (const char* line :
       {"lockstep INFO rank 1: bucket layout at construction, in reverse registration order",
        "lockstep INFO rank 1: bucket layout rebuilt in the order gradients became ready",
        "  bucket 0 (",
        "iteration 1: parameters without a gradient here: head_a.weight, head_a.bias, "
        "head_c.weight, head_c.bias",
        "iteration 2: parameters without a gradient here: head_a.weight, head_a.bias, "
        "head_b.weight, head_b.bias"}) {
    EXPECT_NE(log.find(line), std::string::npos) << "missing: " << line << "\n" << log;
  }
}

TEST(DdpOverlap, FirstBucketLeavesBeforeBackwardEnds) {
  run_ranks(2, [](int rank) {
    World world = init();
    torch::manual_seed(4);
    Mlp model(256, 512, 256);
    DDP<Mlp> ddp(model, world, DdpOptions().first_bucket_cap_mb(0.25).bucket_cap_mb(0.5));
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = global_batch(step, 64 * 2, {256});
      model->zero_grad();
      ddp(x.narrow(0, 64 * rank, 64)).pow(2).mean().backward();
    }
    auto stats = ddp.stats();
    ASSERT_GT(stats.bucket_launch_ms.size(), 2u);
    std::cout << "rank " << rank << ": backward ended at " << stats.backward_end_ms
              << " ms after the first gradient; buckets launched at";
    for (double ms : stats.bucket_launch_ms) {
      std::cout << " " << ms;
    }
    std::cout << " ms" << std::endl;
    EXPECT_LT(stats.bucket_launch_ms.front(), stats.backward_end_ms);
    EXPECT_LT(stats.bucket_launch_ms[1], stats.backward_end_ms);
  });
}

TEST(DdpModuleTypes, SharedPtrAndAnyModuleAndArrow) {
  run_ranks(2, [](int rank) {
    World world = init();
    torch::manual_seed(6);
    auto impl = std::make_shared<MlpImpl>();
    DDP<std::shared_ptr<MlpImpl>> shared(impl, world);
    torch::manual_seed(6);
    Mlp holder;
    DDP<torch::nn::AnyModule> any(torch::nn::AnyModule(holder), world);
    auto [x, y] = global_batch(0, 8, {20});
    auto shard = x.narrow(0, 4 * rank, 4);
    torch::mse_loss(shared->forward(shard), y.narrow(0, 4 * rank, 4)).backward();
    torch::mse_loss(any(shard), y.narrow(0, 4 * rank, 4)).backward();
    EXPECT_TRUE(impl->fc1->weight.grad().equal(holder->fc1->weight.grad()));
    expect_same_on_every_rank(world, impl->fc1->weight.grad(), "averaged gradient");
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSize, Behaviour, ::testing::ValuesIn(every_world_setup()),
                         [](const auto& info) { return info.param.name(); });

} // namespace
} // namespace lockstep::testing
