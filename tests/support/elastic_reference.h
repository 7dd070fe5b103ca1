#pragma once

// What tests/programs/elastic_float64.cpp (and groups_float64.cpp, the same
// training over replica groups) computes, in one process on the whole
// global batch, and the check of a run's committed steps against it.

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
};

Reference elastic_reference(int64_t steps);

/// Each committed step that OUT_DIR/rank-R.log records (R < ranks) equals
/// the reference's, and so do the final parameters (OUT_DIR/parameters.bin).
void expect_committed_steps_match(const ScratchFolder& out, int ranks, const Reference& ref);

} // namespace lockstep::testing
