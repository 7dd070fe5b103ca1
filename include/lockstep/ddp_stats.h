#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep {

/// Figures of one iteration, or their sums over all iterations.
struct IterationStats {
  /// Time inside forward through the wrapper, buffer broadcast included.
  double forward_ms = 0;
  /// From the end of forward (or the first gradient, for a backward that
  /// bypassed the wrapper) to the end of backward.
  double backward_ms = 0;
  /// Time the end of backward spent waiting for buckets still in flight.
  double comm_wait_ms = 0;
  /// Time the optimizer stepped inside backward (ddp.step_in_backward),
  /// part of backward_ms and not of comm_wait_ms.
  double step_ms = 0;
  /// Bytes handed to all-reduce (gradients and per-parameter flags); 0 in
  /// a world of one, where nothing is sent.
  int64_t bytes_reduced = 0;
  /// Buffer broadcasts before forward (each covers all buffers).
  int64_t buffer_broadcasts = 0;
  /// Agreements before forward on whether any rank's buffers changed (a
  /// 4-byte all-reduce, with BufferSync::WhenChanged and buffers to sync).
  int64_t buffer_agreements = 0;
  /// Agreements before forward on which ranks still train (inside a join
  /// guard only).
  int64_t join_agreements = 0;
  /// The most bytes of bucket buffers held at once in the last backward.
  /// Without DdpOptions::shard_gradients the buckets are kept for good: all
  /// of them. With it, a bucket exists only while it fills and travels.
  int64_t bucket_bytes_held = 0;
};

struct DdpStats {
  /// The last iteration, and the sum over all iterations.
  IterationStats last;
  IterationStats total;
  /// Synchronised backward passes so far.
  int64_t iterations = 0;
  /// The current bucket layout: bytes and parameter names of each bucket,
  /// in launch order.
  std::vector<int64_t> bucket_bytes;
  std::vector<std::vector<std::string>> bucket_parameters;
  /// Whether the buckets were rebuilt in the order gradients became ready.
  bool buckets_rebuilt = false;
  /// Last synchronised iteration: when each bucket was launched, in ms since
  /// its first gradient, and when backward reached its end. A launch before
  /// that end is communication overlapped with backward.
  std::vector<double> bucket_launch_ms;
  double backward_end_ms = 0;
  /// Parameters that got no gradient on this rank in the last iteration.
  std::vector<std::string> unused_parameters;
};

} // namespace lockstep
