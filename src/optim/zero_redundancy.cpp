// ZeroRedundancyOptimizer's shard: who owns what, the shard's step, the
// parameters brought back from their owners, and the state put together
// (consolidated, or from shards) for checkpoints. A shard is a list of
// pieces: whole parameters, or (ZeroPartition::Elements) flat slices of them,
// which the local optimizer steps as tensors of their own sharing the
// parameter's memory.

#include <lockstep/zero_redundancy_optimizer.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <lockstep/step_in_backward.h>

#include "common/wording.h"
#include "optim/optimizer_bytes.h"
#include "optim/parameter_state.h"
#include "optim/zero_partition.h"
#include "world/broadcast_bytes.h"

namespace lockstep::detail {
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

// Tensors, groups, and a hash of their sizes: what every rank must agree on.
std::vector<int64_t> summary_of(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                const torch::optim::OptimizerParamGroup* adding) {
  uint64_t hash = 1469598103934665603ull;
  auto mix = [&hash](uint64_t value) { hash = (hash ^ value) * 1099511628211ull; };
  int64_t tensors = 0;
  int64_t count = 0;
  auto add = [&](const std::vector<at::Tensor>& params) {
    ++count;
    mix(params.size());
    for (const auto& param : params) {
      ++tensors;
      mix(static_cast<uint64_t>(param.numel()));
    }
  };
  for (const auto& group : groups) {
    add(group.params());
  }
  if (adding != nullptr) {
    add(adding->params());
  }
  return {tensors, count, static_cast<int64_t>(hash)};
}

// Collective: every rank must hold the same parameters in the same groups
// (with `adding`, when given), or the owners disagree and each broadcast
// pairs different tensors. Raises on every rank.
void check_same_parameters(World& world,
                           const std::vector<torch::optim::OptimizerParamGroup>& groups,
                           const torch::optim::OptimizerParamGroup* adding) {
  // A fixed-size summary on every rank, so that ranks holding different
  // counts still exchange the same bytes, and every rank hears of it.
  auto all = world.all_gather(at::tensor(summary_of(groups, adding), at::kLong));
  std::vector<int> differ;
  for (int rank = 1; rank < world.size(); ++rank) {
    if (!all[rank].equal(all[0])) {
      differ.push_back(rank);
    }
  }
  if (differ.empty()) {
    return;
  }
  const auto& other = all[differ[0]];
  LOCKSTEP_FAIL(UsageError, "rank ", world.rank(), ": the ZeroRedundancyOptimizer of ",
                differ.size() == 1 ? "rank " : "ranks ", rank_list(differ), " holds other "
                "parameters than rank 0's (rank 0: ", all[0][0].item<int64_t>(), " tensors in ",
                all[0][1].item<int64_t>(), " groups; rank ", differ[0], ": ",
                other[0].item<int64_t>(), " in ", other[1].item<int64_t>(), ", or the same "
                "counts in other sizes): every rank must build it over the same parameters, "
                "in the same groups and order, and add the same groups.");
}

// Raises UsageError for a parameter of `params` given twice, or already held
// (in `held`); the same on every rank, so that no rank skips a collective.
void refuse_parameters_held(
    const std::vector<at::Tensor>& params,
    const std::unordered_map<const c10::TensorImpl*, std::vector<size_t>>& held) {
  // torch::optim finds a parameter given twice only once it has state, and
  // this optimizer's state lives in the shard: it would step twice, or come
  // from two owners.
  for (size_t i = 0; i < params.size(); ++i) {
    const auto* impl = params[i].unsafeGetTensorImpl();
    bool again = held.count(impl) > 0;
    for (size_t j = 0; j < i && !again; ++j) {
      again = params[j].unsafeGetTensorImpl() == impl;
    }
    LOCKSTEP_ENFORCE(!again, UsageError, "a parameter of shape ", params[i].sizes(),
                     " appears twice in this ZeroRedundancyOptimizer's groups: give each "
                     "parameter to one group, once.");
  }
}

} // namespace

ShardedOptimizer::ShardedOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                                   World world, MakeOptimizer make,
                                   std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                                   ZeroOptions options)
    : Optimizer(std::move(groups), std::move(defaults)),
      world_(std::move(world)),
      make_(std::move(make)),
      options_(options),
      owned_(world_.size(), 0) {
  // First, while no rank has had a reason to raise alone: every rank must
  // hold the same parameters, or the others would wait for it.
  check_same_parameters_as_rank_zero();
  LOCKSTEP_ENFORCE(summary_of(param_groups(), nullptr)[0] > 0, UsageError, "ZeroRedundancyOptimizer got an "
                   "empty parameter list: give it the parameters it shards (for example "
                   "model->parameters()).");
  for (size_t g = 0; g < param_groups().size(); ++g) {
    refuse_parameters_held(param_groups()[g].params(), pieces_of_);
    take_group(g);
  }
  local_ = make_(groups_of(shard_, mine_pieces()));
}

void ShardedOptimizer::add_param_group(const torch::optim::OptimizerParamGroup& group) {
  LOCKSTEP_ENFORCE(!by_buckets(), UsageError, "this ZeroRedundancyOptimizer is laid over "
                   "the buckets of DdpOptions::shard_gradients, which hold the module's "
                   "parameters only: add_param_group cannot add to them. Give it every group "
                   "when it is built.");
  check_same_parameters(world_, param_groups(), &group);
  refuse_parameters_held(group.params(), pieces_of_);
  Optimizer::add_param_group(group);
  size_t g = param_groups().size() - 1;
  size_t first_mine = shard_.size();
  take_group(g);
  std::vector<at::Tensor> added(shard_.begin() + static_cast<std::ptrdiff_t>(first_mine),
                                shard_.end());
  local_->add_param_group(
      torch::optim::OptimizerParamGroup(std::move(added), param_groups()[g].options().clone()));
}

void ShardedOptimizer::take_group(size_t g) {
  const auto& params = param_groups()[g].params();
  size_t first = all_.size();
  size_t first_piece = pieces_.size();
  all_.insert(all_.end(), params.begin(), params.end());
  partition_group(numels_of(params), first, g, options_.partition(), owned_, pieces_);
  for (size_t p = first_piece; p < pieces_.size(); ++p) {
    add_piece(p);
  }
}

void ShardedOptimizer::add_piece(size_t p) {
  const auto& piece = pieces_[p];
  const auto& param = all_[piece.param];
  LOCKSTEP_ENFORCE(piece.length == param.numel() || param.is_contiguous(), UsageError,
                   "ZeroPartition::Elements splits a parameter of shape ", param.sizes(),
                   " that is not contiguous; make it contiguous or partition by "
                   "parameters.");
  pieces_of_[param.unsafeGetTensorImpl()].push_back(p);
  piece_what_.push_back(str(
      "parameter ", param.sizes(),
      piece.length < param.numel()
          ? str(" (elements ", piece.offset, " to ", piece.offset + piece.length, ")")
          : std::string(),
      " from rank ", piece.owner, ", its owner in the ZeroRedundancyOptimizer"));
  if (piece.owner == world_.rank()) {
    mine_.push_back(p);
    shard_.push_back(piece_tensor(piece));
  }
}

void ShardedOptimizer::check_same_parameters_as_rank_zero() {
  check_same_parameters(world_, param_groups(), nullptr);
}

std::vector<ZeroPiece> ShardedOptimizer::mine_pieces() const {
  std::vector<ZeroPiece> mine;
  for (size_t p : mine_) {
    mine.push_back(pieces_[p]);
  }
  return mine;
}

std::vector<ZeroPiece> ShardedOptimizer::whole_pieces() const {
  // From the groups, not the pieces: a parameter of no elements has none.
  std::vector<ZeroPiece> whole;
  for (size_t g = 0; g < param_groups().size(); ++g) {
    for (const auto& param : param_groups()[g].params()) {
      whole.push_back({whole.size(), 0, param.numel(), 0, g});
    }
  }
  return whole;
}

std::vector<torch::optim::OptimizerParamGroup> ShardedOptimizer::groups_of(
    const std::vector<at::Tensor>& tensors, const std::vector<ZeroPiece>& pieces) const {
  TORCH_INTERNAL_ASSERT(tensors.size() == pieces.size());
  std::vector<std::vector<at::Tensor>> members(param_groups().size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    members[pieces[i].group].push_back(tensors[i]);
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (size_t g = 0; g < members.size(); ++g) {
    groups.emplace_back(std::move(members[g]), param_groups()[g].options().clone());
  }
  return groups;
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
  if (by_buckets()) {
    return; // the pieces' gradients are the buckets' slices (take_average)
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
  auto& groups = target.param_groups();
  TORCH_INTERNAL_ASSERT(groups.size() == param_groups().size());
  for (size_t g = 0; g < groups.size(); ++g) {
    groups[g].set_options(param_groups()[g].options().clone());
  }
}

void ShardedOptimizer::take_options_from(const torch::optim::Optimizer& source) {
  const auto& groups = source.param_groups();
  TORCH_INTERNAL_ASSERT(groups.size() == param_groups().size());
  for (size_t g = 0; g < groups.size(); ++g) {
    param_groups()[g].set_options(groups[g].options().clone());
  }
}

at::Tensor ShardedOptimizer::step(LossClosure closure) {
  LOCKSTEP_ENFORCE(!in_backward_, UsageError, "rank ", world_.rank(), ": this "
                   "ZeroRedundancyOptimizer already steps inside backward "
                   "(ddp.step_in_backward(optimizer)); calling step() as well would step "
                   "every shard twice with the same gradients. Remove the call to step().");
  at::Tensor loss;
  if (closure != nullptr) {
    // Here rather than in the local optimizer's step, so that a rank whose
    // shard is empty computes its gradients too.
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  copy_options_to(*local_);
  point_piece_gradients();
  has_state_ = true;
  local_->step();
  if (by_buckets()) {
    discard_gradients(); // stepped: they were views of the reducer's slices
    gather_buckets(all_parameters());
  } else {
    broadcast_from_owners(all_parameters());
  }
  return loss;
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
  has_state_ = true;
  if (!mine.empty()) {
    point_piece_gradients();
    lockstep::step_parameters(*local_, mine);
    for (auto& piece : mine) {
      piece.mutable_grad().reset(); // a view of the gradient the reducer frees
    }
  }
  if (by_buckets()) {
    unstepped_ = false;
    gather_buckets(params);
  } else {
    broadcast_from_owners(params);
  }
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
  // written rarely. With the options as they are now (a scheduler may have
  // set them since the last step).
  copy_options_to(*local_);
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
    const std::vector<std::string>& shards, const std::vector<ZeroPiece>& pieces) {
  const auto& all = all_parameters();
  int world_size = static_cast<int>(shards.size());
  // Each piece's state, as the rank that owned it saved it.
  std::vector<ParamState> states(pieces.size());
  std::unique_ptr<torch::optim::Optimizer> first_part;
  for (int rank = 0; rank < world_size; ++rank) {
    std::vector<ZeroPiece> owned_pieces;
    std::vector<size_t> owned;
    std::vector<at::Tensor> tensors;
    for (size_t p = 0; p < pieces.size(); ++p) {
      if (pieces[p].owner == rank) {
        owned.push_back(p);
        owned_pieces.push_back(pieces[p]);
        tensors.push_back(piece_tensor(pieces[p]));
      }
    }
    auto part = make_(groups_of(tensors, owned_pieces));
    load_optimizer_bytes(*part, shards[rank]);
    for (size_t i = 0; i < owned.size(); ++i) {
      states[owned[i]] = take_state(*part, tensors[i]);
    }
    if (rank == 0) {
      first_part = std::move(part); // its groups' options: every rank saved the same
    }
  }
  auto full = make_(groups_of(all, whole_pieces()));
  for (size_t g = 0; g < full->param_groups().size(); ++g) {
    full->param_groups()[g].set_options(first_part->param_groups()[g].options().clone());
  }
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
    consolidated_ = assemble(shards, pieces_);
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
    std::vector<std::vector<int64_t>> numels;
    for (const auto& group : param_groups()) {
      numels.push_back(numels_of(group.params()));
    }
    full = assemble(shards, partition_parameter_groups(
                                numels, static_cast<int>(count.toInt()),
                                static_cast<ZeroPartition>(partition.toInt())));
  } else {
    full = make_(groups_of(all_parameters(), whole_pieces()));
    load_optimizer(*full, archive);
  }
  take_shard_from(*full);
  has_state_ = true;
}

void ShardedOptimizer::take_shard_from(torch::optim::Optimizer& full) {
  take_options_from(full); // the options saved (a scheduler's learning rate)
  local_ = make_(groups_of(shard_, mine_pieces()));
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
}

} // namespace lockstep::detail
