// LOCKSTEP_TIMELINE: every rank writes its spans, lockstep-trace merges
// them, and the merged trace holds what docs/timeline.md promises.

#include <cstdlib>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "support/models.h"
#include "support/multiprocess.h"
#include "support/scratch_folder.h"
#include "support/training.h"
#include "support/paths.h"

namespace lockstep::testing {
namespace {

TEST(Timeline, RanksRecordForwardBackwardBucketsBroadcastsAndUserSpans) {
  ScratchFolder folder("timeline");
  std::string prefix = folder / "trace";
  LaunchOptions options;
  options.world_size = 2;
  options.environment = [&](int, RankEnvironment& env) {
    env["LOCKSTEP_TIMELINE"] = prefix;
  };
  auto result = launch_ranks(options, [](int rank) {
    EXPECT_FALSE(timeline_enabled()); // not before the world is formed
    World world = init();
    EXPECT_TRUE(timeline_enabled());
    torch::manual_seed(5);
    Cnn model(/*batch_norm=*/true);
    DDP<Cnn> ddp(model, world,
                 DdpOptions().first_bucket_cap_mb(0.001).bucket_cap_mb(0.01));
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    for (int step = 0; step < 4; ++step) {
      auto [x, y] = global_batch(step, 8, {1, 12, 12});
      optimizer.zero_grad();
      torch::mse_loss(ddp(x.narrow(0, 4 * rank, 4)), y.narrow(0, 4 * rank, 4))
          .backward();
      TimelineSpan span("optimizer step");
      optimizer.step();
    }
    {
      auto guard = ddp.no_sync();
      auto [x, y] = global_batch(9, 8, {1, 12, 12});
      torch::mse_loss(ddp(x.narrow(0, 4 * rank, 4)), y.narrow(0, 4 * rank, 4))
          .backward();
    }
  });
  ASSERT_TRUE(result.ok()) << result.report();

  std::string tool = std::string(lockstep::testing::source_dir()) + "/tools/lockstep-trace/lockstep-trace";
  auto merged = run_process({"python3", tool, "merge", prefix});
  ASSERT_TRUE(merged.ok()) << merged.status() << "\n" << merged.output;
  auto checked = run_process({"python3", std::string(lockstep::testing::source_dir()) + "/tests/scripts/check-timeline",
                              prefix + ".json", "2"});
  EXPECT_TRUE(checked.ok()) << checked.status() << "\n" << checked.output;
}

TEST(Timeline, AnUnwritablePathIsAConfigError) {
  run_ranks(1, [](int) {
    setenv("LOCKSTEP_TIMELINE", "/nonexistent/dir/trace", 1);
    try {
      init();
      ADD_FAILURE() << "init() wrote a timeline where it cannot";
    } catch (const ConfigError& e) {
      EXPECT_STREQ(e.what(),
                   "lockstep: LOCKSTEP_TIMELINE=/nonexistent/dir/trace: cannot write the "
                   "timeline /nonexistent/dir/trace.rank0.json: No such file or directory.");
    }
  });
}

} // namespace
} // namespace lockstep::testing
