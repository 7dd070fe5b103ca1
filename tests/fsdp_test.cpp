// FullyShardedDataParallel against one process: N ranks, each on its shard
// of the global batch, must hold after every step the parameters that one
// process training on the whole batch holds, within float64 rounding. A
// transformer-like model (an embedding tied to the output layer, blocks of
// attention, MLP and LayerNorm, each block a unit), with units nested and
// not, reshard after forward on and off, SGD with momentum, Adam and AdamW
// with weight decay and clipping; at 2, 3 and 4 ranks.

#include <cmath>
#include <fstream>
#include <iterator>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/clip_grad_norm.h>
#include <lockstep/fsdp.h>
#include <lockstep/sync_batch_norm.h>
#include <lockstep/world.h>

#include "support/expect_error.h"
#include "support/multiprocess.h"
#include "support/scratch_folder.h"
#include "support/small_cnn.h"
#include "support/tiny_transformer.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

using namespace tiny;

enum class Optim { SgdMomentum, Adam, AdamWClipped };

std::unique_ptr<torch::optim::Optimizer> make(Optim kind, std::vector<torch::Tensor> params) {
  switch (kind) {
    case Optim::SgdMomentum:
      return std::make_unique<torch::optim::SGD>(
          params, torch::optim::SGDOptions(0.1).momentum(0.9));
    case Optim::Adam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
    case Optim::AdamWClipped:
      return std::make_unique<torch::optim::AdamW>(
          params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  }
  return nullptr;
}

constexpr double kMaxNorm = 0.5; // below the gradients' norm: clipping acts

struct Case {
  bool nested;
  bool reshard_after_forward;
  Optim optim;
  std::string name;
  bool prefetch = false;
};
void PrintTo(const Case& c, std::ostream* out) {
  *out << c.name;
}

class Fsdp : public ::testing::TestWithParam<std::tuple<WorldSetup, Case>> {};

TEST_P(Fsdp, ShardsTrainAsOneProcessOnTheWholeBatch) {
  auto [setup, c] = GetParam();
  run_ranks(setup, [&, setup = setup, c = c](int rank) {
    World world = init();
    auto reference = float64_model<TinyTransformer>(0, c.nested);
    auto model = float64_model<TinyTransformer>(0, c.nested);
    FullyShardedDataParallel<TinyTransformer> fsdp(
        model, world,
        FsdpOptions().reshard_after_forward(c.reshard_after_forward).prefetch(c.prefetch));
    std::vector<std::string> units{"", "block0", "block1", "block2"};
    if (c.nested) {
      units = {"", "block0", "block0.feed_forward", "block1", "block1.feed_forward",
               "block2", "block2.feed_forward"};
    }
    EXPECT_EQ(fsdp.unit_names(), units);
    for (const auto& param : model->parameters()) {
      EXPECT_EQ(param.numel(), 0) << "freed outside forward and backward";
    }
    auto reference_optimizer = make(c.optim, reference->parameters());
    auto optimizer = make(c.optim, fsdp.parameters());
    int64_t share = kSamples / setup.size;
    for (int64_t step = 0; step < 4; ++step) {
      auto [tokens, targets] = token_batch(step);
      reference_optimizer->zero_grad();
      loss_of(reference(tokens), targets).backward();
      optimizer->zero_grad();
      auto loss = loss_of(fsdp(tokens.narrow(0, rank * share, share)),
                          targets.narrow(0, rank * share, share));
      // A unit's parameters exist only while it computes, or, kept
      // gathered, from its forward to its backward.
      int64_t qkv_elements = 3 * kWidth * kWidth;
      std::vector<int64_t> expected_gathered(3, c.reshard_after_forward ? 0 : qkv_elements);
      EXPECT_EQ(model->gathered_after_block, expected_gathered);
      loss.backward();
      for (const auto& param : model->parameters()) {
        ASSERT_EQ(param.numel(), 0) << "freed after backward";
      }
      if (c.optim == Optim::AdamWClipped) {
        double expected = torch::nn::utils::clip_grad_norm_(reference->parameters(), kMaxNorm);
        double norm = clip_grad_norm_(fsdp.parameters(), kMaxNorm, world);
        EXPECT_NEAR(norm, expected, 1e-12 * expected);
      }
      reference_optimizer->step();
      optimizer->step();
      auto full = fsdp.full_parameters();
      expect_close_parameters(full, *reference, "step " + std::to_string(step));
      expect_same_on_every_rank(world, flatten(full.values()), "the full parameters");
    }
  });
}

std::vector<WorldSetup> two_three_and_four_ranks() {
  std::vector<WorldSetup> setups;
  for (const auto& setup : every_world_setup()) {
    if (setup.size >= 2) {
      setups.push_back(setup);
    }
  }
  return setups;
}

INSTANTIATE_TEST_SUITE_P(
    WorldSizeAndCase,
    Fsdp,
    ::testing::Combine(
        ::testing::ValuesIn(two_three_and_four_ranks()),
        ::testing::Values(Case{false, true, Optim::SgdMomentum, "sgd"},
                          Case{false, true, Optim::SgdMomentum, "prefetching_sgd", true},
                          Case{true, true, Optim::Adam, "nested_prefetching_adam", true},
                          Case{false, false, Optim::AdamWClipped, "kept_gathered_adamw_clipped"},
                          Case{true, false, Optim::SgdMomentum, "nested_kept_gathered_sgd"})),
    [](const auto& info) {
      return std::get<0>(info.param).name() + "_" + std::get<1>(info.param).name;
    });

class FsdpBatchNorm : public ::testing::TestWithParam<WorldSetup> {};

TEST_P(FsdpBatchNorm, ACnnWithSyncBatchNormTrainsAsOneProcess) {
  auto setup = GetParam();
  run_ranks(setup, [setup](int rank) {
    World world = init();
    auto reference = float64_model<SmallCnn>(3);
    auto model = float64_model<SmallCnn>(3);
    FullyShardedDataParallel<SmallCnn> fsdp(model, world);
    torch::optim::SGD reference_optimizer(reference->parameters(),
                                          torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::SGD optimizer(fsdp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    int64_t share = kSamples / setup.size;
    for (int64_t step = 0; step < 4; ++step) {
      auto [x, y] = global_batch(step, kSamples, {1, 8, 8});
      x = x.to(torch::kDouble);
      y = y.to(torch::kDouble);
      reference_optimizer.zero_grad();
      torch::mse_loss(reference(x), y).backward();
      reference_optimizer.step();
      optimizer.zero_grad();
      torch::mse_loss(fsdp(x.narrow(0, rank * share, share)), y.narrow(0, rank * share, share))
          .backward();
      optimizer.step();
      expect_close_parameters(fsdp.full_parameters(), *reference,
                              "step " + std::to_string(step));
      auto buffers = model->named_buffers();
      for (const auto& item : reference->named_buffers()) {
        EXPECT_TRUE(torch::allclose(buffers[item.key()], item.value(), 0, kFloat64Tolerance))
            << item.key() << " at step " << step;
      }
      fsdp.check_replicas(); // SyncBatchNorm's statistics agree
    }
    // A statistic changed on one rank only is named, on every rank.
    if (rank == 1) {
      torch::NoGradGuard no_grad;
      model->named_buffers()["second.norm.running_var"].add_(1);
    }
    expect_error<UsageError>([&] { fsdp.check_replicas(); },
                             {"'second.norm.running_var' on rank 1 differs from rank 0's",
                              "use SyncBatchNorm"});
    fsdp.check_replicas(ReplicaCheck::Parameters);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSize, FsdpBatchNorm,
                         ::testing::ValuesIn(two_three_and_four_ranks()),
                         [](const auto& info) { return info.param.name(); });

// The timeline shows each unit's gathers, prefetches and reduce-scatters on
// a track of their own: in the second step, forward prefetches block1 and
// block2, backward block1 and block0.
TEST(FsdpTimeline, GathersAndReduceScattersAreSpansOfTheirUnits) {
  ScratchFolder folder("fsdp-timeline");
  std::string prefix = folder / "trace";
  LaunchOptions options;
  options.world_size = 2;
  options.environment = [&](int, RankEnvironment& env) {
    env["LOCKSTEP_TIMELINE"] = prefix;
  };
  auto result = launch_ranks(options, [](int rank) {
    World world = init();
    torch::manual_seed(0);
    TinyTransformer model(false);
    model->to(torch::kDouble);
    FullyShardedDataParallel<TinyTransformer> fsdp(model, world, FsdpOptions().prefetch(true));
    for (int64_t step = 0; step < 2; ++step) { // the second follows the first's order
      auto [tokens, targets] = token_batch(step);
      loss_of(fsdp(tokens.narrow(0, rank * 6, 6)), targets.narrow(0, rank * 6, 6)).backward();
    }
  });
  ASSERT_TRUE(result.ok()) << result.report();
  std::ifstream trace(prefix + ".rank0.json");
  std::string text((std::istreambuf_iterator<char>(trace)), std::istreambuf_iterator<char>());
  for (const char* span : {"FSDP units", "gather root", "gather block0", "gather block2",
                           "reduce-scatter block2", "reduce-scatter block0",
                           "reduce-scatter root", "prefetch block1", "prefetch block2",
                           "prefetch block0"}) {
    EXPECT_NE(text.find(span), std::string::npos) << span;
  }
}

// A unit whose output is a view of its own parameter (a position table)
// stays gathered until the end of backward; a forward without backward
// between a backward and the step (an evaluation with autograd on) leaves
// nothing gathered that the next step would read from before the update.
struct PositionsImpl : torch::nn::Module {
  PositionsImpl() : table(register_parameter("table", torch::randn({kTokens, kWidth}))) {}
  torch::Tensor forward(int64_t tokens) {
    return table.narrow(0, 0, tokens);
  }
  torch::Tensor table;
};
TORCH_MODULE(Positions);

struct WithPositionsImpl : torch::nn::Module {
  WithPositionsImpl()
      : positions(register_module("positions", Sharded<Positions>())),
        body(register_module("body", TinyTransformer(false))) {}
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto x = body->embedding(tokens) + positions(tokens.size(1));
    for (auto& block : body->blocks) {
      x = block(x);
    }
    return torch::matmul(body->final_norm(x), body->embedding->weight.t());
  }
  Sharded<Positions> positions;
  TinyTransformer body;
};
TORCH_MODULE(WithPositions);

TEST(FsdpLife, AViewOfAUnitsParametersAndAForwardBetweenBackwardAndStep) {
  run_ranks(2, [](int rank) {
    World world = init();
    auto reference = float64_model<WithPositions>(4);
    auto model = float64_model<WithPositions>(4);
    FullyShardedDataParallel<WithPositions> fsdp(model, world);
    torch::optim::Adam reference_optimizer(reference->parameters(), torch::optim::AdamOptions(1e-2));
    torch::optim::Adam optimizer(fsdp.parameters(), torch::optim::AdamOptions(1e-2));
    for (int64_t step = 0; step < 3; ++step) {
      auto [tokens, targets] = token_batch(step);
      reference_optimizer.zero_grad();
      loss_of(reference(tokens), targets).backward();
      reference_optimizer.step();
      optimizer.zero_grad();
      loss_of(fsdp(tokens.narrow(0, rank * 6, 6)), targets.narrow(0, rank * 6, 6)).backward();
      fsdp(tokens.narrow(0, rank * 6, 6)); // with autograd, never backward
      optimizer.step();
      expect_close_parameters(fsdp.full_parameters(), *reference,
                              "step " + std::to_string(step));
    }
  });
}

// Gradients that travel in bfloat16: each rank's rounded to it, each share
// halved in bfloat16, the two summed in float32 and rounded once (World's
// 16-bit average), back in float64 for the step: computed here by hand from
// each shard's own gradients, and equal to the bit. A dtype that is not
// floating is refused.
TEST(FsdpReduceDtype, Bfloat16GradientsAverageAsTheDtypeRoundsThem) {
  run_ranks(2, [](int rank) {
    World world = init();
    auto reference = float64_model<TinyTransformer>(0, false);
    auto model = float64_model<TinyTransformer>(0, false);
    FullyShardedDataParallel<TinyTransformer> fsdp(
        model, world, FsdpOptions().reduce_dtype(torch::kBFloat16));
    torch::optim::SGD reference_optimizer(reference->parameters(), 0.1);
    torch::optim::SGD optimizer(fsdp.parameters(), 0.1);
    for (int64_t step = 0; step < 2; ++step) {
      auto [tokens, targets] = token_batch(step);
      std::vector<std::vector<torch::Tensor>> shares;
      for (int r = 0; r < 2; ++r) {
        reference_optimizer.zero_grad();
        loss_of(reference(tokens.narrow(0, r * 6, 6)), targets.narrow(0, r * 6, 6)).backward();
        std::vector<torch::Tensor> share;
        for (const auto& param : reference->parameters()) {
          share.push_back(param.grad().to(torch::kBFloat16).div(2).to(torch::kFloat));
        }
        shares.push_back(share);
      }
      auto params = reference->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        params[i].mutable_grad() =
            (shares[0][i] + shares[1][i]).to(torch::kBFloat16).to(torch::kDouble);
      }
      reference_optimizer.step();
      optimizer.zero_grad();
      loss_of(fsdp(tokens.narrow(0, rank * 6, 6)), targets.narrow(0, rank * 6, 6)).backward();
      optimizer.step();
      auto full = fsdp.full_parameters();
      for (const auto& item : reference->named_parameters()) {
        EXPECT_TRUE(torch::equal(full[item.key()], item.value()))
            << item.key() << " at step " << step;
      }
    }
    expect_error<ConfigError>(
        [&] {
          FullyShardedDataParallel<TinyTransformer> refused(
              TinyTransformer(false), world, FsdpOptions().reduce_dtype(torch::kInt));
        },
        {"FsdpOptions::reduce_dtype takes a floating dtype", "not Int"});
  });
}

// A unit that multiplies by a weight it is given, so that two units can be
// given the same one.
struct ProductImpl : torch::nn::Module {
  explicit ProductImpl(torch::Tensor given) : weight(register_parameter("weight", given)) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return x.matmul(weight);
  }
  torch::Tensor weight;
};
TORCH_MODULE(Product);

struct TiedAcrossUnitsImpl : torch::nn::Module {
  TiedAcrossUnitsImpl()
      : first(register_module("first", Sharded<Product>(torch::randn({4, 4})))),
        second(register_module("second", Sharded<Product>(first->weight))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return second(first(x));
  }
  Sharded<Product> first, second;
};
TORCH_MODULE(TiedAcrossUnits);

// A unit of one dtype after a unit whose bias has another: refused before
// the first unit is sharded.
struct TwoDtypesImpl : torch::nn::Module {
  TwoDtypesImpl()
      : before(register_module("before", Sharded<torch::nn::Linear>(4, 4))),
        layer(register_module("layer", Sharded<torch::nn::Linear>(4, 4))) {
    layer->bias.set_data(layer->bias.to(torch::kDouble));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return layer(before(x));
  }
  Sharded<torch::nn::Linear> before, layer;
};
TORCH_MODULE(TwoDtypes);

// What cannot be sharded is refused by name on every rank, before anything
// travels; the world stays usable.
TEST(FsdpErrors, TiedWeightsAcrossUnitsAndTwoDtypesInOneUnitAreRefusedByName) {
  run_ranks(2, [](int /*rank*/) {
    World world = init();
    expect_error<ConfigError>(
        [&] { FullyShardedDataParallel<TiedAcrossUnits> fsdp(TiedAcrossUnits(), world); },
        {"first.weight and second.weight are one parameter (tied weights) in two units",
         "Tied weights must live in one unit"});
    TwoDtypes two_dtypes;
    expect_error<ConfigError>(
        [&] { FullyShardedDataParallel<TwoDtypes> fsdp(two_dtypes, world); },
        {"the parameters of one unit must share a dtype", "unit layer holds layer.weight",
         "layer.bias"});
    EXPECT_EQ(two_dtypes->before->weight.numel(), 16) << "a refusal leaves the module as it was";
    auto sum = torch::ones({3});
    world.all_reduce(sum);
    EXPECT_TRUE(torch::equal(sum, torch::full({3}, 2.0)));
  });
}

// The module's own forward, around the wrapper, would run on freed
// parameters: the first unit it reaches says so, and the wrapper still
// trains afterwards.
TEST(FsdpErrors, TheModulesForwardAroundTheWrapperIsAUsageError) {
  run_ranks(2, [](int rank) {
    World world = init();
    torch::manual_seed(0);
    TinyTransformer model(false);
    model->to(torch::kDouble);
    FullyShardedDataParallel<TinyTransformer> fsdp(model, world);
    auto [tokens, targets] = token_batch(0);
    expect_error<UsageError>([&] { model->blocks[0](torch::randn({2, kTokens, kWidth})); },
                             {"unit block0 ran outside the wrapper's forward",
                              "Call the wrapper (fsdp(input))"});
    loss_of(fsdp(tokens.narrow(0, rank * 6, 6)), targets.narrow(0, rank * 6, 6)).backward();
    EXPECT_EQ(fsdp.parameters().front().grad().dim(), 1);
  });
}

// A model declared with units is the plain model outside a wrapper, and a
// unit belongs to one live wrapper at a time.
TEST(FsdpErrors, AUnitIsShardedByOneWrapperAtATime) {
  run_ranks(2, [](int /*rank*/) {
    World world = init();
    TiedAcrossUnits unused; // declared units, never wrapped: plain modules
    EXPECT_EQ(unused(torch::ones({1, 4})).sizes(), (std::vector<int64_t>{1, 4}));
    TwoDtypes doubled;
    doubled->to(torch::kDouble);
    FullyShardedDataParallel<TwoDtypes> first(doubled, world);
    expect_error<ConfigError>(
        [&] { FullyShardedDataParallel<TwoDtypes> second(doubled, world); },
        {"unit before is already sharded by another FullyShardedDataParallel"});
  });
}

// Uneven inputs: rank 1 runs out of batches after one step and closes its
// world; rank 0's next step cannot gather without it. Not a hang until the
// timeout: an error at once, naming rank 1 and what it completed. (PyTorch's
// FSDP is not Joinable either; docs/ddp.md says to give every rank as many
// batches, as DistributedSampler does.)
TEST(FsdpErrors, ARankThatStopsEarlyIsNamedAtOnceNotAfterTheTimeout) {
  run_ranks(2, [](int rank) {
    World world = init();
    auto model = float64_model<TinyTransformer>(0, false);
    FullyShardedDataParallel<TinyTransformer> fsdp(model, world);
    torch::optim::SGD optimizer(fsdp.parameters(), torch::optim::SGDOptions(0.1));
    int steps = rank == 0 ? 2 : 1;
    for (int64_t step = 0; step < steps; ++step) {
      auto [tokens, targets] = token_batch(step);
      auto train = [&] {
        optimizer.zero_grad();
        loss_of(fsdp(tokens.narrow(0, rank * 6, 6)), targets.narrow(0, rank * 6, 6)).backward();
        optimizer.step();
      };
      if (step == 0) {
        train();
        continue;
      }
      auto start = std::chrono::steady_clock::now();
      expect_error<CollectiveError>(train, {"rank 1 closed its world having completed"});
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
    }
  });
}

} // namespace
} // namespace lockstep::testing
