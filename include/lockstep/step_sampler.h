#pragma once

// Which samples each rank trains on, from (step, rank, size) alone, for a
// world whose size changes (fault_tolerance.h). Step s takes global batch
// s of its epoch's order, whatever the world's size; rank r of n takes its
// share of that batch. So every committed step sees its global batch once,
// and every sample is seen once per epoch (steps_per_epoch() committed
// steps), as long as the global batch is divided among the ranks that
// commit it; a step that is dropped is retried with the same batch.

#include <cstdint>
#include <vector>

#include <torch/arg.h>

namespace lockstep {

struct StepSamplerOptions {
  /// Samples per step, over all ranks. With a size that every world size
  /// divides, each rank's share is equal and the average of the ranks'
  /// mean losses is the mean over the global batch.
  TORCH_ARG(int64_t, global_batch_size) = 64;
  /// Each epoch's order is a permutation drawn from this seed and the
  /// epoch's number, the same on every rank and every LibTorch.
  TORCH_ARG(uint64_t, seed) = 0;
  /// False: the dataset's own order.
  TORCH_ARG(bool, shuffle) = true;
};

class StepSampler {
 public:
  /// The last partial global batch of each epoch is dropped.
  StepSampler(int64_t dataset_size, StepSamplerOptions options = {});
  /// The samples that rank `rank` of `size` trains on at step `step`:
  /// shares differ by at most one sample, the first ranks taking the more.
  std::vector<int64_t> indices(int64_t step, int rank, int size) const;
  int64_t steps_per_epoch() const;

 private:
  int64_t dataset_size_;
  StepSamplerOptions options_;
  mutable int64_t epoch_ = -1;
  mutable std::vector<int64_t> order_;
};

} // namespace lockstep
