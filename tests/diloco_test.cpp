// DiLoCo, Streaming DiLoCo and LocalSGD (diloco.h) against references
// written here, in float64: N replicas simulated in one process, each with
// its own model and inner optimizer, and the global parameters stepped by
// outer optimizers of their own, as torchft's schedule says. And the one
// case where they are plain DDP: H = 1 with a stateless inner SGD.

#include <cmath>
#include <tuple>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/diloco.h>
#include <lockstep/lockstep.h>
#include <lockstep/replica_groups.h>

#include "support/diloco_reference.h"
#include "support/expect_error.h"
#include "support/models.h"
#include "support/multiprocess.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

class StreamingDiLoCo : public ::testing::TestWithParam<StreamingCase> {};

constexpr int64_t kSyncEvery = 6;
constexpr int64_t kSteps = 14;

TEST_P(StreamingDiLoCo, EqualsTorchftsScheduleAndArithmetic) {
  const auto c = GetParam();
  // A sum of 16-bit values in float32 can depend on its order (values far
  // apart in magnitude), which the transport chooses; of two, it cannot.
  const int replicas = c.wire ? 2 : 3;
  run_ranks(replicas, [c, replicas](int rank) {
    auto reference = streaming_reference(c, replicas, kSyncEvery, kSteps);
    World world = init();
    // Each replica draws its own parameters: rank 0's become everyone's.
    Mlp model = float64_mlp(3 + static_cast<uint64_t>(rank));
    torch::optim::SGD inner(model->parameters(), inner_options());
    auto fragments = fragments_of(model, c.fragments);
    std::vector<std::unique_ptr<torch::optim::SGD>> outers;
    std::vector<torch::optim::Optimizer*> outer_pointers;
    if (c.shared_outer) {
      // Momentum is per parameter, so one SGD over all fragments steps each
      // as its own would, provided it steps the synchronised fragment only.
      outers.push_back(std::make_unique<torch::optim::SGD>(model->parameters(), outer_options()));
      outer_pointers.push_back(outers.back().get());
    }
    for (const auto& fragment : fragments) {
      if (!c.shared_outer) {
        outers.push_back(std::make_unique<torch::optim::SGD>(fragment, outer_options()));
        outer_pointers.push_back(outers.back().get());
      }
    }
    DiLoCo diloco(world, fragments, inner, outer_pointers,
                  DiLoCoOptions().sync_every(kSyncEvery).fragment_sync_delay(c.delay)
                      .fragment_update_alpha(c.alpha).wire_dtype(c.wire));
    for (int64_t step = 0; step < kSteps; ++step) {
      auto [x, y] = replica_batch(step, replicas, rank);
      inner.zero_grad();
      torch::mse_loss(model(x), y).backward();
      int64_t syncs = diloco.syncs();
      diloco.step();
      auto parameters = model->parameters();
      const auto& expected = reference[static_cast<size_t>(step)][static_cast<size_t>(rank)];
      for (size_t i = 0; i < parameters.size(); ++i) {
        ASSERT_TRUE(torch::allclose(parameters[i], expected[i], 0, kFloat64Tolerance))
            << "parameter " << i << " after step " << step << ": largest difference "
            << (parameters[i] - expected[i]).abs().max().item<double>();
      }
      if (diloco.syncs() > syncs && c.alpha == 0) {
        // Just after its outer step a fragment holds the global
        // parameters, which every replica computed alike, bit for bit.
        expect_same_on_every_rank(
            world, flatten(fragments[static_cast<size_t>(syncs % c.fragments)]),
            "fragment " + std::to_string(syncs % c.fragments) + " after sync " +
                std::to_string(syncs));
      }
    }
    EXPECT_EQ(diloco.local_step(), kSteps);
    EXPECT_EQ(diloco.syncs(), kSteps / (kSyncEvery / c.fragments));
  });
}

INSTANTIATE_TEST_SUITE_P(
    Fragments, StreamingDiLoCo,
    ::testing::Values(StreamingCase{1, 0, 0.0}, StreamingCase{2, 0, 0.0},
                      StreamingCase{2, 1, 0.0}, StreamingCase{2, 1, 0.5},
                      StreamingCase{2, 0, 1.0}, StreamingCase{3, 0, 0.5},
                      StreamingCase{3, 1, 0.0}, StreamingCase{3, 1, 1.0},
                      StreamingCase{2, 0, 0.0, true}, StreamingCase{3, 1, 0.5, true},
                      StreamingCase{2, 1, 0.5, false, torch::kBFloat16},
                      StreamingCase{1, 0, 0.0, true, torch::kHalf}),
    [](const ::testing::TestParamInfo<StreamingCase>& info) {
      return "F" + std::to_string(info.param.fragments) + "_delay" +
          std::to_string(info.param.delay) + "_alpha" +
          std::to_string(static_cast<int>(info.param.alpha * 10)) +
          (info.param.shared_outer ? "_shared_outer" : "") +
          (info.param.wire ? std::string("_wire_") + c10::toString(*info.param.wire) : "");
    });

TEST(DiLoCoAcrossReplicas, EachReplicaRunsDdpInside) {
  // 4 ranks as 2 replicas of 2 on one host; tests/scripts/two-nodes runs
  // the same check as 2 hosts of 2 ranks in network namespaces.
  run_ranks(4, [](int) {
    World world = init();
    for (const auto& failure : check_diloco_with_ddp_inside(world, 2)) {
      ADD_FAILURE() << failure;
    }
  });
}

class EveryStepIsDdp : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(WorldSize, EveryStepIsDdp, ::testing::Values(2, 3),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

TEST_P(EveryStepIsDdp, DiLoCoAndLocalSgdWithHOfOneAndAPlainSgd) {
  // With a stateless inner SGD of rate lr, one fragment, H = 1 and an
  // outer SGD of rate 1, the global parameters move by lr times the
  // replicas' mean gradient each step: DDP's step, so one process on the
  // whole batch. LocalSGD with H = 1 averages the same parameters.
  run_ranks(GetParam(), [](int rank) {
    World world = init();
    int n = world.size();
    Mlp reference = float64_mlp();
    torch::optim::SGD reference_optimizer(reference->parameters(), 0.1);
    Mlp by_diloco = float64_mlp();
    torch::optim::SGD inner(by_diloco->parameters(), 0.1);
    torch::optim::SGD outer(by_diloco->parameters(), 1.0);
    DiLoCo diloco(world, {by_diloco->parameters()}, inner, {&outer},
                  DiLoCoOptions().sync_every(1));
    Mlp by_local_sgd = float64_mlp();
    torch::optim::SGD local_inner(by_local_sgd->parameters(), 0.1);
    LocalSGD local_sgd(world, by_local_sgd->parameters(), local_inner, 1);
    for (int64_t step = 0; step < 6; ++step) {
      auto [x, y] = global_batch(step, kPerReplica * n, {20});
      x = x.to(torch::kDouble);
      y = y.to(torch::kDouble);
      auto mine_x = x.narrow(0, kPerReplica * rank, kPerReplica);
      auto mine_y = y.narrow(0, kPerReplica * rank, kPerReplica);
      reference_optimizer.zero_grad();
      torch::mse_loss(reference(x), y).backward();
      reference_optimizer.step();
      inner.zero_grad();
      torch::mse_loss(by_diloco(mine_x), mine_y).backward();
      diloco.step();
      local_inner.zero_grad();
      torch::mse_loss(by_local_sgd(mine_x), mine_y).backward();
      local_sgd.step();
      auto at = "after step " + std::to_string(step);
      expect_close_parameters(*by_diloco, *reference, kFloat64Tolerance, "DiLoCo " + at);
      expect_close_parameters(*by_local_sgd, *reference, kFloat64Tolerance, "LocalSGD " + at);
    }
  });
}

TEST(DiLoCoErrors, OptionsThatBreakTheScheduleAreConfigErrors) {
  run_ranks(1, [](int) {
    World world = init();
    Mlp model = float64_mlp();
    torch::optim::SGD inner(model->parameters(), 0.1);
    torch::optim::SGD outer(model->parameters(), 0.7);
    auto two = fragments_of(model, 2);
    auto make = [&](std::vector<std::vector<torch::Tensor>> fragments, DiLoCoOptions options,
                    std::vector<torch::optim::Optimizer*> outers) {
      DiLoCo diloco(world, std::move(fragments), inner, std::move(outers), options);
    };
    expect_error<ConfigError>([&] { make(two, DiLoCoOptions().sync_every(5), {&outer}); },
                              {"must be a positive multiple of the number of fragments (2)"});
    expect_error<ConfigError>(
        [&] { make(two, DiLoCoOptions().sync_every(4).fragment_sync_delay(2), {&outer}); },
        {"fragment_sync_delay (2) must be at least 0 and less than sync_every / fragments (2)"});
    expect_error<ConfigError>(
        [&] { make(two, DiLoCoOptions().sync_every(4).fragment_update_alpha(1.5), {&outer}); },
        {"fragment_update_alpha must be within [0, 1]"});
    expect_error<ConfigError>([&] { make({}, DiLoCoOptions(), {&outer}); },
                              {"at least one fragment"});
    torch::optim::SGD other(model->fc1->parameters(), 0.7);
    expect_error<ConfigError>([&] { make(two, DiLoCoOptions().sync_every(4), {&other, &other}); },
                              {"the outer optimizer of fragment 1 does not hold"});
    expect_error<ConfigError>(
        [&] { make(two, DiLoCoOptions().sync_every(4), {&outer, &outer, &outer}); },
        {"one outer optimizer per fragment (2) or one for all, not 3"});
    expect_error<ConfigError>([&] { LocalSGD(world, model->parameters(), inner, 0); },
                              {"LocalSGD's sync_every must be 1 or more"});
  });
}

TEST(DiLoCoErrors, ReplicasThatDisagreeOnTheScheduleAllRaise) {
  run_ranks(2, [](int rank) {
    World world = init();
    Mlp model = float64_mlp();
    torch::optim::SGD inner(model->parameters(), 0.1);
    torch::optim::SGD outer(model->parameters(), 0.7);
    expect_error<ConfigError>(
        [&] {
          DiLoCo(world, {model->parameters()}, inner, {&outer},
                 DiLoCoOptions().sync_every(rank == 0 ? 2 : 4));
        },
        {"DiLoCo: the replicas differ: rank 0 has sync_every 2", "rank 1 has sync_every 4"});
    expect_error<UsageError>([&] { split(world, rank == 0 ? 0 : -1); },
                             {"split: a color is 0 or more; rank 1 passed -1"});
  });
}

TEST(ReplicaGroups, SplitsIntoReplicasAndTheRanksAcrossThem) {
  // 4 ranks as 2 replicas of 2: each collective runs among its group only.
  run_ranks(4, [](int rank) {
    World world = init();
    auto groups = replica_groups(world, 2);
    EXPECT_EQ(groups.replica.size(), 2);
    EXPECT_EQ(groups.replica.rank(), rank % 2);
    EXPECT_EQ(groups.across.size(), 2);
    EXPECT_EQ(groups.across.rank(), rank / 2);
    auto in_replica = torch::tensor({static_cast<double>(rank)}, torch::kDouble);
    groups.replica.all_reduce(in_replica);
    EXPECT_EQ(in_replica.item<double>(), rank < 2 ? 0 + 1 : 2 + 3);
    auto across = torch::tensor({static_cast<double>(rank)}, torch::kDouble);
    groups.across.all_reduce(across);
    EXPECT_EQ(across.item<double>(), rank % 2 == 0 ? 0 + 2 : 1 + 3);
    // Splits of a split, side by side: their keys stay apart from each
    // other's and from their parent's siblings'.
    World everyone = split(world, 0);
    World pair = split(everyone, rank / 2);
    ASSERT_EQ(pair.size(), 2);
    auto mine = torch::tensor({static_cast<double>(rank)}, torch::kDouble);
    pair.all_reduce(mine);
    EXPECT_EQ(mine.item<double>(), rank < 2 ? 0 + 1 : 2 + 3);
    world.barrier();
    expect_error<ConfigError>([&] { replica_groups(world, 3); },
                              {"3 ranks per replica do not divide the world's 4 ranks"});
  });
}

} // namespace
} // namespace lockstep::testing
