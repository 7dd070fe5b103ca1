#pragma once

// The seam between the reducer and what keeps the sharded averages of
// DdpOptions::shard_gradients (ZeRO-2): the reducer lays out the buckets and
// reduce-scatters them; the owner (ZeroRedundancyOptimizer) shards its
// parameters by the same layout, keeps each bucket's slice as its pieces'
// gradients, steps them, and brings the new parameters to every rank. The
// reducer does not know what the owner is.

#include <cstddef>
#include <vector>

#include <ATen/core/Tensor.h>

namespace lockstep::detail {

class GradientShardOwner {
 public:
  virtual ~GradientShardOwner() = default;

  /// On every rank alike, before any step: from now on, of each bucket's
  /// parameters laid end to end (and padded), rank r owns elements
  /// [r slice, (r + 1) slice), `slice` being the bucket's entry in
  /// `slices`. Raises UsageError where the owner cannot shard so (other
  /// parameters or ranks, state already stepped).
  virtual void shard_by_buckets(const std::vector<std::vector<at::Tensor>>& buckets,
                                const std::vector<int64_t>& slices, int rank,
                                int world_size) = 0;
  /// Bucket `bucket`'s average over the ranks, this rank's slice of it
  /// (held by the reducer until the next backward); used[k]: whether the
  /// bucket's k-th parameter got a gradient on any rank (one that did not
  /// keeps none, as a plain optimizer would skip it).
  virtual void take_average(size_t bucket, const at::Tensor& slice,
                            const std::vector<char>& used) = 0;
  /// Whether averages taken since the last step are still unstepped: the
  /// next backward's reduce-scatter would write over them.
  virtual bool holds_unstepped_averages() const = 0;
};

} // namespace lockstep::detail
