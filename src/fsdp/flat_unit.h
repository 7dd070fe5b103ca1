#pragma once

// One unit's parameters laid end to end in one flat tensor, padded to a
// multiple of the world's size: rank r keeps elements [r S, (r + 1) S)
// (its shard) and the full tensor exists only while gathered. The module's
// parameters then point into it; freed, they are empty tensors, and the
// full tensor's memory is given back while the tensor itself stays, so that
// what autograd saved of it (a transposed weight) sees the parameters again
// once they are gathered for backward.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <lockstep/world.h>

#include "fsdp/buffer_pool.h"

namespace torch::autograd {
struct Node;
} // namespace torch::autograd

namespace lockstep::detail {

struct ConstructedShard;

class FlatUnit {
 public:
  struct Member {
    std::string name;
    at::Tensor param;
    std::vector<int64_t> shape;
    int64_t offset = 0; // in the full tensor
    int64_t numel = 0;
    /// This rank's elements of it, flat: a leaf that aliases the shard
    /// (undefined where this rank holds none).
    at::Tensor piece;
    int64_t piece_offset = 0; // in the full tensor
  };

  /// Collective over `from` (the wrapper's world): takes its rank 0's
  /// values of `params` (name, tensor), keeps this rank's shard of `world`
  /// (`from`, or this rank's group of it under hybrid sharding) and frees
  /// the rest. Raises ConfigError (on every rank alike) for parameters of
  /// more than one dtype or device. With `compute`
  /// (FsdpOptions::param_dtype), the unit is gathered in that dtype for
  /// forward and backward, and its gradients come in it.
  FlatUnit(std::string name, std::vector<std::pair<std::string, at::Tensor>> params,
           World& world, World& from, std::optional<at::ScalarType> compute = std::nullopt);
  /// Local: takes the shard that `built` kept of `params` when the unit was
  /// built under a ShardedConstruction (checked by constructed_shards).
  FlatUnit(std::string name, std::vector<std::pair<std::string, at::Tensor>> params,
           ConstructedShard& built, std::optional<at::ScalarType> compute = std::nullopt);

  const std::string& name() const {
    return name_;
  }
  /// "unit NAME", or "the root unit", as errors name it.
  std::string describe() const;
  static std::string describe(const std::string& name);
  /// Raises ConfigError (the same on every rank) for parameters that one
  /// flat tensor cannot hold: of two dtypes or devices, or not dense.
  static void check(const std::string& name,
                    const std::vector<std::pair<std::string, at::Tensor>>& params);
  /// Whether `tensor` lives in the full parameters (a unit's output that
  /// is a view of its own parameter).
  bool holds(const at::Tensor& tensor) const;
  const std::vector<Member>& members() const {
    return members_;
  }
  /// Elements of the full tensor that each rank holds.
  int64_t per_rank() const {
    return per_rank_;
  }
  bool gathered() const {
    return gathered_;
  }
  /// Whether some parameter requires grad.
  bool any_trainable() const;
  /// Collective: the full parameters from every rank's shard, in memory
  /// from `pool` where it holds a block of the size (completing a
  /// prefetch where one is in flight): in the compute dtype, or with
  /// `full_precision` in the shards' own (what checkpoints and loads see).
  void gather(World& world, BufferPool& pool, bool full_precision = false);
  /// Collective: starts gathering and returns; gather() or free() completes
  /// it.
  void prefetch(World& world, BufferPool& pool);
  /// This rank's elements of the full parameters into its shard (values
  /// loaded into the module while gathered in full precision).
  void write_back();
  /// Points the parameters at nothing and gives the full tensor's memory
  /// to `pool`.
  void free(BufferPool& pool);
  /// Before the unit's backward: its parameters' gradients become views of
  /// one flat tensor (memory from `pool`), which autograd accumulates into
  /// and reduce_gradients reduce-scatters as it is.
  void attach_gradients(BufferPool& pool);
  /// What a backward that never finished (it raised) attached, dropped.
  void drop_gradients(BufferPool& pool);
  /// Collective: the average over ranks of the parameters' gradients
  /// (zeros where a parameter has none) is added to the pieces' gradients;
  /// the parameters' own gradients are dropped. Gradients that were not
  /// attached are put end to end in a block of `pool` first. With `wire`,
  /// they travel in that dtype. With `replicas` (hybrid sharding), each
  /// rank's average over `world` is then averaged with the same place of
  /// every other group.
  void reduce_gradients(World& world, BufferPool& pool, std::optional<at::ScalarType> wire,
                        World* replicas = nullptr);
  /// Per member: whether its piece held a gradient before the last
  /// reduce_gradients (a member that no rank used gets none back).
  const std::vector<char>& had_gradient() const {
    return had_gradient_;
  }

 private:
  std::string name_;
  std::vector<Member> members_;
  // The reduce-scatter of `flat` into the pieces' gradients (and the
  // all-reduce of the result across `replicas`).
  void scatter_into_pieces(World& world, const at::Tensor& flat,
                           std::optional<at::ScalarType> wire, World* replicas);

  int64_t per_rank_ = 0; // S
  int rank_ = 0;
  int ranks_ = 1;
  // The members end to end, in `shapes` (the parameters' own, or those
  // they were built in), and S.
  void lay_out(std::vector<std::pair<std::string, at::Tensor>> params,
               const std::vector<std::vector<int64_t>>& shapes);
  // With shard_ in place: the pieces, the compute dtype's tensors and the
  // gradients' (none of them holding memory yet); the parameters freed.
  void take_shard(std::optional<at::ScalarType> compute);
  // Starts gathering into the compute dtype's full tensor, or the shards'.
  void start_gather(World& world, BufferPool& pool, bool full_precision);
  // Waits for a gather in flight and points the parameters at what it
  // gathered.
  void finish_gather();
  // The full tensor a gather in `low` precision fills.
  at::Tensor& full_of(bool low) {
    return low ? full_low_ : full_;
  }
  // The size of the pool's block behind it, while gathered.
  size_t& block_of(bool low) {
    return low ? full_low_block_ : full_block_;
  }

  bool gathered_ = false;
  bool gathered_low_ = false; // in the compute dtype
  bool arriving_low_ = false;
  std::optional<PendingCollective> arriving_; // a prefetch in flight
  at::Tensor full_;
  at::Tensor shard_;
  // With a compute dtype: the full parameters and this rank's shard in it.
  std::optional<at::ScalarType> compute_;
  at::Tensor full_low_;
  at::Tensor shard_low_;
  std::vector<char> had_gradient_;
  at::Tensor placeholder_;
  // The attached gradients end to end (memory only while attached), and
  // this rank's averages of them, which the pieces' gradients view.
  at::Tensor grad_full_;
  // The sizes of the pool's blocks behind full_, full_low_ and grad_full_.
  size_t full_block_ = 0;
  size_t full_low_block_ = 0;
  size_t grad_block_ = 0;
  bool gradients_attached_ = false;
  at::Tensor shard_grad_;
};

} // namespace lockstep::detail
