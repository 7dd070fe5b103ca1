// lockstep::FaultTolerance over replica groups (torchft's FT-HSDP): FSDP,
// or DDP, inside each group, fault tolerance across them. Real processes
// under lockstep-run --restart rank, killed at chosen moments; a group with
// a dead rank drops out whole and comes back whole, and each committed
// step equals one process on the whole batch.

#include <algorithm>

#include <gtest/gtest.h>

#include <lockstep/fsdp.h>
#include <lockstep/lockstep.h>

#include "support/elastic_reference.h"
#include "support/expect_error.h"
#include "support/job_output.h"
#include "support/models.h"
#include "support/multiprocess.h"
#include "support/paths.h"
#include "support/process.h"
#include "support/scratch_folder.h"

namespace lockstep::testing {
namespace {

struct GroupKillPlan {
  std::string name;
  int ranks;
  int group_size;
  /// LOCKSTEP_TEST_INNER: "fsdp", "ddp", "zero", "zero2" or "syncbn".
  std::string inner;
  /// LOCKSTEP_TEST_KILLS of groups_float64.
  std::string kills;
  /// Groups lost (each restarts all its ranks).
  int groups_lost;
  /// Ranks killed while they received the live state (which they then
  /// never say they received).
  int killed_in_rejoin = 0;
};

void PrintTo(const GroupKillPlan& plan, std::ostream* out) {
  *out << plan.name;
}

std::vector<std::string> groups_job(const GroupKillPlan& plan, int64_t steps,
                                    const ScratchFolder& out) {
  return {lockstep_run_binary(), "--nproc-per-node", std::to_string(plan.ranks), "--restart",
          "rank", "--max-restarts", std::to_string(4 * plan.group_size * plan.groups_lost + 1),
          "--", groups_float64_binary(), std::to_string(steps), out.path(), "10"};
}

class FaultToleranceOverGroups : public ::testing::TestWithParam<GroupKillPlan> {};

TEST_P(FaultToleranceOverGroups, AGroupWithADeadRankDropsOutWholeAndRejoinsEqualToOneProcess) {
  const auto& plan = GetParam();
  ScratchFolder out("ft-groups");
  constexpr int64_t kSteps = 120;
  auto result = run_process(groups_job(plan, kSteps, out),
                            {{"LOCKSTEP_TEST_KILLS", plan.kills},
                             {"LOCKSTEP_TEST_GROUP_SIZE", std::to_string(plan.group_size)},
                             {"LOCKSTEP_TEST_INNER", plan.inner},
                             {"LOCKSTEP_TIMEOUT", "30"},
                             {"LOCKSTEP_JOB_SECRET", "groups"}},
                            std::chrono::seconds(240));
  ASSERT_TRUE(result.ok()) << result.status() << "\n" << result.output;
  // Each lost group: its killed rank, and its others ending with it; all
  // restarted, and each received its part of the live state.
  const int restarts = plan.groups_lost * plan.group_size;
  EXPECT_EQ(occurrences(result.output, "killed by signal 9"), occurrences(plan.kills, ",") + 1)
      << result.output;
  EXPECT_EQ(occurrences(result.output, "restarting it alone"), restarts) << result.output;
  EXPECT_EQ(occurrences(result.output, "judged hung"), 0) << result.output;
  EXPECT_EQ(occurrences(result.output, ": 120 steps"), plan.ranks) << result.output;
  EXPECT_GE(occurrences(result.output, "of its replica group (launcher ranks"),
            plan.groups_lost * (plan.group_size - 1))
      << result.output;
  EXPECT_GE(occurrences(result.output, "received the live state"),
            restarts - plan.killed_in_rejoin * plan.group_size)
      << result.output;
  if (plan.inner != "syncbn") {
    expect_committed_steps_match(out, plan.ranks, elastic_reference(kSteps));
    return;
  }
  // Each group normalises over its own rows: one process computes the same
  // only grouped as each committed step was.
  auto sizes = committed_world_sizes(out, plan.ranks, kSteps);
  EXPECT_NE(std::count(sizes.begin(), sizes.end(), plan.ranks - plan.group_size), 0)
      << "some steps trained without the lost group";
  auto reference = grouped_norm_reference(sizes, plan.group_size);
  expect_committed_steps_match(out, plan.ranks, reference);
  expect_statistics_match(out, plan.ranks, reference);
}

INSTANTIATE_TEST_SUITE_P(
    Kills, FaultToleranceOverGroups,
    ::testing::Values(
        // Three groups of two, FSDP inside: a rank killed in forward (its
        // peer is inside the group's gather), then one killed before
        // commit (the other groups wait in the reduction across groups).
        GroupKillPlan{"fsdp_3x2_forward_then_reduction", 6, 2, "fsdp",
                      "2:0:20:forward,5:0:60:commit", 2},
        // A rank of a group that is rejoining killed while it receives its
        // part: the group drops out again, and comes back once more.
        GroupKillPlan{"fsdp_3x2_during_rejoin", 6, 2, "fsdp", "1:0:20:begin,1:1:0:rejoin", 2,
                      1},
        // DDP inside groups of two, two groups.
        GroupKillPlan{"ddp_2x2_step", 4, 2, "ddp", "3:0:30:step", 1},
        // ZeRO-1 inside groups: each rank's shard of the optimizer state
        // lives on at its place in the other groups, and comes back from
        // there.
        GroupKillPlan{"zero_3x2_forward_then_reduction", 6, 2, "zero",
                      "2:0:20:forward,5:0:60:commit", 2},
        // ZeRO-2: the gradients' shards too; a step dropped by the others
        // lets its shards go, and a rejoining rank killed again.
        GroupKillPlan{"zero2_2x2_commit_then_rejoin", 4, 2, "zero2", "3:0:20:commit,3:1:0:rejoin",
                      2, 1},
        // SyncBatchNorm inside groups of two: it normalises over the group's
        // batch, and at commit every group takes the first group's running
        // statistics, so that the replicas stay one (and equal to one
        // process, grouped as each step was).
        GroupKillPlan{"syncbn_3x2_forward_then_rejoin", 6, 2, "syncbn",
                      "2:0:20:forward,2:1:0:rejoin", 2, 1}),
    [](const ::testing::TestParamInfo<GroupKillPlan>& info) { return info.param.name; });

// A group lost just before the end: the other group finishes the loop,
// and the lost group's restarted ranks, meeting again, find the loop
// ended and leave; the job succeeds.
TEST(FaultToleranceOverGroupsEnd, AGroupLostAtTheEndLeavesAndTheJobSucceeds) {
  ScratchFolder out("ft-groups-end");
  GroupKillPlan plan{"end", 4, 2, "fsdp", "3:0:117:step", 1};
  auto result = run_process(groups_job(plan, 120, out),
                            {{"LOCKSTEP_TEST_KILLS", plan.kills},
                             {"LOCKSTEP_TEST_GROUP_SIZE", "2"},
                             {"LOCKSTEP_TIMEOUT", "30"}},
                            std::chrono::seconds(240));
  ASSERT_TRUE(result.ok()) << result.status() << "\n" << result.output;
  EXPECT_EQ(occurrences(result.output, "restarting it alone"), 2) << result.output;
  EXPECT_EQ(occurrences(result.output, "after it found the job's loop ended: nothing to rejoin"),
            2)
      << result.output;
  EXPECT_EQ(occurrences(result.output, ": 120 steps"), 2) << result.output;
  expect_committed_steps_match(out, 4, elastic_reference(120));
}

// Groups cut from another world than init()'s would hide from fault
// tolerance which launcher ranks fail and return together.
TEST(FaultToleranceOverGroupsErrors, GroupsCutFromAnotherWorldThanTheJobsAreRefused) {
  run_ranks(4, [](int) {
    auto world = init();
    auto groups = replica_groups(split(world, 0), 2);
    Mlp model;
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    expect_error<UsageError>([&] { FaultTolerance(groups, *model, optimizer); },
                             {"takes groups cut from the job's world"});
  });
}

// Hybrid sharding over init()'s world replicates across groups of its own,
// which fault tolerance would average again and could not rebuild.
TEST(FaultToleranceOverGroupsErrors, AnFsdpShardedAcrossTheGroupsIsRefused) {
  run_ranks(4, [](int) {
    auto world = init();
    auto groups = replica_groups(world, 2);
    Mlp model;
    FullyShardedDataParallel<Mlp> fsdp(model, world, FsdpOptions().shard_group_size(2));
    torch::optim::SGD optimizer(fsdp.parameters(), 0.1);
    expect_error<UsageError>([&] { FaultTolerance(groups, *model, optimizer); },
                             {"takes an optimizer over pieces sharded inside the group",
                              "sharded over a world of 4 ranks, the group has 2"});
  });
}

// The step's verdict rides with the reduction across the groups: a group
// that commits sums where the other commits none is refused on every rank
// before any sums travel, as with ranks alone.
TEST(FaultToleranceOverGroupsErrors, SumsCommittedByOneGroupOnlyAreRefusedOnEveryRank) {
  run_ranks(4, [](int rank) {
    auto world = init();
    auto groups = replica_groups(world, 2);
    Mlp model;
    DDP<Mlp> ddp(model, groups.replica);
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    FaultTolerance ft(groups, *model, optimizer, FaultToleranceOptions().verbose(false));
    ft.begin_step();
    ddp(torch::randn({4, 20})).sum().backward();
    expect_error<UsageError>(
        [&] {
          if (rank < 2) {
            ft.commit(torch::ones({3}));
          } else {
            ft.commit();
          }
        },
        {"ft.commit(sums) on some ranks of step 0 and ft.commit() on others (1 of 2 sum)"});
  });
}

// The step inside backward would step on the group's average alone, before
// the groups' and before the step is known to commit: the first commit
// refuses it, on every rank, with a plain optimizer or ZeRO.
TEST(FaultToleranceOverGroupsErrors, AStepInsideBackwardIsRefusedAtTheFirstCommit) {
  run_ranks(4, [](int) {
    auto world = init();
    auto groups = replica_groups(world, 2);
    for (bool zero : {false, true}) {
      Mlp model;
      DDP<Mlp> ddp(model, groups.replica);
      std::unique_ptr<torch::optim::Optimizer> optimizer;
      if (zero) {
        optimizer = std::make_unique<ZeroRedundancyOptimizer<torch::optim::SGD>>(
            model->parameters(), groups.replica, torch::optim::SGDOptions(0.1));
      } else {
        optimizer = std::make_unique<torch::optim::SGD>(model->parameters(), 0.1);
      }
      ddp.step_in_backward(*optimizer);
      FaultTolerance ft(groups, *model, *optimizer, FaultToleranceOptions().verbose(false));
      ft.begin_step();
      ddp(torch::randn({4, 20})).sum().backward();
      expect_error<UsageError>([&] { ft.commit(); },
                               {zero ? "the ZeroRedundancyOptimizer steps inside backward"
                                     : "a step inside backward (ddp.step_in_backward) leaves no "
                                       "gradient to average across the groups",
                                "call optimizer.step() when ft.commit() returns true"});
    }
  });
}

// A ZeroRedundancyOptimizer is taken over replica groups only where it
// shards over the group: a shard that spans groups would die with either.
TEST(FaultToleranceOverGroupsErrors, AZeroRedundancyOptimizerOverAnotherWorldThanTheGroupIsRefused) {
  run_ranks(4, [](int) {
    auto world = init();
    auto groups = replica_groups(world, 2);
    Mlp model;
    ZeroRedundancyOptimizer<torch::optim::SGD> whole(model->parameters(), world,
                                                     torch::optim::SGDOptions(0.1));
    expect_error<UsageError>([&] { FaultTolerance(groups, *model, whole); },
                             {"takes a ZeroRedundancyOptimizer over the group's world",
                              "this one's world has 4 ranks, the group 2"});
  });
}

} // namespace
} // namespace lockstep::testing
