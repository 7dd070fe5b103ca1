// ZeroRedundancyOptimizer under DdpOptions::shard_gradients (ZeRO-2): its
// pieces are the slices of the wrapper's buckets that the reduce-scatter
// leaves each rank, so that a rank's averaged gradients are exactly the
// gradients of its pieces, and the new parameters travel back in one
// all-gather per bucket. For optimizers that treat each element on its own
// (every one in torch::optim but LBFGS), where the pieces lie changes
// nothing in the result.

#include <algorithm>
#include <unordered_map>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <lockstep/sharded_collectives.h>
#include <lockstep/zero_redundancy_optimizer.h>

#include "common/wording.h"

namespace lockstep::detail {

void ShardedOptimizer::shard_by_buckets(const std::vector<std::vector<at::Tensor>>& buckets,
                                        const std::vector<int64_t>& slices_in, int rank,
                                        int world_size) {
  LOCKSTEP_ENFORCE(rank == world_.rank() && world_size == world_.size(), UsageError,
                   "the ZeroRedundancyOptimizer given to shard_gradients_with shards over ",
                   world_.size(), " rank(s) (this one rank ", world_.rank(), "), the wrapper "
                   "over ", world_size, " (rank ", rank, "): give both the same world.");
  LOCKSTEP_ENFORCE(options_.partition() == ZeroPartition::Elements, UsageError,
                   "DdpOptions::shard_gradients lays the ZeroRedundancyOptimizer's pieces over "
                   "the buckets, in slices of parameters: build it with "
                   "ZeroOptions().partition(ZeroPartition::Elements).");
  LOCKSTEP_ENFORCE(!options_.checkpoint_shards(), UsageError, "ZeroOptions::checkpoint_shards "
                   "saves each rank's shard under its partition, and the buckets' is one that "
                   "a later run need not make: leave checkpoint_shards off under "
                   "DdpOptions::shard_gradients (the consolidated state loads anywhere).");
  LOCKSTEP_ENFORCE(!has_state_ && !by_buckets(), UsageError, "the "
                   "ZeroRedundancyOptimizer given to shard_gradients_with has a state already "
                   "(it stepped, or loaded one), which its pieces would lose: register it "
                   "before its first step, then load.");
  for (const auto& param : all_) {
    LOCKSTEP_ENFORCE(param.is_contiguous(), UsageError, "DdpOptions::shard_gradients splits "
                     "parameters between ranks, and a parameter of shape ", param.sizes(),
                     " is not contiguous: make it contiguous before wrapping the module.");
  }
  std::unordered_map<const c10::TensorImpl*, size_t> index_of;
  std::vector<size_t> group_of;
  for (size_t g = 0; g < param_groups().size(); ++g) {
    for (const auto& param : param_groups()[g].params()) {
      index_of[param.unsafeGetTensorImpl()] = group_of.size();
      group_of.push_back(g);
    }
  }
  std::vector<BucketSlices> slices(buckets.size());
  std::vector<size_t> bucket_of(all_.size(), 0);
  std::vector<size_t> member_of(all_.size(), 0);
  std::vector<char> seen(all_.size(), 0);
  std::vector<ZeroPiece> pieces;
  for (size_t b = 0; b < buckets.size(); ++b) {
    auto& bucket = slices[b];
    int64_t total = 0;
    for (size_t k = 0; k < buckets[b].size(); ++k) {
      const auto& param = buckets[b][k];
      auto found = index_of.find(param.unsafeGetTensorImpl());
      LOCKSTEP_ENFORCE(found != index_of.end(), UsageError, "the wrapper trains a parameter "
                       "of shape ", param.sizes(), " that the ZeroRedundancyOptimizer given to "
                       "shard_gradients_with does not hold: give it every trainable parameter "
                       "of the module (ddp.module()->parameters()).");
      size_t i = found->second;
      seen[i] = 1;
      bucket_of[i] = b;
      member_of[i] = k;
      bucket.params.push_back(i);
      bucket.starts.push_back(total);
      total += param.numel();
    }
    bucket.slice = slices_in.at(b);
    TORCH_INTERNAL_ASSERT(bucket.slice * world_size >= total, "a bucket's slices must cover it");
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      size_t i = bucket.params[k];
      int64_t numel = all_[i].numel();
      for (int64_t offset = 0; offset < numel;) {
        int owner = static_cast<int>((bucket.starts[k] + offset) / bucket.slice);
        int64_t length =
            std::min(numel - offset, (owner + 1) * bucket.slice - bucket.starts[k] - offset);
        pieces.push_back({i, offset, length, owner, group_of[i]});
        offset += length;
      }
    }
  }
  for (size_t i = 0; i < all_.size(); ++i) {
    LOCKSTEP_ENFORCE(seen[i], UsageError, "the ZeroRedundancyOptimizer given to "
                     "shard_gradients_with holds a parameter of shape ", all_[i].sizes(),
                     " that the wrapper does not train (it does not require grad, or belongs "
                     "to another module): give the optimizer the module's trainable parameters "
                     "only.");
  }
  // In parameter order, and within one in offset order, as ZeroPiece says.
  std::stable_sort(pieces.begin(), pieces.end(), [](const ZeroPiece& a, const ZeroPiece& b) {
    return a.param < b.param || (a.param == b.param && a.offset < b.offset);
  });
  pieces_ = std::move(pieces);
  pieces_of_.clear();
  piece_what_.clear();
  mine_.clear();
  shard_.clear();
  for (size_t p = 0; p < pieces_.size(); ++p) {
    add_piece(p);
  }
  for (size_t i = 0; i < mine_.size(); ++i) {
    slices[bucket_of[pieces_[mine_[i]].param]].mine.push_back(i);
  }
  buckets_ = std::move(slices);
  bucket_of_ = std::move(bucket_of);
  member_of_ = std::move(member_of);
  local_ = make_(groups_of(shard_, mine_pieces()));
}

void ShardedOptimizer::take_average(size_t bucket, const at::Tensor& slice,
                                    const std::vector<char>& used) {
  const auto& slices = buckets_.at(bucket);
  int64_t base = world_.rank() * slices.slice;
  for (size_t i : slices.mine) {
    const auto& piece = pieces_[mine_[i]];
    const auto& param = all_[piece.param];
    size_t k = member_of_[piece.param];
    auto& grad = shard_[i].mutable_grad();
    if (!used[k]) {
      grad.reset(); // no rank's loss reached it: it does not step
      continue;
    }
    auto part = slice.narrow(0, slices.starts[k] + piece.offset - base, piece.length);
    grad = shard_[i].is_same(param) ? part.view(param.sizes()) : part;
  }
  unstepped_ = true;
}

void ShardedOptimizer::discard_gradients() {
  for (auto& piece : shard_) {
    piece.mutable_grad().reset();
  }
  unstepped_ = false;
}

void ShardedOptimizer::gather_buckets(const std::vector<at::Tensor>& params) {
  std::vector<char> chosen(buckets_.size(), 0);
  for (const auto& param : params) {
    auto found = pieces_of_.find(param.unsafeGetTensorImpl());
    if (found != pieces_of_.end()) {
      chosen[bucket_of_[pieces_[found->second.front()].param]] = 1;
    }
  }
  at::NoGradGuard no_grad;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const auto& bucket = buckets_[b];
    if (!chosen[b] || bucket.slice == 0) {
      continue;
    }
    auto options = all_[bucket.params.front()].options().requires_grad(false);
    int64_t base = world_.rank() * bucket.slice;
    auto mine = at::zeros({bucket.slice}, options);
    for (size_t i : bucket.mine) {
      const auto& piece = pieces_[mine_[i]];
      mine.narrow(0, bucket.starts[member_of_[piece.param]] + piece.offset - base, piece.length)
          .copy_(shard_[i].detach().reshape({-1}));
    }
    // One buffer for every bucket's gather, kept: made anew, a bucket's
    // worth of fresh pages would fault in every step.
    int64_t numel = bucket.slice * world_.size();
    if (!gather_buffer_.defined() || gather_buffer_.numel() < numel ||
        gather_buffer_.dtype() != options.dtype() || gather_buffer_.device() != options.device()) {
      gather_buffer_ = at::empty({numel}, options);
    }
    auto full = gather_buffer_.narrow(0, 0, numel);
    all_gather_into(world_, full, mine,
                    str("all_gather_into of the new parameters of bucket ", b, " (",
                        bucket.params.size(), " parameter(s), from their slices' owners in "
                        "the ZeroRedundancyOptimizer)"));
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      auto target = all_[bucket.params[k]].detach();
      target.copy_(full.narrow(0, bucket.starts[k], target.numel()).view(target.sizes()));
    }
  }
}

} // namespace lockstep::detail
