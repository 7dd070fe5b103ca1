#pragma once

// Communication hooks: how a bucket's gradients travel, as PyTorch's
// register_comm_hook. DistributedDataParallel hands each bucket to the hook
// as soon as the bucket is full (in the same order on every rank), and at
// the end of backward takes the averaged gradients the hook produced. The
// reducer's own bookkeeping (which parameters any rank used, the errors of
// an iteration) never passes through a hook: it travels in a small exact
// all-reduce of its own. See docs/ddp.md.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <lockstep/world.h>

namespace lockstep {

/// One bucket, as a hook sees it.
struct GradBucket {
  /// Its position in launch order (0 fills first in backward).
  size_t index = 0;
  /// Whether it is the last bucket of the iteration.
  bool last = false;
  /// This rank's gradients of the bucket's parameters, flat, one dtype: what
  /// the hook averages across ranks. Under no_sync() it holds the sum of the
  /// accumulated backward passes, compressed once by a compressing hook.
  at::Tensor gradients;
  /// The parameters whose gradients `gradients` holds, and where each one
  /// starts in it.
  std::vector<at::Tensor> parameters;
  std::vector<int64_t> offsets;
  /// Each parameter's position among the wrapper's trainable parameters
  /// (registration order): a key for state kept per parameter, the same on
  /// every rank and in every run of the program, whatever the bucket layout.
  std::vector<int64_t> parameter_indices;
  /// The world to communicate in.
  World world;
  /// Names the bucket in errors ("bucket 1 of iteration 7 (fc1.weight, ...)").
  std::string description;
  /// What the hook put on the wire for this bucket, in bytes, for
  /// DdpStats::bytes_reduced (the built-ins set it; left at -1, the bucket's
  /// own size is counted).
  int64_t bytes_sent = -1;
};

/// What a hook returns: called once, at the end of backward, it waits for
/// the hook's communication and returns the average across ranks of
/// `gradients`, a flat tensor of the same size and dtype (it may be
/// `gradients` itself, overwritten). Every rank must get the same bits.
using BucketFuture = std::function<at::Tensor()>;

/// A hook starts the communication of one bucket and returns its future.
/// It must run the same collectives, in the same order, on every rank. An
/// exception from a hook or its future fails that backward on every rank
/// with the hook's message.
using CommHook = std::function<BucketFuture(GradBucket& bucket)>;

namespace hooks {

/// All-reduce in the gradients' own dtype, then divide by the world size:
/// what DistributedDataParallel does without a hook.
CommHook allreduce();

/// Divides by the world size, rounds to float16 and sums the float16
/// tensors of all ranks, accumulating in float32 (shared memory: in place in
/// the segment; Gloo: an all-gather of the float16 tensors, summed in rank
/// order, since Gloo would add float16 one element at a time). Half the
/// bytes of a float32 all-reduce; the result is the float32 average within
/// float16's rounding. PyTorch's fp16_compress_hook.
CommHook fp16_compress();

/// The same with bfloat16 (8 bits of mantissa, float32's range: no
/// overflow for large gradients). PyTorch's bf16_compress_hook, which Gloo
/// in LibTorch 1.13 cannot reduce at all.
CommHook bf16_compress();

/// Runs `inner` on the bucket's gradients rounded to float16 (or bfloat16),
/// and turns its result back into the gradients' dtype: what `inner` sends,
/// it sends at 16 bits. PyTorch's fp16_compress_wrapper and
/// bf16_compress_wrapper. `inner` must handle the 16-bit dtype (PowerSGD
/// does in bfloat16; CPU matrix products in float16 are not in LibTorch
/// 1.13).
CommHook fp16_wrapper(CommHook inner);
CommHook bf16_wrapper(CommHook inner);

} // namespace hooks
} // namespace lockstep
