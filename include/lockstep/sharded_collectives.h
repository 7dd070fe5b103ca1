#pragma once

// The two collectives of sharded training, on flat tensors: every rank's
// shard gathered into one tensor, and a tensor reduced over the ranks of
// which each keeps its own slice (PyTorch's all_gather_into_tensor and
// reduce_scatter_tensor). Between the ranks of one host they run over
// shared memory (a reduce-scatter moves half of what an all-reduce does);
// over Gloo, whose LibTorch 1.13 has no reduce-scatter, the reduce-scatter
// is an all-reduce of a copy whose slice each rank keeps.

#include <string>

#include <ATen/core/Tensor.h>

#include <lockstep/world.h>

namespace lockstep {

/// Collective: `output` (contiguous, world.size() times input's elements,
/// of input's dtype and device) takes every rank's `input` end to end, rank
/// r's at elements [r n, (r + 1) n), n = input.numel(). Raises UsageError
/// for other sizes, dtypes or a non-contiguous output. `description` names
/// the operation in errors (and in the comparison of LOCKSTEP_DEBUG=DETAIL);
/// by default "all_gather_into of <dtype> <shape>".
void all_gather_into(World& world, at::Tensor& output, const at::Tensor& input,
                     const std::string& description = "");

/// Collective: `input` (world.size() times output's elements, of output's
/// dtype and device) is reduced over every rank's input, and `output`
/// (contiguous) takes this rank's slice of the result: elements
/// [r n, (r + 1) n), n = output.numel(). Average divides the sum by the
/// world's size as all_reduce does. Raises UsageError for other sizes,
/// dtypes or a non-contiguous output. `description` as all_gather_into's.
void reduce_scatter(World& world, at::Tensor& output, const at::Tensor& input,
                    ReduceOp op = ReduceOp::Sum, const std::string& description = "");

} // namespace lockstep
