// ZeroRedundancyOptimizer's shard: who owns what, the shard's step, the
// parameters brought back from their owners, and the state put together
// (consolidated, or from shards) for checkpoints.

#include <lockstep/zero_redundancy_optimizer.h>

#include <algorithm>
#include <numeric>
#include <sstream>
#include <type_traits>
#include <unordered_map>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <lockstep/step_in_backward.h>

#include "common/wording.h"
#include "optim/optimizer_bytes.h"
#include "world/broadcast_bytes.h"

namespace lockstep {

std::vector<int> partition_parameters(const std::vector<int64_t>& numels, int world_size) {
  std::vector<size_t> largest_first(numels.size());
  std::iota(largest_first.begin(), largest_first.end(), 0);
  std::stable_sort(largest_first.begin(), largest_first.end(),
                   [&](size_t a, size_t b) { return numels[a] > numels[b]; });
  std::vector<int64_t> owned(world_size, 0);
  std::vector<int> owners(numels.size(), 0);
  for (size_t index : largest_first) {
    int rank = static_cast<int>(std::min_element(owned.begin(), owned.end()) - owned.begin());
    owners[index] = rank;
    owned[rank] += numels[index];
  }
  return owners;
}

namespace detail {
namespace {

constexpr const char* kShardCount = "lockstep_zero_shards";

// The key of `param` in an optimizer's state: its TensorImpl, as a string
// in LibTorch 1.x and as a pointer in 2.x.
template <typename Map>
typename Map::key_type state_key(const Map&, const at::Tensor& param) {
  using Key = typename Map::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;
    key << param.unsafeGetTensorImpl();
    return key.str();
  } else {
    return static_cast<Key>(param.unsafeGetTensorImpl());
  }
}

std::vector<at::Tensor> owned_by(const std::vector<at::Tensor>& params,
                                 const std::vector<int>& owners, int rank) {
  std::vector<at::Tensor> shard;
  for (size_t i = 0; i < params.size(); ++i) {
    if (owners[i] == rank) {
      shard.push_back(params[i]);
    }
  }
  return shard;
}

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
  owners_ = partition_parameters(numels_of(all_parameters()), world_.size());
  shard_ = owned_by(all_parameters(), owners_, world_.rank());
  for (size_t i = 0; i < owners_.size(); ++i) {
    owner_of_[all_parameters()[i].unsafeGetTensorImpl()] = owners_[i];
  }
  local_ = make_(shard_);
  // Every rank must hold the same parameters, or the owners disagree and
  // each broadcast pairs different tensors.
  auto mine = at::tensor(numels_of(all_parameters()), at::kLong);
  auto first = mine.clone();
  world_.broadcast(first, 0, "the parameter sizes of a ZeroRedundancyOptimizer");
  LOCKSTEP_ENFORCE(first.equal(mine), UsageError, "rank ", world_.rank(), ": this "
                   "ZeroRedundancyOptimizer holds parameters of other sizes than rank 0's (",
                   mine.numel(), " against ", first.numel(), " tensors, or the same count in "
                   "another shape): every rank must build it over the same parameters, in "
                   "the same order.");
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
  std::vector<at::Tensor> mine;
  for (const auto& param : params) {
    auto owner = owner_of_.find(param.unsafeGetTensorImpl());
    if (owner != owner_of_.end() && owner->second == world_.rank()) {
      mine.push_back(param);
    }
  }
  copy_options_to(*local_);
  if (!mine.empty()) {
    lockstep::step_parameters(*local_, mine);
  }
  broadcast_from_owners(params);
}

void ShardedOptimizer::broadcast_from_owners(const std::vector<at::Tensor>& params) {
  at::NoGradGuard no_grad;
  for (const auto& param : params) {
    auto owner = owner_of_.find(param.unsafeGetTensorImpl());
    if (owner == owner_of_.end()) {
      continue; // not this optimizer's: the same on every rank
    }
    auto values = param.detach();
    world_.broadcast(values, owner->second,
                     str("parameter ", param.sizes(), " from rank ", owner->second,
                         ", its owner in the ZeroRedundancyOptimizer"));
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
      shards.emplace_back(static_cast<const char*>(bytes.data_ptr()),
                          static_cast<size_t>(bytes.numel()));
    }
  }
  return shards;
}

std::unique_ptr<torch::optim::Optimizer> ShardedOptimizer::assemble(
    const std::vector<std::string>& shards, int world_size) {
  auto owners = partition_parameters(numels_of(all_parameters()), world_size);
  auto full = make_(all_parameters());
  copy_options_to(*full);
  for (int rank = 0; rank < world_size; ++rank) {
    auto part = make_(owned_by(all_parameters(), owners, rank));
    load_optimizer_bytes(*part, shards[rank]);
    for (auto& [key, state] : part->state()) {
      full->state()[key] = std::move(state);
    }
    if (!part->param_groups().empty() && rank == 0) {
      for (auto& group : full->param_groups()) {
        group.set_options(part->param_groups().front().options().clone());
      }
    }
  }
  return full;
}

void ShardedOptimizer::consolidate_state_dict(int to) {
  LOCKSTEP_ENFORCE(to >= 0 && to < world_.size(), UsageError, "consolidate_state_dict(", to,
                   ") names no rank of a world of ", world_.size(), ".");
  auto shards = gather_shards(to);
  consolidated_.reset();
  if (world_.rank() == to) {
    consolidated_ = assemble(shards, world_.size());
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
  for (size_t rank = 0; rank < gathered_.size(); ++rank) {
    const auto& bytes = gathered_[rank];
    auto tensor = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::copy(bytes.begin(), bytes.end(), static_cast<char*>(tensor.data_ptr()));
    archive.write(str("shard/", rank), tensor);
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
      shards.emplace_back(static_cast<const char*>(shard.data_ptr()),
                          static_cast<size_t>(shard.numel()));
    }
    full = assemble(shards, static_cast<int>(count.toInt()));
  } else {
    full = make_(all_parameters());
    full->load(archive);
  }
  take_shard_from(*full);
}

void ShardedOptimizer::take_shard_from(torch::optim::Optimizer& full) {
  local_ = make_(shard_);
  for (const auto& param : shard_) {
    auto key = state_key(full.state(), param);
    auto state = full.state().find(key);
    if (state != full.state().end()) {
      local_->state()[key] = std::move(state->second);
    }
  }
  // The options saved (a scheduler's learning rate) are this optimizer's.
  const auto& saved = full.param_groups().front().options();
  param_groups().front().set_options(saved.clone());
  copy_options_to(*local_);
}

} // namespace detail
} // namespace lockstep
