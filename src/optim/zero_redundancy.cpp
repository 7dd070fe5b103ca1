// ZeroRedundancyOptimizer's shard: who owns what, the shard's step, the
// parameters brought back from their owners, and the state put together
// (consolidated, or from shards) for checkpoints. A shard is a list of
// pieces: whole parameters, or (ZeroPartition::Elements) flat slices of them,
// which the local optimizer steps as tensors of their own sharing the
// parameter's memory.

#include <lockstep/zero_redundancy_optimizer.h>

#include <algorithm>
#include <numeric>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <lockstep/step_in_backward.h>

#include "common/wording.h"
#include "optim/optimizer_bytes.h"
#include "optim/parameter_state.h"
#include "world/broadcast_bytes.h"

namespace lockstep {

std::vector<ZeroPiece> partition_parameters(const std::vector<int64_t>& numels, int world_size,
                                            ZeroPartition partition) {
  std::vector<ZeroPiece> pieces;
  if (partition == ZeroPartition::Elements) {
    int64_t total = std::accumulate(numels.begin(), numels.end(), int64_t{0});
    int64_t slice = std::max<int64_t>(1, (total + world_size - 1) / world_size);
    int64_t start = 0; // of the current parameter, end to end
    for (size_t index = 0; index < numels.size(); ++index) {
      for (int64_t offset = 0; offset < numels[index];) {
        int owner = static_cast<int>((start + offset) / slice);
        int64_t length = std::min(numels[index] - offset, (owner + 1) * slice - start - offset);
        pieces.push_back({index, offset, length, owner});
        offset += length;
      }
      start += numels[index];
    }
    return pieces;
  }
  std::vector<size_t> largest_first(numels.size());
  std::iota(largest_first.begin(), largest_first.end(), 0);
  std::stable_sort(largest_first.begin(), largest_first.end(),
                   [&](size_t a, size_t b) { return numels[a] > numels[b]; });
  std::vector<int64_t> owned(world_size, 0);
  pieces.resize(numels.size());
  for (size_t index : largest_first) {
    int rank = static_cast<int>(std::min_element(owned.begin(), owned.end()) - owned.begin());
    pieces[index] = {index, 0, numels[index], rank};
    owned[rank] += numels[index];
  }
  return pieces;
}

namespace detail {
namespace {

constexpr const char* kShardCount = "lockstep_zero_shards";
constexpr const char* kShardPartition = "lockstep_zero_partition";

std::vector<int64_t> numels_of(const std::vector<at::Tensor>& params) {
  std::vector<int64_t> numels;
  for (const auto& param : params) {
    numels.push_back(param.numel());
  }
  return numels;
}

} // namespace

ShardedOptimizer::ShardedOptimizer(std::vector<at::Tensor> params, World world,
                                   MakeOptimizer make,
                                   std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                                   ZeroOptions options)
    : Optimizer(std::move(params), std::move(defaults)),
      world_(std::move(world)),
      make_(std::move(make)),
      options_(options) {
  const auto& all = all_parameters();
  pieces_ = partition_parameters(numels_of(all), world_.size(), options_.partition());
  for (size_t p = 0; p < pieces_.size(); ++p) {
    const auto& piece = pieces_[p];
    LOCKSTEP_ENFORCE(piece.length == all[piece.param].numel() ||
                         all[piece.param].is_contiguous(),
                     UsageError, "ZeroPartition::Elements splits a parameter of shape ",
                     all[piece.param].sizes(), " that is not contiguous; make it contiguous "
                     "or partition by parameters.");
    pieces_of_[all[piece.param].unsafeGetTensorImpl()].push_back(p);
    piece_what_.push_back(str(
        "parameter ", all[piece.param].sizes(),
        piece.length < all[piece.param].numel()
            ? str(" (elements ", piece.offset, " to ", piece.offset + piece.length, ")")
            : std::string(),
        " from rank ", piece.owner, ", its owner in the ZeroRedundancyOptimizer"));
    if (piece.owner == world_.rank()) {
      mine_.push_back(p);
      shard_.push_back(piece_tensor(piece));
    }
  }
  local_ = make_(shard_);
  // Every rank must hold the same parameters, or the owners disagree and
  // each broadcast pairs different tensors.
  auto mine = at::tensor(numels_of(all), at::kLong);
  auto first = mine.clone();
  world_.broadcast(first, 0, "the parameter sizes of a ZeroRedundancyOptimizer");
  LOCKSTEP_ENFORCE(first.equal(mine), UsageError, "rank ", world_.rank(), ": this "
                   "ZeroRedundancyOptimizer holds parameters of other sizes than rank 0's (",
                   mine.numel(), " against ", first.numel(), " tensors, or the same count in "
                   "another shape): every rank must build it over the same parameters, in "
                   "the same order.");
}

at::Tensor ShardedOptimizer::piece_tensor(const ZeroPiece& piece) const {
  const auto& param = all_parameters()[piece.param];
  if (piece.length == param.numel()) {
    return param;
  }
  return param.detach().view({-1}).narrow(0, piece.offset, piece.length);
}

void ShardedOptimizer::point_piece_gradients() {
  // A piece of a parameter is a view of its memory; loading a module
  // (torch::load, set_) gives the parameter other memory. The view is
  // pointed there again, the same tensor, so that the optimizer's state for
  // it stays.
  for (size_t i = 0; i < mine_.size(); ++i) {
    const auto& piece = pieces_[mine_[i]];
    const auto& param = all_parameters()[piece.param];
    if (!shard_[i].is_same(param) && !shard_[i].is_alias_of(param)) {
      at::NoGradGuard no_grad;
      shard_[i].set_(param.storage(), param.storage_offset() + piece.offset, {piece.length},
                     {1});
    }
  }
  for (size_t i = 0; i < mine_.size(); ++i) {
    const auto& piece = pieces_[mine_[i]];
    const auto& param = all_parameters()[piece.param];
    if (shard_[i].is_same(param)) {
      continue;
    }
    const auto& grad = param.grad();
    shard_[i].mutable_grad() =
        grad.defined() ? grad.reshape({-1}).narrow(0, piece.offset, piece.length) : at::Tensor();
  }
}

void ShardedOptimizer::copy_options_to(torch::optim::Optimizer& target) const {
  for (auto& group : target.param_groups()) {
    group.set_options(param_groups().front().options().clone());
  }
}

at::Tensor ShardedOptimizer::step(LossClosure closure) {
  LOCKSTEP_ENFORCE(closure == nullptr, UsageError, "ZeroRedundancyOptimizer::step takes no "
                   "closure: each rank evaluates its own loss before stepping.");
  LOCKSTEP_ENFORCE(!in_backward_, UsageError, "rank ", world_.rank(), ": this "
                   "ZeroRedundancyOptimizer already steps inside backward "
                   "(ddp.step_in_backward(optimizer)); calling step() as well would step "
                   "every shard twice with the same gradients. Remove the call to step().");
  copy_options_to(*local_);
  point_piece_gradients();
  local_->step();
  broadcast_from_owners(all_parameters());
  return {};
}

void ShardedOptimizer::steps_in_backward() {
  LOCKSTEP_ENFORCE(!in_backward_, UsageError, "this ZeroRedundancyOptimizer already steps "
                   "inside backward; register it once.");
  in_backward_ = true;
}

void ShardedOptimizer::step_parameters(const std::vector<at::Tensor>& params) {
  std::vector<char> chosen(pieces_.size(), 0);
  for (const auto& param : params) {
    auto found = pieces_of_.find(param.unsafeGetTensorImpl());
    if (found != pieces_of_.end()) {
      for (size_t p : found->second) {
        chosen[p] = 1;
      }
    }
  }
  std::vector<at::Tensor> mine;
  for (size_t i = 0; i < mine_.size(); ++i) {
    if (chosen[mine_[i]]) {
      mine.push_back(shard_[i]);
    }
  }
  copy_options_to(*local_);
  if (!mine.empty()) {
    point_piece_gradients();
    lockstep::step_parameters(*local_, mine);
  }
  broadcast_from_owners(params);
}

void ShardedOptimizer::broadcast_from_owners(const std::vector<at::Tensor>& params) {
  at::NoGradGuard no_grad;
  for (const auto& param : params) {
    auto found = pieces_of_.find(param.unsafeGetTensorImpl());
    if (found == pieces_of_.end()) {
      continue; // not this optimizer's: the same on every rank
    }
    for (size_t p : found->second) {
      auto values = piece_tensor(pieces_[p]).detach();
      world_.broadcast(values, pieces_[p].owner, piece_what_[p]);
    }
  }
}

int64_t ShardedOptimizer::state_bytes() const {
  return static_cast<int64_t>(optimizer_bytes(*local_).size());
}

std::vector<std::string> ShardedOptimizer::gather_shards(int to) {
  // Every rank's shard on every rank: simple, and a checkpoint's state is
  // written rarely.
  auto all = gather_bytes(world_, optimizer_bytes(*local_));
  std::vector<std::string> shards;
  if (world_.rank() == to) {
    for (const auto& bytes : all) {
      shards.push_back(bytes_of_tensor(bytes));
    }
  }
  return shards;
}

std::unique_ptr<torch::optim::Optimizer> ShardedOptimizer::assemble(
    const std::vector<std::string>& shards, int world_size, ZeroPartition partition) {
  const auto& all = all_parameters();
  auto pieces = partition_parameters(numels_of(all), world_size, partition);
  // Each piece's state, as the rank that owned it saved it.
  std::vector<ParamState> states(pieces.size());
  for (int rank = 0; rank < world_size; ++rank) {
    std::vector<size_t> owned;
    std::vector<at::Tensor> tensors;
    for (size_t p = 0; p < pieces.size(); ++p) {
      if (pieces[p].owner == rank) {
        owned.push_back(p);
        tensors.push_back(piece_tensor(pieces[p]));
      }
    }
    auto part = make_(tensors);
    load_optimizer_bytes(*part, shards[rank]);
    for (size_t i = 0; i < owned.size(); ++i) {
      states[owned[i]] = take_state(*part, tensors[i]);
    }
  }
  auto full = make_(all);
  copy_options_to(*full);
  for (size_t first = 0; first < pieces.size();) {
    size_t end = first;
    std::vector<ParamState> parts;
    for (; end < pieces.size() && pieces[end].param == pieces[first].param; ++end) {
      if (states[end]) {
        parts.push_back(std::move(states[end]));
      }
    }
    const auto& param = all[pieces[first].param];
    if (parts.size() == 1 && end - first == 1) {
      put_state(*full, param, std::move(parts.front()));
    } else if (!parts.empty()) {
      LOCKSTEP_ENFORCE(parts.size() == end - first, CheckpointError, "the saved state of a "
                       "parameter of shape ", param.sizes(), " lacks some of its pieces.");
      put_state(*full, param, joined_state(parts, pieces[first].length, param));
    }
    first = end;
  }
  return full;
}

void ShardedOptimizer::consolidate_state_dict(int to) {
  LOCKSTEP_ENFORCE(to >= 0 && to < world_.size(), UsageError, "consolidate_state_dict(", to,
                   ") names no rank of a world of ", world_.size(), ".");
  auto shards = gather_shards(to);
  consolidated_.reset();
  if (world_.rank() == to) {
    consolidated_ = assemble(shards, world_.size(), options_.partition());
  }
}

torch::optim::Optimizer& ShardedOptimizer::consolidated() {
  LOCKSTEP_ENFORCE(consolidated_ != nullptr, UsageError, "rank ", world_.rank(), " holds no "
                   "consolidated state: call consolidate_state_dict(rank) on every rank first, "
                   "and read it on that rank (as with PyTorch's ZeroRedundancyOptimizer).");
  return *consolidated_;
}

void ShardedOptimizer::prepare_save() {
  if (options_.checkpoint_shards()) {
    gathered_ = gather_shards(0);
  } else {
    consolidate_state_dict(0);
  }
}

void ShardedOptimizer::finish_save() {
  gathered_.clear();
  consolidated_.reset();
}

void ShardedOptimizer::save(torch::serialize::OutputArchive& archive) const {
  if (!options_.checkpoint_shards()) {
    LOCKSTEP_ENFORCE(consolidated_ != nullptr, UsageError, "rank ", world_.rank(), ": saving "
                     "a ZeroRedundancyOptimizer needs its whole state on this rank: call "
                     "consolidate_state_dict(", world_.rank(), ") on every rank first "
                     "(lockstep::save_checkpoint does).");
    consolidated_->save(archive);
    return;
  }
  LOCKSTEP_ENFORCE(!gathered_.empty(), UsageError, "rank ", world_.rank(), ": saving a "
                   "ZeroRedundancyOptimizer's shards needs them gathered on this rank: save "
                   "it through lockstep::save_checkpoint.");
  archive.write(kShardCount, c10::IValue(static_cast<int64_t>(gathered_.size())));
  archive.write(kShardPartition, c10::IValue(static_cast<int64_t>(options_.partition())));
  for (size_t rank = 0; rank < gathered_.size(); ++rank) {
    archive.write(str("shard/", rank), tensor_of_bytes(gathered_[rank]));
  }
}

void ShardedOptimizer::load(torch::serialize::InputArchive& archive) {
  c10::IValue count;
  std::unique_ptr<torch::optim::Optimizer> full;
  if (archive.try_read(kShardCount, count)) {
    std::vector<std::string> shards;
    for (int64_t rank = 0; rank < count.toInt(); ++rank) {
      at::Tensor shard;
      archive.read(str("shard/", rank), shard);
      shards.push_back(bytes_of_tensor(shard));
    }
    c10::IValue partition;
    archive.read(kShardPartition, partition);
    full = assemble(shards, static_cast<int>(count.toInt()),
                    static_cast<ZeroPartition>(partition.toInt()));
  } else {
    full = make_(all_parameters());
    full->load(archive);
  }
  take_shard_from(*full);
}

void ShardedOptimizer::take_shard_from(torch::optim::Optimizer& full) {
  local_ = make_(shard_);
  for (size_t i = 0; i < mine_.size(); ++i) {
    const auto& piece = pieces_[mine_[i]];
    const auto& param = all_parameters()[piece.param];
    if (shard_[i].is_same(param)) {
      put_state(*local_, param, take_state(full, param));
      continue;
    }
    if (const auto* whole = find_state(full, param)) {
      put_state(*local_, shard_[i], state_slice(*whole, param, piece.offset, piece.length));
    }
  }
  // The options saved (a scheduler's learning rate) are this optimizer's.
  const auto& saved = full.param_groups().front().options();
  param_groups().front().set_options(saved.clone());
  copy_options_to(*local_);
}

} // namespace detail
} // namespace lockstep
