// SyncBatchNorm against one torch::nn::BatchNorm on the concatenated batch:
// outputs, input gradients, the summed weight and bias gradients and the
// running statistics, at world sizes 1-4, with equal and unequal (one
// empty) per-rank batches, 2-, 4- and 5-dimensional inputs. Then inside
// DistributedDataParallel (converted, or declared without a world), alone
// (a BatchNorm), and convert_sync_batchnorm.

#include <functional>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "support/expect_error.h"
#include "support/multiprocess.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

/// float32: every compared value is a sum of at most a few hundred terms
/// of size <= 10, or such a sum's square root, in two orders; each order
/// is within a few hundred units of 2^-24 (6e-8) of the exact value, so
/// 1e-5 absolute and relative keeps a margin of ten, and a real mistake (a
/// rank's statistics left out, a biased variance) moves values by 1e-2 or
/// more.
constexpr double kFloat32Tolerance = 1e-5;

struct BatchSetup {
  int world_size = 2;
  bool equal = true;
};

class SyncBatchNormTest : public ::testing::TestWithParam<BatchSetup> {};

std::vector<BatchSetup> every_setup() {
  std::vector<BatchSetup> setups;
  for (int size : {1, 2, 3, 4}) {
    setups.push_back({size, true});
    if (size > 1) {
      setups.push_back({size, false});
    }
  }
  return setups;
}

INSTANTIATE_TEST_SUITE_P(WorldSize, SyncBatchNormTest, ::testing::ValuesIn(every_setup()),
                         [](const auto& info) {
                           return "world" + std::to_string(info.param.world_size) +
                               (info.param.equal ? "_equal" : "_unequal");
                         });

// Rows per rank; unequal, rank 2 has none.
int64_t rows_of(int rank, bool equal) {
  static const int64_t unequal[] = {2, 5, 0, 1};
  return equal ? 3 : unequal[rank];
}

torch::nn::AnyModule batch_norm_for(int64_t dims, int64_t channels) {
  switch (dims) {
    case 2:
    case 3:
      return torch::nn::AnyModule(torch::nn::BatchNorm1d(channels));
    case 4:
      return torch::nn::AnyModule(torch::nn::BatchNorm2d(channels));
    default:
      return torch::nn::AnyModule(torch::nn::BatchNorm3d(channels));
  }
}

void expect_close(const torch::Tensor& actual, const torch::Tensor& expected, double tolerance,
                  const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(actual.to(torch::kDouble).allclose(expected.to(torch::kDouble), tolerance,
                                                 tolerance))
      << what << ": differs by up to "
      << (actual.to(torch::kDouble) - expected.to(torch::kDouble)).abs().max().item<double>();
}

TEST_P(SyncBatchNormTest, MatchesOneBatchNormOnTheConcatenatedBatch) {
  BatchSetup setup = GetParam();
  run_ranks(setup.world_size, [setup](int rank) {
    World world = init();
    int n = world.size();
    int64_t first = 0;
    int64_t total = 0;
    for (int r = 0; r < n; ++r) {
      first += r < rank ? rows_of(r, setup.equal) : 0;
      total += rows_of(r, setup.equal);
    }
    int64_t mine = rows_of(rank, setup.equal);
    const int64_t channels = 3;
    for (auto dtype : {torch::kDouble, torch::kFloat}) {
      double tolerance = dtype == torch::kDouble ? kFloat64Tolerance : kFloat32Tolerance;
      for (int64_t dims : {2, 3, 4, 5}) {
        std::string what = "input of " + std::to_string(dims) + " dims, " +
            std::string(c10::toString(dtype));
        std::vector<int64_t> shape{total, channels, 4, 3, 2};
        shape.resize(static_cast<size_t>(dims));
        SyncBatchNorm sync(torch::nn::BatchNormOptions(channels), world);
        auto reference = batch_norm_for(dims, channels);
        sync->to(dtype);
        reference.ptr()->to(dtype);
        for (int step = 0; step < 3; ++step) {
          auto generator = at::make_generator<at::CPUGeneratorImpl>(40 + step + 10 * dims);
          auto x = (at::randn(shape, generator) * 2 + 1.5).to(dtype);
          auto g = at::randn(shape, generator).to(dtype);
          auto x_mine = x.narrow(0, first, mine).clone().requires_grad_(true);
          auto x_all = x.clone().requires_grad_(true);
          auto y = sync(x_mine);
          auto y_all = reference.forward(x_all);
          (y * g.narrow(0, first, mine)).sum().backward();
          (y_all * g).sum().backward();
          auto at_step = what + ", step " + std::to_string(step);
          expect_close(y, y_all.narrow(0, first, mine), tolerance, "output, " + at_step);
          expect_close(x_mine.grad(), x_all.grad().narrow(0, first, mine), tolerance,
                       "input gradient, " + at_step);
          // Each rank's share of the weight and bias gradients, summed.
          auto grads = torch::cat({sync->weight.grad(), sync->bias.grad()}).to(torch::kDouble);
          world.all_reduce(grads);
          auto* reference_impl = reference.ptr().get();
          auto expected = torch::cat({reference_impl->named_parameters()["weight"].grad(),
                                      reference_impl->named_parameters()["bias"].grad()});
          expect_close(grads, expected, tolerance, "weight and bias gradients, " + at_step);
          for (const char* name : {"running_mean", "running_var", "num_batches_tracked"}) {
            expect_close(sync->named_buffers()[name], reference_impl->named_buffers()[name],
                         tolerance, std::string(name) + ", " + at_step);
          }
          sync->zero_grad();
          reference_impl->zero_grad();
        }
        // Eval mode: the running statistics, no collective (rank 2 of the
        // unequal setup has nothing to evaluate, and does not take part).
        sync->eval();
        reference.ptr()->eval();
        if (mine > 0) {
          auto x = at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(7)).to(dtype);
          auto slice = x.narrow(0, first, mine);
          expect_close(sync(slice), reference.forward(x).narrow(0, first, mine), tolerance,
                       what + ", eval");
        }
        world.barrier();
      }
    }
  });
}

class SyncBatchNormPrecision : public ::testing::TestWithParam<int> {};

INSTANTIATE_TEST_SUITE_P(WorldSize, SyncBatchNormPrecision, ::testing::Values(2, 3),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

TEST_P(SyncBatchNormPrecision, AMeanLargeAgainstTheSpreadKeepsTheVariance) {
  // float32 inputs of mean 1e4 and spread 1e-2, against one BatchNorm in
  // float64 on the same values. The variance (1e-4) is 1e-12 of the squared
  // mean, so E[x^2] - mean^2 would lose it; merged per rank as (count,
  // mean, M2), it is exact to float64's rounding. Bounds, from the
  // computation: running_var holds momentum x the batch's unbiased
  // variance, rounded to float32 (relative 2^-24), plus the running value's
  // own rounding; running_mean the same with the mean; the output uses the
  // mean rounded to float32 (half a unit of 1e4: 2^-11), times invstd.
  run_ranks(GetParam(), [](int rank) {
    World world = init();
    int n = world.size();
    const int64_t rows = 4;
    const int64_t channels = 3;
    SyncBatchNorm sync(torch::nn::BatchNormOptions(channels), world);
    torch::nn::BatchNorm1d reference(channels);
    reference->to(torch::kDouble);
    auto generator = at::make_generator<at::CPUGeneratorImpl>(5);
    auto x = (1e4 + 1e-2 * at::randn({rows * n, channels}, generator, at::kDouble))
                 .to(torch::kFloat);
    auto y = sync(x.narrow(0, rows * rank, rows));
    auto y_all = reference(x.to(torch::kDouble));
    auto variance = x.to(torch::kDouble).var(0, /*unbiased=*/true);
    auto var_bound = 0.1 * variance * std::ldexp(1.0, -23) + std::ldexp(1.0, -24);
    auto var_error = (sync->running_var.to(torch::kDouble) - reference->running_var).abs();
    EXPECT_TRUE(var_error.le(var_bound).all().item<bool>())
        << "running_var off by " << var_error << " where the bound is " << var_bound;
    auto mean_bound = 0.1 * 1e4 * std::ldexp(1.0, -23) + 0.9 * std::ldexp(1.0, -24);
    auto mean_error = (sync->running_mean.to(torch::kDouble) - reference->running_mean).abs();
    EXPECT_TRUE(mean_error.le(mean_bound).all().item<bool>())
        << "running_mean off by " << mean_error;
    auto invstd = (x.to(torch::kDouble).var(0, /*unbiased=*/false) + 1e-5).rsqrt();
    auto output_bound = 1e4 * std::ldexp(1.0, -23) * invstd + 1e-5;
    auto output_error = (y.to(torch::kDouble) - y_all.narrow(0, rows * rank, rows)).abs();
    EXPECT_TRUE(output_error.le(output_bound).all().item<bool>())
        << "output off by up to " << output_error.max().item<double>();
  });
}

TEST(SyncBatchNormErrors, OneValuePerChannelAcrossAllRanksIsRefused) {
  run_ranks(2, [](int rank) {
    World world = init();
    SyncBatchNorm sync(torch::nn::BatchNormOptions(3), world);
    auto x = torch::randn({rank == 0 ? 1 : 0, 3});
    expect_error<UsageError>([&] { sync(x); },
                             {"SyncBatchNorm needs more than one value per channel across all "
                              "ranks in training, got 1"});
  });
}

/// A CNN whose BatchNorms sit in a Sequential, so that they can be
/// converted.
struct BnNetImpl : torch::nn::Module {
  BnNetImpl()
      : features(register_module(
            "features",
            torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)),
                                  torch::nn::BatchNorm2d(4), torch::nn::ReLU(),
                                  torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 4, 3)),
                                  torch::nn::BatchNorm2d(4), torch::nn::ReLU()))),
        head(register_module("head", torch::nn::Linear(4 * 8 * 8, 5))) {}
  torch::Tensor forward(torch::Tensor x) {
    return head(features->forward(x).flatten(1));
  }
  torch::nn::Sequential features;
  torch::nn::Linear head;
};
TORCH_MODULE(BnNet);

class SyncBatchNormInDdp : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(WorldSize, SyncBatchNormInDdp, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

/// BnNet's layers as typed fields, its norms of type `Norm`, as a program
/// declares them: without a world in any constructor.
template <typename Norm>
struct FieldNetImpl : torch::nn::Module {
  FieldNetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)))),
        bn1(register_module("bn1", Norm(4))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 4, 3)))),
        bn2(register_module("bn2", Norm(4))),
        head(register_module("head", torch::nn::Linear(4 * 8 * 8, 5))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(bn1(conv1(x)));
    x = torch::relu(bn2(conv2(x)));
    return head(x.flatten(1));
  }
  torch::nn::Conv2d conv1;
  Norm bn1;
  torch::nn::Conv2d conv2;
  Norm bn2;
  torch::nn::Linear head;
};
template <typename Norm>
using FieldNet = torch::nn::ModuleHolder<FieldNetImpl<Norm>>;

// Equal shards: with SyncBatchNorm, N ranks compute what one process
// computes on the whole batch, running statistics included; the
// statistics are the same on every rank, so nothing is broadcast.
// `prepare` makes the model's BatchNorms synchronised, before the wrapper.
template <typename Model, typename Reference>
void expect_ddp_equals_one_process(int rank, const std::function<void(Model&, World&)>& prepare) {
  World world = init();
  int n = world.size();
  torch::manual_seed(21);
  Model model;
  torch::manual_seed(21);
  Reference reference;
  model->to(torch::kDouble);
  reference->to(torch::kDouble);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD reference_optimizer(reference->parameters(),
                                        torch::optim::SGDOptions(0.1).momentum(0.9));
  prepare(model, world);
  DDP<Model> ddp(model, world);
  for (int step = 0; step < 4; ++step) {
    auto [x, y] = global_batch(step, 3 * n, {1, 12, 12});
    x = x.to(torch::kDouble);
    y = y.to(torch::kDouble);
    optimizer.zero_grad();
    torch::mse_loss(ddp(x.narrow(0, 3 * rank, 3)), y.narrow(0, 3 * rank, 3)).backward();
    optimizer.step();
    reference_optimizer.zero_grad();
    torch::mse_loss(reference(x), y).backward();
    reference_optimizer.step();
    auto at_step = "after step " + std::to_string(step);
    expect_close_parameters(*model, *reference, kFloat64Tolerance, at_step);
    auto buffers = model->buffers();
    auto reference_buffers = reference->buffers();
    for (size_t i = 0; i < buffers.size(); ++i) {
      expect_close(buffers[i], reference_buffers[i], kFloat64Tolerance,
                   "buffer " + std::to_string(i) + " " + at_step);
    }
    ddp.check_replicas(); // the buffers too: they are in step
  }
  EXPECT_EQ(ddp.stats().total.buffer_broadcasts, 0);
  EXPECT_EQ(ddp.stats().total.buffer_agreements, 0);
}

TEST_P(SyncBatchNormInDdp, MatchesOneProcessWithBatchNormOnTheWholeBatch) {
  run_ranks(GetParam(), [](int rank) {
    expect_ddp_equals_one_process<BnNet, BnNet>(rank, [](BnNet& model, World& world) {
      EXPECT_EQ(convert_sync_batchnorm(*model, world), 2);
    });
  });
}

TEST_P(SyncBatchNormInDdp, DeclaredWithoutAWorldItTakesTheWrappersWorld) {
  run_ranks(GetParam(), [](int rank) {
    expect_ddp_equals_one_process<FieldNet<SyncBatchNorm>, FieldNet<torch::nn::BatchNorm2d>>(
        rank, [](FieldNet<SyncBatchNorm>& model, World&) {
          EXPECT_FALSE(model->bn1->world.has_value());
        });
  });
}

TEST(SyncBatchNorm, WithoutAWorldItIsBatchNormBitForBit) {
  // A program of one process (the twin of a distributed one) runs the same
  // model code: without a wrapper, a SyncBatchNorm is a BatchNorm, in
  // training and in evaluation, with momentum or a cumulative average.
  for (c10::optional<double> momentum : {c10::optional<double>(0.1), c10::optional<double>()}) {
    torch::manual_seed(5);
    SyncBatchNorm sync(torch::nn::BatchNormOptions(3).momentum(momentum));
    torch::nn::BatchNorm2d plain(torch::nn::BatchNormOptions(3).momentum(momentum));
    for (int step = 0; step < 3; ++step) {
      auto x = torch::randn({4, 3, 5, 5}, torch::requires_grad());
      auto y = torch::randn({4, 3, 5, 5});
      auto out = sync(x);
      auto expected_out = plain(x);
      EXPECT_TRUE(torch::equal(out, expected_out)) << "output at " << step;
      auto grad = torch::autograd::grad({(out * y).sum()}, {x, sync->weight, sync->bias});
      auto expected =
          torch::autograd::grad({(expected_out * y).sum()}, {x, plain->weight, plain->bias});
      for (size_t i = 0; i < grad.size(); ++i) {
        EXPECT_TRUE(torch::equal(grad[i], expected[i])) << "gradient " << i << " at " << step;
      }
      EXPECT_TRUE(torch::equal(sync->running_mean, plain->running_mean));
      EXPECT_TRUE(torch::equal(sync->running_var, plain->running_var));
      EXPECT_TRUE(torch::equal(sync->num_batches_tracked, plain->num_batches_tracked));
    }
    sync->eval();
    plain->eval();
    auto x = torch::randn({2, 3, 5, 5});
    EXPECT_TRUE(torch::equal(sync(x), plain(x)));
    // BatchNorm's own check, too.
    sync->train();
    expect_error<c10::Error>([&] { sync(torch::randn({1, 3, 1, 1})); },
                             {"Expected more than 1 value per channel when training"});
  }
}

TEST(SyncBatchNorm, TheWrapperThatBoundItLetsGoWhenItEnds) {
  // Trained alone after the wrapper has gone (or by a later wrapper), it
  // must not reduce in the first wrapper's world any more.
  run_ranks(1, [](int) {
    World world = init();
    FieldNet<SyncBatchNorm> model;
    {
      DDP<FieldNet<SyncBatchNorm>> ddp(model, world);
      EXPECT_TRUE(model->bn1->world.has_value());
    }
    EXPECT_FALSE(model->bn1->world.has_value());
    EXPECT_FALSE(model->bn2->world.has_value());
    SyncBatchNorm bound(torch::nn::BatchNormOptions(4), world);
    torch::nn::Sequential holder(bound);
    { DDP<torch::nn::Sequential> ddp(holder, world); }
    EXPECT_TRUE(bound->world.has_value()) << "a world given by the program stays";
  });
}

/// A BatchNorm in each kind of container, and one in a field.
struct HoldersImpl : torch::nn::Module {
  HoldersImpl()
      : sequential(register_module("sequential",
                                   torch::nn::Sequential(torch::nn::Linear(4, 4),
                                                         torch::nn::BatchNorm1d(4)))),
        list(register_module("list", torch::nn::ModuleList(torch::nn::BatchNorm2d(4)))),
        dict(register_module(
            "dict", torch::nn::ModuleDict(
                        std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>{
                            {"norm", torch::nn::BatchNorm3d(4).ptr()}}))) {}
  torch::nn::Sequential sequential;
  torch::nn::ModuleList list;
  torch::nn::ModuleDict dict;
};
TORCH_MODULE(Holders);

struct FieldImpl : torch::nn::Module {
  FieldImpl()
      : inner(register_module("inner", Holders())),
        norm(register_module("norm", torch::nn::BatchNorm1d(4))) {}
  Holders inner;
  torch::nn::BatchNorm1d norm;
};
TORCH_MODULE(Field);

TEST(ConvertSyncBatchNorm, ReplacesEveryBatchNormInContainersKeepingItsTensors) {
  run_ranks(1, [](int) {
    World world = init();
    Holders holders;
    torch::NoGradGuard no_grad;
    holders->sequential->ptr(1)->named_buffers()["running_mean"].fill_(0.5);
    auto before = holders->named_parameters();
    auto buffers_before = holders->named_buffers();
    EXPECT_EQ(convert_sync_batchnorm(*holders, world), 3);
    EXPECT_NE(holders->sequential->ptr(1)->as<SyncBatchNorm>(), nullptr);
    EXPECT_NE(holders->list->ptr(0)->as<SyncBatchNorm>(), nullptr);
    EXPECT_NE(holders->dict["norm"]->as<SyncBatchNorm>(), nullptr);
    auto after = holders->named_parameters();
    auto buffers_after = holders->named_buffers();
    ASSERT_EQ(after.keys(), before.keys());
    for (const auto& item : before) {
      EXPECT_TRUE(after[item.key()].is_same(item.value())) << item.key();
    }
    ASSERT_EQ(buffers_after.keys(), buffers_before.keys());
    for (const auto& item : buffers_before) {
      EXPECT_TRUE(buffers_after[item.key()].is_same(item.value())) << item.key();
    }
    // The Sequential runs the replacement.
    torch::AutoGradMode grad(true);
    holders->sequential->forward(torch::randn({6, 4}));
    EXPECT_EQ(holders->sequential->ptr(1)->named_buffers()["num_batches_tracked"].item<int64_t>(),
              1);
  });
}

TEST(ConvertSyncBatchNorm, ABatchNormInAFieldIsRefusedAndNothingChanges) {
  run_ranks(1, [](int) {
    World world = init();
    Field model;
    expect_error<UsageError>(
        [&] { convert_sync_batchnorm(*model, world); },
        {"convert_sync_batchnorm cannot replace the BatchNorm at 'norm': a field of its "
         "parent module points to it",
         "Nothing was replaced."});
    EXPECT_EQ(model->inner->sequential->ptr(1)->as<SyncBatchNorm>(), nullptr);
    EXPECT_NE(model->inner->sequential->ptr(1)->as<torch::nn::BatchNorm1d>(), nullptr);
  });
}

} // namespace
} // namespace lockstep::testing
