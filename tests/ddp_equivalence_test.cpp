// The core test: N ranks training on N shards end every step with the same
// parameters as one process trained on the whole batch, and bit-identical to
// each other; over world sizes 1 to 4 and every bucket and option setting.
// Float64 throughout, so that "the same" is exact in kind on every CPU
// (kFloat64Tolerance says why); float32 against the float64 trajectory.
// From 2 ranks on, once over shared memory and once over Gloo.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "support/models.h"
#include "support/multiprocess.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

struct NamedOptions {
  const char* name;
  DdpOptions options;
};

const NamedOptions kSettings[] = {
    {"defaults", DdpOptions()},
    {"one_parameter_per_bucket", DdpOptions().bucket_cap_mb(0).first_bucket_cap_mb(0)},
    {"one_bucket", DdpOptions().bucket_cap_mb(1000).first_bucket_cap_mb(1000)},
    {"gradients_copied", DdpOptions().gradient_as_bucket_view(false)},
    {"find_unused_parameters", DdpOptions().find_unused_parameters(true)},
    {"static_graph", DdpOptions().static_graph(true)},
    {"tiny_buckets_copied_find_unused",
     DdpOptions().bucket_cap_mb(0).first_bucket_cap_mb(0)
         .gradient_as_bucket_view(false).find_unused_parameters(true)},
    {"one_bucket_copied_static",
     DdpOptions().bucket_cap_mb(1000).first_bucket_cap_mb(1000)
         .gradient_as_bucket_view(false).static_graph(true)},
};

class Equivalence : public ::testing::TestWithParam<std::tuple<WorldSetup, int>> {};

TEST_P(Equivalence, MatchesOneProcessOnTheWholeBatch) {
  auto [world, setting] = GetParam();
  run_ranks(world, [setting = setting](int) {
    World world = init();
    const auto& options = kSettings[setting].options;
    for (auto optimizer : {OptimizerKind::Sgd, OptimizerKind::Adam}) {
      SCOPED_TRACE(optimizer == OptimizerKind::Sgd ? "SGD" : "Adam");
      SideBySide setup;
      setup.optimizer = optimizer;
      {
        SCOPED_TRACE("MLP");
        train_side_by_side<Mlp>(world, [] { return Mlp(); }, options, setup,
                                plain_forward);
      }
      {
        SCOPED_TRACE("CNN");
        SideBySide cnn = setup;
        cnn.input_shape = {1, 12, 12};
        train_side_by_side<Cnn>(world, [] { return Cnn(); }, options, cnn,
                                plain_forward);
      }
      if (!options.static_graph()) {
        SCOPED_TRACE("heads unused by rank and by step");
        SideBySide branchy = setup;
        branchy.rank_dependent = true;
        branchy.steps = 6;
        train_side_by_side<Branchy>(
            world, [] { return Branchy(); }, options, branchy,
            [](auto& model, torch::Tensor x, int64_t step, int rank) {
              return model(x, static_cast<int64_t>(rank + step));
            });
      }
    }
  }, std::chrono::seconds(240));
}

INSTANTIATE_TEST_SUITE_P(
    WorldSizeAndSetting,
    Equivalence,
    ::testing::Combine(::testing::ValuesIn(every_world_setup()),
                       ::testing::Range(0, static_cast<int>(std::size(kSettings)))),
    [](const auto& info) {
      return std::get<0>(info.param).name() + "_" + kSettings[std::get<1>(info.param)].name;
    });

// Float32, as most models train: both the DDP model and the one-process
// model are compared with a float64 one (see expect_as_close_to_exact).
// SGD only: Adam divides each update by the root of its running square, so
// a gradient element that is zero up to float32 rounding gets an update of
// +lr or -lr depending on that rounding. Two summation orders then differ
// by 2 lr in such an element on some CPUs; Adam is compared in float64.
class Float32Equivalence : public ::testing::TestWithParam<int> {};

TEST_P(Float32Equivalence, AsCloseToExactAsOneProcess) {
  run_ranks(GetParam(), [](int) {
    World world = init();
    SideBySide setup;
    setup.dtype = torch::kFloat;
    {
      SCOPED_TRACE("MLP");
      train_side_by_side<Mlp>(world, [] { return Mlp(); }, DdpOptions(), setup,
                              plain_forward);
    }
    {
      SCOPED_TRACE("CNN");
      SideBySide cnn = setup;
      cnn.input_shape = {1, 12, 12};
      train_side_by_side<Cnn>(world, [] { return Cnn(); }, DdpOptions(), cnn,
                              plain_forward);
    }
    {
      SCOPED_TRACE("heads unused by rank and by step");
      SideBySide branchy = setup;
      branchy.rank_dependent = true;
      branchy.steps = 6;
      train_side_by_side<Branchy>(
          world, [] { return Branchy(); }, DdpOptions(), branchy,
          [](auto& model, torch::Tensor x, int64_t step, int rank) {
            return model(x, static_cast<int64_t>(rank + step));
          });
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSize, Float32Equivalence, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) {
                           return "world" + std::to_string(info.param);
                         });

class ModelKinds : public ::testing::TestWithParam<WorldSetup> {};

TEST_P(ModelKinds, FrozenLayerIsLeftOut) {
  run_ranks(GetParam(), [](int) {
    World world = init();
    auto stats = train_side_by_side<Mlp>(
        world, [] { return frozen_mlp(); }, DdpOptions(), SideBySide(),
        plain_forward);
    for (const auto& bucket : stats.bucket_parameters) {
      for (const auto& name : bucket) {
        EXPECT_EQ(name.rfind("fc1.", 0), std::string::npos)
            << "frozen " << name << " is in a bucket";
      }
    }
  });
}

TEST_P(ModelKinds, TiedWeightIsReducedOnce) {
  run_ranks(GetParam(), [](int) {
    World world = init();
    for (auto optimizer : {OptimizerKind::Sgd, OptimizerKind::Adam}) {
      SideBySide setup;
      setup.optimizer = optimizer;
      auto stats = train_side_by_side<Tied>(
          world, [] { return Tied(); }, DdpOptions(), setup, plain_forward);
      int appearances = 0;
      for (const auto& bucket : stats.bucket_parameters) {
        for (const auto& name : bucket) {
          appearances += name == "weight" || name == "holder.weight_again";
        }
      }
      EXPECT_EQ(appearances, 1);
    }
  });
}

TEST_P(ModelKinds, EachDtypeHasItsOwnBuckets) {
  run_ranks(GetParam(), [](int) {
    World world = init();
    SideBySide setup;
    setup.dtype = std::nullopt; // each layer keeps its dtype
    auto stats = train_side_by_side<MixedPrecision>(
        world, [] { return MixedPrecision(); }, DdpOptions(), setup,
        plain_forward);
    ASSERT_EQ(stats.bucket_parameters.size(), 3u);
    for (const auto& bucket : stats.bucket_parameters) {
      auto prefix = bucket.front().substr(0, bucket.front().find('.'));
      for (const auto& name : bucket) {
        EXPECT_EQ(name.substr(0, name.find('.')), prefix)
            << "a bucket mixes dtypes";
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSize, ModelKinds, ::testing::ValuesIn(every_world_setup()),
                         [](const auto& info) { return info.param.name(); });

} // namespace
} // namespace lockstep::testing
