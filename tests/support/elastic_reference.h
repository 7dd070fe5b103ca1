#pragma once

// What tests/programs/elastic_float64.cpp (and groups_float64.cpp, the same
// training over replica groups) computes, in one process on the whole
// global batch, and the check of a run's committed steps against it.
// With a SyncBatchNorm inside groups, what one process computes depends on
// how the ranks were grouped at each step: its reference is built from the
// world sizes the run logged.

#include <cstdint>
#include <vector>

#include <torch/types.h>

#include "support/scratch_folder.h"

namespace lockstep::testing {

/// The parameters' sum after each step, and the last parameters. The
/// programs' ranks take equal shares of each global batch (12 samples, and
/// world sizes 1 to 6), so the average of their mean losses' gradients is
/// the mean over the batch: the same steps, in another order of summation.
struct Reference {
  std::vector<double> sums; // after step s + 1
  std::vector<double> squared_errors; // over step s's batch, before it
  torch::Tensor parameters;
  /// grouped_norm_reference's: the running statistics at the end.
  torch::Tensor statistics;
};

Reference elastic_reference(int64_t steps);

/// groups_float64 with LOCKSTEP_TEST_INNER=syncbn: the NormedMlp, each
/// step's batch normalised per replica group as the ranks that committed it
/// were grouped (`ranks[s]` ranks at step s + 1, `group_size` to a group),
/// the running statistics the first group's.
Reference grouped_norm_reference(const std::vector<int>& ranks, int group_size);

/// The world size (in ranks) that each of steps 1 to `steps` was committed
/// at, as OUT_DIR/rank-R.log (R < ranks) record it: every rank that logged a
/// step agrees.
std::vector<int> committed_world_sizes(const ScratchFolder& out, int ranks, int64_t steps);

/// Every rank's running statistics at the end (OUT_DIR/statistics-R.bin)
/// equal the reference's.
void expect_statistics_match(const ScratchFolder& out, int ranks, const Reference& ref);

/// Each committed step that OUT_DIR/rank-R.log records (R < ranks) equals
/// the reference's, and so do the final parameters (OUT_DIR/parameters.bin).
void expect_committed_steps_match(const ScratchFolder& out, int ranks, const Reference& ref);

} // namespace lockstep::testing
