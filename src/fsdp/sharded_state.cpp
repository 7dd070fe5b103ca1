// FullyShardedDataParallel's state as checkpoints and checks see it: the
// module's parameters in full while summoned, the optimizer's state of every
// parameter in full, put together from the ranks' pieces, or taken apart
// into them at any world size, and what the ranks hold alike.

#include <algorithm>
#include <sstream>
#include <typeinfo>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <lockstep/error.h>

#include "fsdp/sharded_model_state.h"
#include "optim/parameter_state.h"
#include "reducer/model_state.h"
#include "world/broadcast_bytes.h"

namespace lockstep::detail {
namespace {

// A tensor of `shape` without memory: what the state functions need of a
// parameter is its shape.
at::Tensor shaped(const std::vector<int64_t>& shape, const at::Tensor& like) {
  return at::empty(shape, like.options().device(at::kMeta));
}

std::string bytes_of(torch::serialize::OutputArchive& archive) {
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

} // namespace

void ShardedModel::begin_full_parameters() {
  LOCKSTEP_ENFORCE(!state_->backward_open, UsageError,
                   "FullyShardedDataParallel: summon_full_parameters inside a backward; "
                   "call it between steps.");
  // Gathered afresh: what an earlier forward gathered may predate a step.
  for (size_t u = 0; u < state_->units.size(); ++u) {
    state_->free(u);
    state_->gather_in_full_precision(u);
  }
}

void ShardedModel::end_full_parameters() {
  for (size_t u = 0; u < state_->units.size(); ++u) {
    state_->units[u]->write_back();
    state_->free(u);
  }
}

namespace {

// Each group's options from `from` to `to`: optimizers of one type with
// their groups in one order (the checkpoint functions' contract), else a
// UsageError on every rank alike.
void copy_group_options(const torch::optim::Optimizer& from, torch::optim::Optimizer& to) {
  LOCKSTEP_ENFORCE(from.param_groups().size() == to.param_groups().size(), UsageError,
                   "FullyShardedDataParallel: the full optimizer has ",
                   to.param_groups().size() > from.param_groups().size() ? "more" : "fewer",
                   " parameter groups than the sharded one (", to.param_groups().size(),
                   " against ", from.param_groups().size(), "): build both alike, the full "
                   "one over module()->parameters() in the same groups.");
  for (size_t g = 0; g < from.param_groups().size(); ++g) {
    const auto& options = from.param_groups()[g].options();
    const auto& theirs = to.param_groups()[g].options();
    LOCKSTEP_ENFORCE(typeid(options) == typeid(theirs), UsageError,
                     "FullyShardedDataParallel: the full and the sharded optimizer are of "
                     "two types; build the full one of the sharded one's type.");
    to.param_groups()[g].set_options(options.clone());
  }
}

} // namespace

void ShardedModel::consolidate_optimizer_state(const torch::optim::Optimizer& sharded,
                                               torch::optim::Optimizer& full, int to) {
  // Every rank's pieces' states, each under its member's number.
  torch::serialize::OutputArchive mine;
  const torch::optim::OptimizerParamState* like = nullptr;
  auto members = state_->members_in_order();
  for (size_t number = 0; number < members.size(); ++number) {
    const auto& member = *members[number].member;
    const auto* state = member.piece.defined() ? find_state(sharded, member.piece) : nullptr;
    if (state != nullptr) {
      torch::serialize::OutputArchive piece;
      state->serialize(piece);
      mine.write(std::to_string(number), piece);
      like = like != nullptr ? like : state;
    }
  }
  // One group's pieces make the whole (under hybrid sharding every group
  // holds the same).
  auto all = gather_bytes(state_->shard_world, bytes_of(mine));
  if (state_->world.rank() != to) {
    return;
  }
  std::vector<torch::serialize::InputArchive> archives(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    std::istringstream in(bytes_of_tensor(all[r]));
    archives[r].load_from(in);
  }
  for (size_t number = 0; number < members.size(); ++number) {
    const auto& unit = *members[number].unit;
    const auto& member = *members[number].member;
    auto key = std::to_string(number);
    std::vector<ParamState> slices;
    int64_t first_length = 0;
    for (size_t r = 0; r < archives.size(); ++r) {
      torch::serialize::InputArchive piece;
      if (!archives[r].try_read(key, piece)) {
        continue;
      }
      LOCKSTEP_ENFORCE(like != nullptr, UsageError, "FullyShardedDataParallel: rank ", to,
                       " holds no optimizer state of its own to consolidate the others' "
                       "into; consolidate to a rank that has stepped some parameters.");
      auto slice = like->clone();
      slice->serialize(piece);
      // The ranks hold consecutive pieces of the member: the first one's
      // length tells the state's per-element tensors from the rest.
      if (slices.empty()) {
        int64_t rank_first = static_cast<int64_t>(r) * unit.per_rank();
        first_length = std::min(member.offset + member.numel, rank_first + unit.per_rank()) -
            std::max(member.offset, rank_first);
      }
      slices.push_back(std::move(slice));
    }
    if (!slices.empty()) {
      put_state(full, member.param, joined_state(slices, first_length,
                                                 shaped(member.shape, member.param)));
    }
  }
  // The groups' options too (a decayed learning rate, say), alike on every
  // rank: what load_optimizer_state gives back.
  copy_group_options(sharded, full);
}

void ShardedModel::load_optimizer_state(torch::optim::Optimizer& sharded,
                                        const torch::optim::Optimizer& full) {
  for (const auto& unit : state_->units) {
    for (const auto& member : unit->members()) {
      const auto* whole = find_state(full, member.param);
      if (whole == nullptr || !member.piece.defined()) {
        continue;
      }
      put_state(sharded, member.piece,
                state_slice(*whole, shaped(member.shape, member.param),
                            member.piece_offset - member.offset, member.piece.numel()));
    }
  }
  copy_group_options(full, sharded);
}

void ShardedModel::check_replicas(torch::nn::Module& module, ReplicaCheck what) {
  if (what == ReplicaCheck::Parameters) {
    return; // held once each: nothing to compare, on every rank alike
  }
  std::vector<ReplicaEntry> buffers;
  for (const auto& buffer : module.named_buffers()) {
    buffers.push_back({{buffer.key(), buffer.value()}, /*buffer=*/false, false});
  }
  if (buffers.empty()) {
    return;
  }
  check_replicas_agree(state_->world, buffers,
                       " FullyShardedDataParallel does not synchronise buffers after "
                       "construction: a plain BatchNorm's statistics are each rank's own "
                       "(use SyncBatchNorm, or check_replicas(ReplicaCheck::Parameters)).");
}

} // namespace lockstep::detail
