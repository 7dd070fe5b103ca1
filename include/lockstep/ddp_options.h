#pragma once

#include <cstdint>
#include <optional>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <lockstep/debug_level.h>

namespace lockstep {

/// When the wrapper broadcasts rank 0's buffers (BatchNorm running stats,
/// for example) before a forward.
enum class BufferSync {
  /// Only when some rank's buffers changed since the last broadcast, as
  /// learned at the last synchronised backward: a model whose buffers never
  /// change pays for no broadcast at all.
  WhenChanged,
  /// Before every forward, like PyTorch's broadcast_buffers=True.
  Always,
  /// Never after construction, like PyTorch's broadcast_buffers=False.
  Never,
};

/// What DistributedDataParallel::check_replicas compares.
enum class ReplicaCheck {
  /// The parameters, and the buffers that should be equal now: those that no
  /// rank changed since they were last synchronised (BatchNorm's running
  /// statistics legitimately differ between a forward and the next one).
  /// Buffers under BufferSync::Never are each rank's own and not compared.
  All,
  /// The parameters alone.
  Parameters,
};

/// What happens when a backward reaches the wrapped module's parameters
/// without a forward through the wrapper (the loss was computed on
/// ddp.module(), which in PyTorch silently skips the gradient averaging).
enum class Bypass {
  /// Average the gradients anyway, and warn once.
  SyncAndWarn,
  /// Raise lockstep::UsageError from backward().
  Error,
  /// Leave such gradients local, without a word.
  Ignore,
};

/// DDP's mixed-precision policy, as PyTorch's DDP(mixed_precision=...):
/// forward and backward compute on 16-bit copies of the parameters, the
/// gradients are averaged in `reduce_dtype`, and the optimizer steps the
/// parameters themselves (the float32 masters). See docs/ddp.md, "Mixed
/// precision".
struct MixedPrecision {
  /// What forward and backward compute in: every floating parameter is
  /// cast to it before each forward (into a copy kept between steps), and
  /// so is every floating tensor given to forward. From the forward to the
  /// end of its backward the parameters hold these copies; then the masters
  /// are back, with float32 gradients.
  TORCH_ARG(at::ScalarType, param_dtype) = at::kBFloat16;
  /// What the gradients are averaged in. Unset: param_dtype, as PyTorch. In
  /// a 16-bit dtype each rank's gradient is divided by the world size and
  /// rounded once, and the sum accumulates in float32 (as
  /// hooks::bf16_compress); a communication hook then receives the bucket
  /// in this dtype, as PyTorch's does.
  TORCH_ARG(std::optional<at::ScalarType>, reduce_dtype);
  /// Floating buffers (BatchNorm's statistics) are cast to it once, when the
  /// wrapper is built. Unset: left as they are.
  TORCH_ARG(std::optional<at::ScalarType>, buffer_dtype);
  /// BatchNorm (torch::nn::BatchNorm1d/2d/3d, lockstep::SyncBatchNorm)
  /// keeps its parameters and statistics in their own dtype: it normalises
  /// the 16-bit activations with float32 weights and statistics and
  /// returns them in 16 bits, as PyTorch's FSDP keeps _BatchNorm in full
  /// precision. False casts it as every other module (a plain BatchNorm then
  /// needs buffer_dtype equal to param_dtype: its statistics must be of its
  /// weight's dtype).
  TORCH_ARG(bool, batch_norm_in_full_precision) = true;
};

/// How DistributedDataParallel synchronises a module. Every field has the
/// default that suits most models; docs/ddp.md compares each with PyTorch.
struct DdpOptions {
  /// Bucket size in MiB: gradients travel in buckets of about this size,
  /// each all-reduced as soon as all its gradients are ready. Unset: 25,
  /// except across hosts where the gradients take over 4 times as long on
  /// the link (timed when the wrapper is built) as the first backward's
  /// computation: then 1, from the second iteration on.
  TORCH_ARG(std::optional<double>, bucket_cap_mb);
  /// Size of the first bucket in MiB: small, so that communication starts
  /// early in the backward pass.
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  /// Make each parameter's .grad a view into its bucket, which saves a copy
  /// each way and the memory of one gradient copy.
  TORCH_ARG(bool, gradient_as_bucket_view) = true;
  /// Walk the autograd graph from the forward's outputs to find parameters
  /// that this forward did not use, so that their buckets need not wait for
  /// the end of backward. Never needed for correctness.
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// Promise that every iteration uses the same parameters in the same
  /// order; a parameter that breaks it is an error naming it.
  TORCH_ARG(bool, static_graph) = false;
  /// When rank 0's buffers are broadcast before forward.
  TORCH_ARG(BufferSync, broadcast_buffers) = BufferSync::WhenChanged;
  /// What a backward that bypassed the wrapper does.
  TORCH_ARG(Bypass, bypass) = Bypass::SyncAndWarn;
  /// Check every N forwards that all replicas still hold the same
  /// parameters and buffers (DistributedDataParallel::check_replicas); 0
  /// never checks.
  TORCH_ARG(int64_t, verify_every) = 0;
  /// Unset: the world's level (WorldOptions::debug, else LOCKSTEP_DEBUG).
  /// Detail here also turns on the world's comparison of collectives, on
  /// every rank alike, since every rank constructs the wrapper.
  TORCH_ARG(std::optional<DebugLevel>, debug);
  /// Compute in 16 bits with float32 masters (MixedPrecision). Unset: every
  /// tensor stays in its own dtype.
  TORCH_ARG(std::optional<MixedPrecision>, mixed_precision);
  /// ZeRO-2: each bucket is reduce-scattered, so that a rank keeps only the
  /// averages of the elements it owns, and a ZeroRedundancyOptimizer
  /// (ddp.shard_gradients_with) steps those and all-gathers the new
  /// parameters. Gradient memory per rank is 1/N of the buckets, plus the
  /// buckets in flight; .grad stays undefined. The bucket layout is then the
  /// construction's for good (no rebuild in the order of the first
  /// backward). See docs/ddp.md, "When the model does not fit".
  TORCH_ARG(bool, shard_gradients) = false;
};

} // namespace lockstep
