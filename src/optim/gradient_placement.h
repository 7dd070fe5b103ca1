#pragma once

// "Where do this optimizer's gradients live?": one question that the
// GradScaler (and whatever else must agree across the ranks that hold the
// shards) asks of what made the pieces, instead of a type check of its own
// for each way of sharding. A ZeroRedundancyOptimizer (ZeRO-1 and ZeRO-2)
// answers for itself; FullyShardedDataParallel registers the pieces it
// makes, so that a plain torch::optim optimizer over them is known to step
// shards. Every rank of the world must answer alike (the answer decides a
// collective): a rank that holds no piece at all (a parameter smaller than
// the world) has an optimizer over nothing, and takes the world of the one
// FullyShardedDataParallel alive.

#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include <lockstep/world.h>

namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace lockstep::detail {

struct GradientPlacement {
  /// The tensors whose gradients the optimizer's step reads.
  std::vector<at::Tensor> holders;
  /// The ranks that hold the other shards of those gradients, each rank
  /// its own (a check of them must agree across these ranks); none where
  /// every rank holds them all.
  std::optional<World> sharded_across;
};

GradientPlacement gradient_placement(torch::optim::Optimizer& optimizer);

/// `pieces` are this rank's shards, made by `owner`, of tensors whose other
/// shards `world`'s ranks hold, until unregister_pieces(owner).
void register_pieces(const void* owner, const std::vector<at::Tensor>& pieces,
                     const World& world);
void unregister_pieces(const void* owner);

} // namespace lockstep::detail
