#pragma once

// What a unit built under a ShardedConstruction keeps
// (include/lockstep/sharded_construction.h): this rank's shard of its
// parameters, laid out as FlatUnit lays them out, and what the wrapper
// checks across ranks before it takes them.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::autograd {
struct Node;
} // namespace torch::autograd

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace lockstep {
class World;
struct FsdpOptions;
} // namespace lockstep

namespace lockstep::detail {

struct ConstructedShard {
  /// The world it was cut for: this rank's place, and how many.
  int rank = 0;
  int ranks = 1;
  /// The unit's parameters (empty since the cut), in FlatUnit's order, and
  /// their shapes as built.
  std::vector<at::Tensor> params;
  std::vector<std::vector<int64_t>> shapes;
  /// Elements [rank S, (rank + 1) S) of the parameters end to end, zeros
  /// past their end.
  at::Tensor shard;
  /// Each parameter's bytes summed as integers, before the cut, mixed in
  /// the parameters' order: exact and independent of the order of summing,
  /// so equal on ranks that built the same values, whatever their CPUs.
  uint64_t checksum = 0;
  /// Made while the parameters had their shapes, for frozen ones too:
  /// autograd checks each gradient against the shape its accumulator saw
  /// (held: a parameter keeps only a weak reference).
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
};

/// How many consecutive ranks of `world` share each unit's shards under
/// `options` (FsdpOptions::shard_group_size; the whole world where unset).
/// Raises ConfigError, on every rank alike, for a size that does not divide
/// the world.
int shard_group_size(const World& world, const FsdpOptions& options);

/// Under a ShardedConstruction on this thread, keeps this rank's shard of
/// the parameters of the declared unit `module` that no unit declared
/// inside it holds, and frees the rest; otherwise does nothing.
void shard_at_construction(const std::shared_ptr<torch::nn::Module>& module);

/// Collective over `world`, by the wrapper before it shards over
/// `shard_world` (the world, or this rank's group of it): for each unit
/// (`declared[u]`, null for the root; `params[u]` its parameters as the
/// wrapper assigns them), what it was built with, or null for one built in
/// full. Raises ConfigError on every rank alike where the ranks built a
/// unit in different ways or values, or cut it for another world, or where
/// the unit changed since (other parameters, another dtype or device).
std::vector<std::shared_ptr<ConstructedShard>> constructed_shards(
    World& world, const World& shard_world, const std::vector<std::string>& names,
    const std::vector<std::shared_ptr<torch::nn::Module>>& declared,
    const std::vector<std::vector<std::pair<std::string, at::Tensor>>>& params);

} // namespace lockstep::detail
