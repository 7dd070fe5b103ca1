#pragma once

// ZeroRedundancyOptimizer: each rank holds the optimizer state of its shard
// of the parameters only (ZeRO stage 1) and steps only that shard; the new
// parameters then reach every rank from the rank that owns them. PyTorch's
// torch.distributed.optim.ZeroRedundancyOptimizer, in C++:
//
//   lockstep::ZeroRedundancyOptimizer<torch::optim::Adam> optimizer(
//       ddp.module()->parameters(), world, torch::optim::AdamOptions(1e-3));
//   optimizer.zero_grad();
//   torch::nll_loss(ddp(x), y).backward();
//   optimizer.step();                       // collective
//
// Parameter groups as torch::optim takes them (each group's options apply
// to its parameters, wherever they are sharded):
//
//   std::vector<torch::optim::OptimizerParamGroup> groups;
//   groups.emplace_back(weights, std::make_unique<torch::optim::AdamWOptions>(
//                                    torch::optim::AdamWOptions(1e-3).weight_decay(0.1)));
//   groups.emplace_back(biases_and_norms, std::make_unique<torch::optim::AdamWOptions>(
//                                             torch::optim::AdamWOptions(1e-3).weight_decay(0)));
//   lockstep::ZeroRedundancyOptimizer<torch::optim::AdamW> optimizer(
//       std::move(groups), world, torch::optim::AdamWOptions(1e-3));
//
// `ddp.step_in_backward(optimizer)` instead steps each bucket's part of the
// shard as soon as the bucket is averaged (PyTorch's overlap_with_ddp). See
// docs/ddp.md.

#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <lockstep/detail/gradient_shard_owner.h>
#include <lockstep/world.h>

namespace lockstep {

/// How a ZeroRedundancyOptimizer divides the parameters among the ranks.
enum class ZeroPartition {
  /// Whole parameters, group by group, largest first within a group, each
  /// to the rank that owns the fewest elements so far (PyTorch's rule). A
  /// model of few large tensors cannot be divided evenly so.
  Parameters,
  /// Equal slices of each group's parameters laid end to end (DeepSpeed's
  /// way): every rank owns 1/N of each group's elements, a parameter may be
  /// split between ranks. For optimizers that treat each element on its
  /// own, as every one in torch::optim does (LBFGS aside), the result is the
  /// same to the bit.
  Elements,
};

/// How a ZeroRedundancyOptimizer shards and saves its state.
struct ZeroOptions {
  /// How the parameters are divided among the ranks.
  TORCH_ARG(ZeroPartition, partition) = ZeroPartition::Parameters;
  /// What a checkpoint item of this optimizer holds. False: one consolidated
  /// state, exactly what a plain optimizer over every parameter saves (a
  /// plain optimizer can load it, and so can ZeRO at any world size). True:
  /// each rank's shard as that rank holds it, all gathered into the file; at
  /// the same world size and partition every rank resumes its own shard, at
  /// another the shards are put together and partitioned anew.
  TORCH_ARG(bool, checkpoint_shards) = false;
};

/// A part of one parameter that one rank owns: elements [offset, offset +
/// length) of parameter `param` (counted over every group, in order),
/// flattened; `group` is the parameter's group.
struct ZeroPiece {
  size_t param = 0;
  int64_t offset = 0;
  int64_t length = 0;
  int owner = 0;
  size_t group = 0;
};

/// The pieces of parameters of `numels` elements (one list per parameter
/// group) among `world_size` ranks, in parameter order (and, within one, in
/// offset order). Parameters: one piece per parameter; group by group,
/// largest first, each to the rank that owns the fewest elements so far
/// over all groups (the lowest such rank). Elements: of each group, rank r
/// owns elements [r S, (r + 1) S) of its parameters end to end, S =
/// ceil(group's total / N). A group added last leaves the pieces of the
/// groups before it as they were.
std::vector<ZeroPiece> partition_parameter_groups(
    const std::vector<std::vector<int64_t>>& numels, int world_size,
    ZeroPartition partition = ZeroPartition::Parameters);

/// partition_parameter_groups of one group.
std::vector<ZeroPiece> partition_parameters(const std::vector<int64_t>& numels, int world_size,
                                            ZeroPartition partition = ZeroPartition::Parameters);

namespace detail {

/// The part of ZeroRedundancyOptimizer that does not depend on the
/// optimizer's type. As a GradientShardOwner it keeps the gradient shards
/// of DdpOptions::shard_gradients (ZeRO-2), its pieces laid over the
/// wrapper's buckets.
class ShardedOptimizer : public torch::optim::Optimizer, public GradientShardOwner {
 public:
  using MakeOptimizer = std::function<std::unique_ptr<torch::optim::Optimizer>(
      std::vector<torch::optim::OptimizerParamGroup>)>;

  /// Collective (it checks that every rank holds the same parameters).
  ShardedOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups, World world,
                   MakeOptimizer make, std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                   ZeroOptions options);

  /// Collective: calls `closure` when given (it computes the gradients: on
  /// every rank, as in PyTorch), steps this rank's shard, then every rank
  /// takes each parameter from the rank that owns it. Returns the closure's
  /// loss, or an undefined tensor.
  at::Tensor step(LossClosure closure = nullptr) override;
  /// Collective, on every rank with the same group: adds a parameter group
  /// (its options, or the defaults where it has none) and shards it as
  /// the constructor would have; the pieces of the groups before it stay
  /// where they are, with their state. torch::optim::Optimizer's own
  /// add_param_group is not virtual: call this one on the
  /// ZeroRedundancyOptimizer, not through a base-class reference.
  void add_param_group(const torch::optim::OptimizerParamGroup& group);
  /// The state as ZeroOptions::checkpoint_shards says; on the rank that
  /// gathered it (save_checkpoint does: rank 0), after
  /// consolidate_state_dict when consolidated.
  void save(torch::serialize::OutputArchive& archive) const override;
  /// On every rank: takes this rank's shard from a consolidated state (as
  /// saved by ZeRO or by a plain optimizer of the same type over the same
  /// parameters) or from gathered shards of any world size.
  void load(torch::serialize::InputArchive& archive) override;

  /// Collective: gathers every rank's shard of the state on rank `to`,
  /// where consolidated() then holds all of it (PyTorch's
  /// consolidate_state_dict; save() writes it).
  void consolidate_state_dict(int to = 0);
  /// On the rank named by the last consolidate_state_dict: an optimizer of
  /// the same type over every parameter, holding the whole state.
  torch::optim::Optimizer& consolidated();

  /// Every parameter of every group, in the order given (torch::optim's
  /// parameters() warns that it is going away).
  const std::vector<at::Tensor>& all_parameters() const {
    return all_;
  }
  /// Who owns what, as partition_parameters says.
  const std::vector<ZeroPiece>& pieces() const {
    return pieces_;
  }
  /// The optimizer over this rank's shard.
  torch::optim::Optimizer& local_optimizer() {
    return *local_;
  }
  /// The world its ranks share the state over (a GradScaler's ranks agree
  /// there on whether a step is skipped).
  World& world() {
    return world_;
  }
  /// Bytes of this rank's optimizer state, as its shard saves.
  int64_t state_bytes() const;

  /// From DistributedDataParallel::step_in_backward: from now on the steps
  /// come through step_parameters, and step() is an error.
  void steps_in_backward();
  /// Whether steps_in_backward was called.
  bool stepping_in_backward() const {
    return in_backward_;
  }
  /// Collective: steps this rank's part of `params`, then every rank takes
  /// each of `params` from its owner.
  void step_parameters(const std::vector<at::Tensor>& params);
  /// DdpOptions::shard_gradients (ddp.shard_gradients_with): the pieces
  /// become each bucket's slices, and the new parameters travel in one
  /// all-gather per bucket instead of a broadcast per piece.
  void shard_by_buckets(const std::vector<std::vector<at::Tensor>>& buckets,
                        const std::vector<int64_t>& slices, int rank,
                        int world_size) override;
  /// The pieces in bucket `bucket` take their gradients from `slice`.
  void take_average(size_t bucket, const at::Tensor& slice,
                    const std::vector<char>& used) override;
  bool holds_unstepped_averages() const override {
    return unstepped_;
  }
  /// Whether the gradients are the shards of DdpOptions::shard_gradients:
  /// then they are the local optimizer's parameters' gradients, and the
  /// module's parameters have none.
  bool gradients_sharded() const {
    return by_buckets();
  }
  /// Under shard_gradients: lets go of the averages the last synchronised
  /// backward left, without a step (a GradScaler that skips one does this).
  /// Each synchronised backward must be followed by a step or by this.
  void discard_gradients();

  /// The tensors the local optimizer steps: this rank's pieces, each its
  /// parameter where whole, else a flat view of its elements.
  const std::vector<at::Tensor>& shard() const {
    return shard_;
  }
  /// Under shard_gradients (gradients_sharded()): the gradients this rank's
  /// shard steps with, one flat view per piece of shard(), undefined where
  /// no rank's loss reached the piece. lockstep::FaultTolerance over
  /// replica groups averages them across the groups before the step.
  std::vector<at::Tensor> shard_gradients() const;
  /// Piece `i` of shard_gradients(), which had none, takes `flat` (its
  /// gradient is then all the others' too).
  void give_shard_gradient(size_t i, const at::Tensor& flat);
  /// Collective, from save_checkpoint: gathers on rank 0 what save() writes.
  void prepare_save();
  /// From save_checkpoint once the file is written: lets go of what
  /// prepare_save gathered (on rank 0, the whole state).
  void finish_save();

 private:
  /// Every rank's shard as bytes, on rank `to`.
  std::vector<std::string> gather_shards(int to);
  /// Appends group `g`'s parameters and their pieces; this rank's pieces
  /// join the shard.
  void take_group(size_t g);
  /// Every rank must hold the same parameters in the same groups, or the
  /// owners disagree and each broadcast pairs different tensors.
  void check_same_parameters_as_rank_zero();
  /// This rank's pieces, and one whole piece per parameter.
  std::vector<ZeroPiece> mine_pieces() const;
  std::vector<ZeroPiece> whole_pieces() const;
  /// The groups of an optimizer over `tensors`, each of `pieces`' group,
  /// with this optimizer's options.
  std::vector<torch::optim::OptimizerParamGroup> groups_of(
      const std::vector<at::Tensor>& tensors, const std::vector<ZeroPiece>& pieces) const;
  /// An optimizer over every parameter, holding the state of `shards`
  /// (one per rank), saved by ranks that owned `pieces`.
  std::unique_ptr<torch::optim::Optimizer> assemble(const std::vector<std::string>& shards,
                                                    const std::vector<ZeroPiece>& pieces);
  /// Files piece `p` (its owner's, its name in errors; this rank's joins
  /// the shard).
  void add_piece(size_t p);
  /// Under shard_gradients: the new values of the buckets that hold any of
  /// `params`, each all-gathered from its slices' owners.
  void gather_buckets(const std::vector<at::Tensor>& params);
  bool by_buckets() const {
    return !buckets_.empty();
  }
  /// Makes the local optimizer hold `full`'s state of this rank's shard.
  void take_shard_from(torch::optim::Optimizer& full);
  /// The tensor that a piece steps as: its parameter when whole, else a
  /// flat view of its elements.
  at::Tensor piece_tensor(const ZeroPiece& piece) const;
  /// Gives the pieces of parameters that are not whole their part of the
  /// parameter's gradient.
  void point_piece_gradients();
  /// The learning rate and the other options, as a scheduler set them on
  /// this optimizer's groups, into `target`'s (the same count).
  void copy_options_to(torch::optim::Optimizer& target) const;
  /// The saved options that `source` loaded, into this optimizer's groups.
  void take_options_from(const torch::optim::Optimizer& source);
  void broadcast_from_owners(const std::vector<at::Tensor>& params);

  World world_;
  MakeOptimizer make_;
  ZeroOptions options_;
  std::vector<at::Tensor> all_;      // every group's parameters, end to end
  std::vector<int64_t> owned_;       // elements each rank owns (ZeroPartition::Parameters)
  std::vector<ZeroPiece> pieces_;
  // Per parameter, by its TensorImpl: the indices of its pieces.
  std::unordered_map<const c10::TensorImpl*, std::vector<size_t>> pieces_of_;
  std::vector<std::string> piece_what_; // each piece's broadcast, as errors name it
  std::vector<size_t> mine_;         // indices of this rank's pieces
  std::vector<at::Tensor> shard_;    // their tensors, as the local optimizer holds them
  std::unique_ptr<torch::optim::Optimizer> local_;
  std::unique_ptr<torch::optim::Optimizer> consolidated_;
  std::vector<std::string> gathered_; // ZeroOptions::checkpoint_shards, on rank 0
  bool in_backward_ = false;
  // Whether the state is more than the local optimizer made (a step, a
  // load): shard_by_buckets would lose it.
  bool has_state_ = false;
  bool unstepped_ = false; // averages taken (take_average), not yet stepped
  // shard_by_buckets: each bucket's parameters (indices into all_) in its
  // order, where each starts, the slice each rank owns, and this rank's
  // pieces in it (indices into mine_).
  struct BucketSlices {
    std::vector<size_t> params;
    std::vector<int64_t> starts;
    int64_t slice = 0;
    std::vector<size_t> mine;
  };
  std::vector<BucketSlices> buckets_;
  std::vector<size_t> bucket_of_;  // per parameter
  std::vector<size_t> member_of_;  // per parameter, in its bucket
  at::Tensor gather_buffer_;       // gather_buckets' output, reused
};

} // namespace detail

/// A sharded `Optim` (torch::optim::Adam, AdamW, SGD, ...): see the top of
/// this header. Built on every rank with the same parameters in the same
/// groups; a learning-rate scheduler sets the groups' options as usual.
template <typename Optim>
class ZeroRedundancyOptimizer : public detail::ShardedOptimizer {
 public:
  /// One group of `params`, with `options`.
  template <typename OptimOptions>
  ZeroRedundancyOptimizer(std::vector<at::Tensor> params, World world,
                          const OptimOptions& options, ZeroOptions zero = {})
      : ZeroRedundancyOptimizer(one_group(std::move(params)), std::move(world), options,
                                zero) {}

  /// `groups`, each with its own options or, where it has none, `options`.
  template <typename OptimOptions>
  ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups, World world,
                          const OptimOptions& options, ZeroOptions zero = {})
      : ShardedOptimizer(
            std::move(groups), std::move(world),
            [options](std::vector<torch::optim::OptimizerParamGroup> shard)
                -> std::unique_ptr<torch::optim::Optimizer> {
              return std::make_unique<Optim>(std::move(shard), options);
            },
            std::make_unique<OptimOptions>(options), zero) {}

  Optim& local() {
    return static_cast<Optim&>(local_optimizer());
  }

 private:
  static std::vector<torch::optim::OptimizerParamGroup> one_group(
      std::vector<at::Tensor> params) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::move(params));
    return groups;
  }
};

} // namespace lockstep
