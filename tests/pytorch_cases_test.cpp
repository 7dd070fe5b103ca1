// Cases from PyTorch's own DDP tests (distributed_test.py, test_c10d_*.py)
// that lockstep once failed, written anew: each at 2 and 3 ranks, each rank
// on its shard, compared after every step with one plain LibTorch process on
// the whole batch (float64, so "the same" is exact in kind), or asserting
// the error. Where PyTorch 1.13 is wrong or raises, the comment says so.

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "support/expect_error.h"
#include "support/models.h"
#include "support/multiprocess.h"
#include "support/training.h"
#include "support/warnings.h"

namespace lockstep::testing {
namespace {

class PyTorchCases : public ::testing::TestWithParam<int> {};

INSTANTIATE_TEST_SUITE_P(WorldSize, PyTorchCases, ::testing::Values(2, 3),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// This rank's rows of a global batch of `per_rank` rows per rank.
torch::Tensor shard(const torch::Tensor& global, int rank, int64_t per_rank) {
  return global.narrow(0, rank * per_rank, per_rank);
}

// ---- 1. Sparse gradients --------------------------------------------------

/// An embedding table with sparse gradients, three ways: an Embedding
/// module, an EmbeddingBag module, and a functional call in a module of the
/// user's own.
struct SparseModelImpl : torch::nn::Module {
  SparseModelImpl()
      : table(register_module(
            "table", torch::nn::Embedding(torch::nn::EmbeddingOptions(50, 6).sparse(true)))),
        bag(register_module("bag", torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(40, 6)
                                                               .sparse(true)
                                                               .mode(torch::kSum)))),
        raw(register_parameter("raw", torch::randn({30, 6}))),
        head(register_module("head", torch::nn::Linear(18, 5))) {}
  torch::Tensor forward(torch::Tensor ids) {
    auto a = table(ids.select(1, 0));
    auto b = bag(ids.narrow(1, 1, 2));
    auto c = torch::embedding(raw, ids.select(1, 3) % 30, -1, false, /*sparse=*/true);
    return head(torch::cat({a, b, c}, 1));
  }
  torch::nn::Embedding table;
  torch::nn::EmbeddingBag bag;
  torch::Tensor raw;
  torch::nn::Linear head;
};
TORCH_MODULE(SparseModel);

TEST_P(PyTorchCases, SparseGradientsAreAveraged) {
  run_ranks(GetParam(), [](int rank) {
    World world = init();
    int n = world.size();
    torch::manual_seed(11);
    SparseModel model;
    torch::manual_seed(11);
    SparseModel reference;
    model->to(torch::kDouble);
    reference->to(torch::kDouble);
    DDP<SparseModel> ddp(model, world);
    torch::optim::SGD optimizer(model->parameters(), 0.5);
    torch::optim::SGD reference_optimizer(reference->parameters(), 0.5);
    for (int step = 0; step < 4; ++step) {
      auto generator = at::make_generator<at::CPUGeneratorImpl>(100 + step);
      auto ids = at::randint(0, 40, {4 * n, 4}, generator);
      auto y = at::randn({4 * n, 5}, generator).to(torch::kDouble);
      optimizer.zero_grad();
      auto loss = torch::mse_loss(ddp(shard(ids, rank, 4)), shard(y, rank, 4));
      loss.backward();
      EXPECT_TRUE(model->table->weight.grad().is_sparse()) << "the gradient stays sparse";
      optimizer.step();
      reference_optimizer.zero_grad();
      torch::mse_loss(reference(ids), y).backward();
      reference_optimizer.step();
      expect_close_parameters(*model, *reference, kFloat64Tolerance,
                              "after step " + std::to_string(step));
      expect_same_on_every_rank(world, flatten(model->parameters()), "parameters");
    }
  });
}

// ---- 2. A buffer changed outside forward ----------------------------------

/// Forward scales by a buffer, which the user changes between steps.
struct ScaledImpl : torch::nn::Module {
  ScaledImpl()
      : mlp(register_module("mlp", Mlp())),
        scale(register_buffer("scale", torch::ones({20}))) {}
  torch::Tensor forward(torch::Tensor x) {
    return mlp(x * scale);
  }
  Mlp mlp;
  torch::Tensor scale;
};
TORCH_MODULE(Scaled);

TEST_P(PyTorchCases, ABufferChangedOutsideForwardIsRankZerosAtTheNextForward) {
  // PyTorch (broadcast_buffers=True) broadcasts before every forward;
  // lockstep agrees on a few bytes and broadcasts only when a buffer changed.
  run_ranks(GetParam(), [](int rank) {
    World world = init();
    int n = world.size();
    torch::manual_seed(12);
    Scaled model;
    torch::manual_seed(12);
    Scaled reference;
    model->to(torch::kDouble);
    reference->to(torch::kDouble);
    DDP<Scaled> ddp(model, world);
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    torch::optim::SGD reference_optimizer(reference->parameters(), 0.1);
    for (int step = 0; step < 4; ++step) {
      torch::NoGradGuard no_grad;
      if (rank == 0) {
        model->scale.add_(0.25); // rank 0's edit, as rank 0 alone might make it
      }
      reference->scale.add_(0.25);
    }
    for (int step = 0; step < 4; ++step) {
      {
        torch::NoGradGuard no_grad;
        if (rank == 0 && step % 2 == 0) {
          model->scale.mul_(1.5);
        }
      }
      if (step % 2 == 0) {
        torch::NoGradGuard no_grad;
        reference->scale.mul_(1.5);
      }
      auto [x, y] = global_batch(step, 4 * n, {20});
      x = x.to(torch::kDouble);
      y = y.to(torch::kDouble);
      optimizer.zero_grad();
      auto out = ddp(shard(x, rank, 4));
      expect_same_on_every_rank(world, model->scale, "the buffer after forward " +
                                                         std::to_string(step + 1));
      EXPECT_TRUE(model->scale.equal(reference->scale)) << "rank 0's buffer, step " << step;
      torch::mse_loss(out, shard(y, rank, 4)).backward();
      optimizer.step();
      reference_optimizer.zero_grad();
      torch::mse_loss(reference(x), y).backward();
      reference_optimizer.step();
      expect_close_parameters(*model, *reference, kFloat64Tolerance,
                              "after step " + std::to_string(step));
    }
  });
}

// ---- 3. A parameter that starts to require grad ---------------------------

Mlp& unwrapped(Mlp& model) {
  return model;
}
Mlp& unwrapped(DDP<Mlp>& ddp) {
  return ddp.module();
}

TEST_P(PyTorchCases, AParameterUnfrozenLaterIsTakenIn) {
  // PyTorch never averages its gradients: the replicas drift apart.
  run_ranks(GetParam(), [](int) {
    World world = init();
    SideBySide setup;
    setup.steps = 5;
    auto stats = train_side_by_side<Mlp>(
        world, [] { return frozen_mlp(); }, DdpOptions(), setup,
        [](auto& model, torch::Tensor x, int64_t step, int) {
          if (step == 2) { // unfreeze, as a fine-tuning schedule does
            for (auto& param : unwrapped(model)->fc1->parameters()) {
              param.set_requires_grad(true);
            }
          }
          return model(x);
        });
    bool taken_in = false;
    for (const auto& bucket : stats.bucket_parameters) {
      for (const auto& name : bucket) {
        taken_in |= name == "fc1.weight";
      }
    }
    EXPECT_TRUE(taken_in);
  });
}

// ---- 4. Gradients that no rank produced -----------------------------------

TEST_P(PyTorchCases, AGradientNoRankProducedStaysAsLocalTrainingLeavesIt) {
  // test_undefined_grad_parity_unused_parameters: undefined stays undefined,
  // an existing gradient is not touched.
  const std::pair<const char*, DdpOptions> settings[] = {
      {"default", DdpOptions()},
      {"find_unused_parameters", DdpOptions().find_unused_parameters(true)},
      {"gradients copied", DdpOptions().gradient_as_bucket_view(false)},
      {"one parameter per bucket", DdpOptions().bucket_cap_mb(0).first_bucket_cap_mb(0)}};
  for (const auto& [name, options] : settings) {
    SCOPED_TRACE(name);
    run_ranks(GetParam(), [options = options](int rank) {
      World world = init();
      torch::manual_seed(13);
      Branchy model;
      torch::manual_seed(13);
      Branchy reference;
      model->to(torch::kDouble);
      reference->to(torch::kDouble);
      DDP<Branchy> ddp(model, world, options);
      for (int step = 0; step < 4; ++step) {
        auto [x, y] = global_batch(step, 4 * world.size(), {20});
        x = x.to(torch::kDouble);
        y = y.to(torch::kDouble);
        // Gradients set to none, then zeroed, alternately. Head a on every
        // rank, head b never, head c only in step 1.
        model->zero_grad(/*set_to_none=*/step % 2 == 0);
        reference->zero_grad(/*set_to_none=*/step % 2 == 0);
        int64_t head = step == 1 ? 2 : 0;
        torch::mse_loss(ddp(shard(x, rank, 4), head), shard(y, rank, 4)).backward();
        torch::mse_loss(reference(x, head), y).backward();
        for (const auto& item : model->named_parameters()) {
          at::Tensor expected = reference->named_parameters()[item.key()].grad();
          const auto& actual = item.value().grad();
          ASSERT_EQ(actual.defined(), expected.defined()) << item.key() << ", step " << step;
          if (expected.defined()) {
            EXPECT_TRUE(torch::allclose(actual, expected, kFloat64Tolerance, kFloat64Tolerance))
                << item.key() << ", step " << step;
          }
        }
      }
    });
  }
}

TEST_P(PyTorchCases, AnUndefinedGradientFlowingBackStaysUndefined) {
  // test_undefined_grad_parity_unused_parameters: a backward through
  // torch::autograd::UndefinedGrad reaches every parameter with no
  // gradient at all; local training leaves .grad undefined, and so must DDP,
  // with and without find_unused_parameters.
  for (bool find_unused : {false, true}) {
    SCOPED_TRACE(find_unused ? "find_unused_parameters" : "default");
    run_ranks(GetParam(), [find_unused](int) {
      World world = init();
      torch::manual_seed(13);
      Mlp model;
      torch::manual_seed(13);
      Mlp local;
      DDP<Mlp> ddp(model, world, DdpOptions().find_unused_parameters(find_unused));
      auto x = torch::ones({1, 20});
      for (int step = 0; step < 2; ++step) {
        torch::autograd::UndefinedGrad().apply({ddp(x).sum()})[0].backward();
        torch::autograd::UndefinedGrad().apply({local(x).sum()})[0].backward();
        for (const auto& item : model->named_parameters()) {
          EXPECT_EQ(item.value().grad().defined(),
                    local->named_parameters()[item.key()].grad().defined())
              << item.key() << ", step " << step;
        }
      }
    });
  }
}

// ---- 5. Reentrant checkpointing -------------------------------------------

/// PyTorch's reentrant checkpoint, in C++: forward runs the block without
/// keeping its graph; backward runs it again and backpropagates through it
/// with a backward of its own, inside the outer one.
struct Checkpoint : torch::autograd::Function<Checkpoint> {
  static torch::Tensor forward(torch::autograd::AutogradContext* context,
                               torch::Tensor input,
                               int64_t block_address) {
    context->save_for_backward({input});
    context->saved_data["block"] = block_address;
    torch::NoGradGuard no_grad;
    return block(block_address)(input);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                 torch::autograd::variable_list grads) {
    auto input = context->get_saved_variables()[0].detach().requires_grad_(true);
    torch::Tensor output;
    {
      torch::AutoGradMode enable(true);
      output = block(context->saved_data["block"].toInt())(input);
    }
    torch::autograd::backward({output}, {grads[0]});
    return {input.grad(), torch::Tensor()};
  }
  static torch::nn::Linear& block(int64_t address) {
    return *reinterpret_cast<torch::nn::Linear*>(address);
  }
};

struct CheckpointedImpl : torch::nn::Module {
  explicit CheckpointedImpl(int times)
      : times(times),
        l1(register_module("l1", torch::nn::Linear(20, 20))),
        l2(register_module("l2", torch::nn::Linear(20, 5))) {}
  torch::Tensor forward(torch::Tensor x) {
    for (int i = 0; i < times; ++i) {
      x = torch::tanh(Checkpoint::apply(x, reinterpret_cast<int64_t>(&l1)));
    }
    return l2(x);
  }
  int times;
  torch::nn::Linear l1, l2;
};
TORCH_MODULE(Checkpointed);

TEST_P(PyTorchCases, ReentrantCheckpointingIsOneIterationPerBackward) {
  run_ranks(GetParam(), [](int) {
    World world = init();
    for (bool static_graph : {false, true}) {
      for (int times : {1, 2}) {
        SCOPED_TRACE(std::string(static_graph ? "static_graph, " : "") + std::to_string(times) +
                     " checkpoint(s)");
        CountingWarnings warnings;
        WarningHandlerGuard guard(&warnings);
        auto stats = train_side_by_side<Checkpointed>(
            world, [times] { return Checkpointed(times); },
            DdpOptions().static_graph(static_graph), SideBySide(), plain_forward);
        EXPECT_EQ(stats.iterations, 5);
        EXPECT_TRUE(warnings.messages.empty()) << warnings.messages.front();
      }
    }
  });
}

// ---- 6. A second backward in the same iteration ---------------------------

TEST_P(PyTorchCases, ASecondBackwardOfOneForwardIsNotABypass) {
  // PyTorch 1.13: the default is 1.8% off, static_graph fails an assert.
  run_ranks(GetParam(), [](int rank) {
    World world = init();
    int n = world.size();
    for (auto bypass : {Bypass::SyncAndWarn, Bypass::Error, Bypass::Ignore}) {
      CountingWarnings warnings;
      WarningHandlerGuard guard(&warnings);
      torch::manual_seed(14);
      Mlp model;
      torch::manual_seed(14);
      Mlp reference;
      model->to(torch::kDouble);
      reference->to(torch::kDouble);
      DDP<Mlp> ddp(model, world, DdpOptions().bypass(bypass));
      for (int step = 0; step < 3; ++step) {
        auto [x, y] = global_batch(step, 4 * n, {20});
        x = x.to(torch::kDouble);
        y = y.to(torch::kDouble);
        model->zero_grad();
        auto out = ddp(shard(x, rank, 4));
        auto loss = torch::mse_loss(out, shard(y, rank, 4));
        loss.backward({}, /*retain_graph=*/true);
        (out.pow(2).mean() * 0.5).backward(); // another loss of the same forward
        reference->zero_grad();
        auto reference_out = reference(x);
        torch::mse_loss(reference_out, y).backward({}, true);
        (reference_out.pow(2).mean() * 0.5).backward();
        for (const auto& item : model->named_parameters()) {
          EXPECT_TRUE(torch::allclose(item.value().grad(),
                                      reference->named_parameters()[item.key()].grad(),
                                      kFloat64Tolerance, kFloat64Tolerance))
              << item.key() << " after step " << step;
        }
      }
      EXPECT_TRUE(warnings.messages.empty()) << warnings.messages.front();
      EXPECT_EQ(ddp.stats().iterations, 6);
    }
  });
}

// ---- 7. create_graph ------------------------------------------------------

TEST_P(PyTorchCases, CreateGraphKeepsTheAveragedGradientDifferentiable) {
  // A gradient penalty on the parameters' gradients (as in WGAN-GP or
  // meta-learning): the averaged .grad must carry its graph.
  run_ranks(GetParam(), [](int rank) {
    World world = init();
    int n = world.size();
    torch::manual_seed(15);
    Mlp model;
    torch::manual_seed(15);
    Mlp reference;
    model->to(torch::kDouble);
    reference->to(torch::kDouble);
    DDP<Mlp> ddp(model, world);
    torch::optim::SGD optimizer(model->parameters(), 0.05);
    torch::optim::SGD reference_optimizer(reference->parameters(), 0.05);
    auto penalty_step = [](torch::nn::Module& module, torch::optim::Optimizer& opt,
                           const torch::Tensor& loss) {
      loss.backward({}, /*retain_graph=*/true, /*create_graph=*/true);
      auto penalty = torch::zeros({}, torch::kDouble);
      for (auto& param : module.parameters()) {
        EXPECT_TRUE(param.grad().requires_grad()) << "the gradient lost its graph";
        penalty = penalty + param.grad().pow(2).sum();
      }
      for (auto& param : module.parameters()) {
        param.mutable_grad() = torch::Tensor();
      }
      (loss + penalty).backward();
      opt.step();
    };
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = global_batch(step, 4 * n, {20});
      x = x.to(torch::kDouble);
      y = y.to(torch::kDouble);
      optimizer.zero_grad();
      penalty_step(*model, optimizer, torch::mse_loss(ddp(shard(x, rank, 4)), shard(y, rank, 4)));
      reference_optimizer.zero_grad();
      penalty_step(*reference, reference_optimizer, torch::mse_loss(reference(x), y));
      expect_close_parameters(*model, *reference, kFloat64Tolerance,
                              "after step " + std::to_string(step));
    }
  });
}

// ---- 8. Nothing to train --------------------------------------------------

TEST_P(PyTorchCases, AModuleWithNothingToTrainIsRefused) {
  // test_DistributedDataParallel_requires_grad
  run_ranks(GetParam(), [](int) {
    World world = init();
    Mlp model;
    for (auto& param : model->parameters()) {
      param.set_requires_grad(false);
    }
    expect_error<UsageError>(
        [&] { DDP<Mlp> ddp(model, world); },
        {"DistributedDataParallel is not needed for a module without any parameter that "
         "requires a gradient: there is nothing to average. Set requires_grad on the "
         "parameters to train, or leave the module unwrapped."});
  });
}

} // namespace
} // namespace lockstep::testing
