#pragma once

// FullyShardedDataParallel's options (fsdp.h), apart so that
// sharded_construction.h cuts units as the wrapper will.

#include <optional>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

namespace lockstep {

struct FsdpOptions {
  /// Free a unit's full parameters after its forward and gather them again
  /// before its backward (FSDP2's reshard_after_forward). False keeps them
  /// from the forward to the unit's backward: one gather less per step, the
  /// memory of every unit's parameters at the end of forward.
  TORCH_ARG(bool, reshard_after_forward) = true;
  /// The dtype the gradients travel in (bfloat16 or float16 halve the
  /// bytes of every reduce-scatter): each rank's gradients are rounded to
  /// it, averaged in it as World averages 16-bit tensors (each share
  /// divided, the shares summed in float32, rounded once; under hybrid
  /// sharding once in the group and once across the groups), and the
  /// average returns to the parameters' dtype. Unset: their own dtype. PyTorch's
  /// MixedPrecision(reduce_dtype=...).
  TORCH_ARG(std::optional<at::ScalarType>, reduce_dtype);
  /// Start gathering the next unit while the current one computes: in
  /// forward the unit that followed this one in the last step's forward,
  /// in backward the one that preceded it (FSDP's forward_prefetch and
  /// BACKWARD_PRE). One more unit's parameters in memory at a time. Over
  /// Gloo the gather runs meanwhile; over shared memory it moves when the
  /// rank next calls into the transport, so it gains little there.
  TORCH_ARG(bool, prefetch) = false;
  /// What forward and backward compute in (PyTorch's MixedPrecisionPolicy
  /// param_dtype): each unit's shard is cast to it and gathered in it
  /// (half the bytes of float32), its parameters are these copies while it
  /// computes, its gradients come in it and are averaged in reduce_dtype
  /// (unset: this dtype, as FSDP2) into the float32 shards, which the
  /// optimizer steps. Floating inputs of the wrapper's forward are cast to
  /// it. A unit that holds only BatchNorm parameters keeps its own dtype
  /// (declare each BatchNorm a unit: lockstep::Sharded<torch::nn::BatchNorm2d>);
  /// a unit that mixes them with others is refused. Unset: the parameters'
  /// own dtype.
  TORCH_ARG(std::optional<at::ScalarType>, param_dtype);
  /// Hybrid sharding (HSDP: FSDP2's 2-D mesh, FSDP1's HYBRID_SHARD): each
  /// unit is sharded inside groups of this many consecutive ranks
  /// (replica_groups; 0: the ranks of a host, as lockstep-run numbers them)
  /// and replicated across the groups. Gathers stay inside a group (one
  /// host: shared memory); after a unit's reduce-scatter inside its group,
  /// each rank all-reduces its shard's gradients with the same place of
  /// every other group, so 1/k of the model's gradients crosses between
  /// groups per step, where plain FSDP across hosts gathers and
  /// reduce-scatters the whole model over the slow link. Each rank holds
  /// 1/k of the state. Unset: one group of every rank (plain FSDP).
  TORCH_ARG(std::optional<int>, shard_group_size);
};

} // namespace lockstep
