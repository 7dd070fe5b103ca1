#include "fsdp/flat_unit.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <lockstep/error.h>
#include <lockstep/sharded_collectives.h>

#include "fsdp/constructed_shard.h"
#include "world/epoch_world.h"

namespace lockstep::detail {
namespace {

size_t bytes_of(const at::Tensor& tensor) {
  return static_cast<size_t>(tensor.numel()) * tensor.element_size();
}

// The tensor keeps its storage object, which views of it share; only the
// memory behind it, a block of `block` bytes, goes (to the pool).
void release_memory(const at::Tensor& tensor, size_t block, BufferPool& pool) {
  auto* storage = tensor.storage().unsafeGetStorageImpl();
  pool.give(storage->set_data_ptr(at::DataPtr(nullptr, tensor.device())), block);
  storage->set_nbytes(0);
}

// A block of the pool behind `tensor`, of the size returned: maybe larger
// than the tensor, whose storage says the tensor's own size (what a save
// writes).
size_t reserve_memory(const at::Tensor& tensor, BufferPool& pool) {
  auto* storage = tensor.storage().unsafeGetStorageImpl();
  auto block = pool.take(bytes_of(tensor), tensor.device(), *storage->allocator());
  storage->set_data_ptr_noswap(std::move(block.data));
  storage->set_nbytes(bytes_of(tensor));
  return block.bytes;
}

// A flat slice of `tensor` that aliases it without being a differentiable
// view: it can be a leaf of its own, which an optimizer steps in place.
at::Tensor alias_of(const at::Tensor& tensor, int64_t offset, int64_t numel) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return tensor.narrow(0, offset, numel);
}

} // namespace

std::string FlatUnit::describe(const std::string& name) {
  return name.empty() ? std::string("the root unit") : str("unit ", name);
}

void FlatUnit::check(const std::string& name,
                     const std::vector<std::pair<std::string, at::Tensor>>& params) {
  const auto& [first_name, first] = params.front();
  for (const auto& [param_name, param] : params) {
    LOCKSTEP_ENFORCE(param.scalar_type() == first.scalar_type() &&
                         param.device() == first.device(),
                     ConfigError, "FullyShardedDataParallel: the parameters of one unit must "
                     "share a dtype and a device, and ", describe(name), " holds ", first_name,
                     " (", first.scalar_type(), " on ", first.device(), ") and ", param_name,
                     " (", param.scalar_type(), " on ", param.device(),
                     "). Make the block with another dtype a unit of its own "
                     "(lockstep::Sharded).");
    LOCKSTEP_ENFORCE(param.layout() == at::kStrided, ConfigError,
                     "FullyShardedDataParallel shards dense parameters only, and ",
                     param_name, " is ", param.layout(), ".");
  }
}

void FlatUnit::lay_out(std::vector<std::pair<std::string, at::Tensor>> params,
                       const std::vector<std::vector<int64_t>>& shapes) {
  TORCH_INTERNAL_ASSERT(!params.empty() && shapes.size() == params.size());
  check(name_, params);
  int64_t total = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    Member member;
    member.name = std::move(params[k].first);
    member.param = std::move(params[k].second);
    member.shape = shapes[k];
    member.offset = total;
    member.numel = c10::multiply_integers(member.shape);
    total += member.numel;
    members_.push_back(std::move(member));
  }
  per_rank_ = std::max<int64_t>(1, (total + ranks_ - 1) / ranks_);
}

FlatUnit::FlatUnit(std::string name,
                   std::vector<std::pair<std::string, at::Tensor>> params,
                   World& world, World& from, std::optional<at::ScalarType> compute)
    : name_(std::move(name)), rank_(world.rank()), ranks_(world.size()) {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& [param_name, param] : params) {
    shapes.push_back(param.sizes().vec());
  }
  lay_out(std::move(params), shapes);
  full_ = at::zeros({per_rank_ * ranks_},
                    members_.front().param.options().requires_grad(false));
  {
    at::NoGradGuard no_grad;
    for (const auto& member : members_) {
      full_.narrow(0, member.offset, member.numel).copy_(member.param.reshape({-1}));
    }
  }
  from.broadcast(full_, 0, str("the parameters of ", describe(), " from rank 0"));
  shard_ = full_.narrow(0, rank_ * per_rank_, per_rank_).clone();
  take_shard(compute);
}

FlatUnit::FlatUnit(std::string name,
                   std::vector<std::pair<std::string, at::Tensor>> params,
                   ConstructedShard& built, std::optional<at::ScalarType> compute)
    : name_(std::move(name)), rank_(built.rank), ranks_(built.ranks) {
  lay_out(std::move(params), built.shapes);
  TORCH_INTERNAL_ASSERT(built.shard.numel() == per_rank_, "a shard of another layout");
  full_ = at::empty({per_rank_ * ranks_}, built.shard.options());
  shard_ = built.shard;
  take_shard(compute);
}

void FlatUnit::take_shard(std::optional<at::ScalarType> compute) {
  const auto options = shard_.options().requires_grad(false);
  int64_t mine_first = rank_ * per_rank_;
  int64_t mine_last = mine_first + per_rank_;
  for (auto& member : members_) {
    int64_t first_element = std::max(member.offset, mine_first);
    int64_t last_element = std::min(member.offset + member.numel, mine_last);
    if (last_element > first_element) {
      member.piece = alias_of(shard_, first_element - mine_first, last_element - first_element);
      member.piece.set_requires_grad(member.param.requires_grad());
      member.piece_offset = first_element;
    }
  }
  placeholder_ = at::empty({0}, options);
  BufferPool none(0);
  if (compute && *compute != shard_.scalar_type()) {
    compute_ = compute;
    full_low_ = at::empty({per_rank_ * ranks_}, options.dtype(*compute));
    release_memory(full_low_, bytes_of(full_low_), none);
    shard_low_ = at::empty({per_rank_}, options.dtype(*compute));
    placeholder_ = at::empty({0}, options.dtype(*compute));
  }
  // The gradients come in the dtype the unit computes in.
  grad_full_ = at::empty({per_rank_ * ranks_}, options.dtype(compute_.value_or(shard_.scalar_type())));
  release_memory(grad_full_, bytes_of(grad_full_), none);
  had_gradient_.assign(members_.size(), 0);
  // Made now rather than at the first reduction: a long-lived block made
  // between the backward's short-lived ones (autograd's gradients) would
  // pin the heap above them, and glibc could not give their memory back
  // (60 to 260 MiB more at the peak of a partly frozen model).
  if (any_trainable()) {
    shard_grad_ = at::empty({per_rank_}, shard_.options());
  }
  gathered_ = true;
  full_block_ = bytes_of(full_);
  free(none);
}

std::string FlatUnit::describe() const {
  return describe(name_);
}

bool FlatUnit::any_trainable() const {
  for (const auto& member : members_) {
    if (member.param.requires_grad()) {
      return true;
    }
  }
  return false;
}

bool FlatUnit::holds(const at::Tensor& tensor) const {
  if (!tensor.defined() || !tensor.has_storage()) {
    return false;
  }
  const auto* storage = tensor.storage().unsafeGetStorageImpl();
  return storage == full_.storage().unsafeGetStorageImpl() ||
      (full_low_.defined() && storage == full_low_.storage().unsafeGetStorageImpl());
}

void FlatUnit::gather(World& world, BufferPool& pool, bool full_precision) {
  bool low = compute_.has_value() && !full_precision;
  finish_gather();
  if (gathered_ && gathered_low_ == low) {
    return;
  }
  free(pool); // gathered in the other precision
  start_gather(world, pool, full_precision);
  finish_gather();
}

void FlatUnit::prefetch(World& world, BufferPool& pool) {
  start_gather(world, pool, /*full_precision=*/false);
}

void FlatUnit::start_gather(World& world, BufferPool& pool, bool full_precision) {
  if (gathered_ || arriving_) {
    return;
  }
  bool low = compute_.has_value() && !full_precision;
  auto& full = full_of(low);
  block_of(low) = reserve_memory(full, pool);
  if (low) {
    at::NoGradGuard no_grad;
    shard_low_.copy_(shard_); // cast once, then gathered in half the bytes
  }
  arriving_.emplace(WorldAccess::all_gather_into_async(world, full, low ? shard_low_ : shard_,
                                                       str("gather of ", describe())));
  arriving_low_ = low;
}

void FlatUnit::finish_gather() {
  if (!arriving_) {
    return;
  }
  // Waited for once, whether it completes or raises.
  auto arriving = std::move(*arriving_);
  arriving_.reset();
  gathered_low_ = arriving_low_;
  gathered_ = true; // so that free() gives the memory back if the wait raises
  arriving.wait();
  at::NoGradGuard no_grad;
  auto& full = full_of(gathered_low_);
  for (auto& member : members_) {
    member.param.set_data(full.narrow(0, member.offset, member.numel).view(member.shape));
  }
}

void FlatUnit::write_back() {
  if (!gathered_ || gathered_low_) {
    return; // what a load may write is in the full-precision parameters only
  }
  at::NoGradGuard no_grad;
  for (auto& member : members_) {
    // A load that gave the parameter memory of its own (set_) rather than
    // copying into it.
    auto slot = full_.narrow(0, member.offset, member.numel);
    if (member.param.data_ptr() != slot.data_ptr()) {
      slot.copy_(member.param.reshape({-1}));
      member.param.set_data(slot.view(member.shape));
    }
  }
  shard_.copy_(full_.narrow(0, rank_ * per_rank_, per_rank_));
}

void FlatUnit::free(BufferPool& pool) {
  // A gather in flight writes into the memory: it completes first.
  finish_gather();
  if (!gathered_) {
    return;
  }
  for (auto& member : members_) {
    member.param.set_data(placeholder_);
  }
  release_memory(full_of(gathered_low_), block_of(gathered_low_), pool);
  gathered_ = false;
}

void FlatUnit::attach_gradients(BufferPool& pool) {
  if (gradients_attached_ || !any_trainable()) {
    return;
  }
  grad_block_ = reserve_memory(grad_full_, pool);
  grad_full_.zero_();
  at::NoGradGuard no_grad;
  for (auto& member : members_) {
    if (!member.param.requires_grad()) {
      continue;
    }
    auto slot = alias_of(grad_full_, member.offset, member.numel).view(member.shape);
    auto& grad = member.param.mutable_grad();
    if (grad.defined()) {
      slot.copy_(grad); // from an earlier backward of this step
    }
    grad = slot;
  }
  gradients_attached_ = true;
}

void FlatUnit::drop_gradients(BufferPool& pool) {
  if (!gradients_attached_) {
    return;
  }
  for (auto& member : members_) {
    member.param.mutable_grad().reset();
  }
  release_memory(grad_full_, grad_block_, pool);
  gradients_attached_ = false;
}

void FlatUnit::reduce_gradients(World& world, BufferPool& pool,
                                std::optional<at::ScalarType> wire, World* replicas) {
  // The same on every rank: whether a unit holds a trainable parameter
  // depends on the model alone. One without has nothing to reduce.
  if (!any_trainable()) {
    return;
  }
  for (const auto& member : members_) {
    LOCKSTEP_ENFORCE(!member.param.grad().defined() || !member.param.grad().is_sparse(),
                     UsageError, "FullyShardedDataParallel: ", member.name, " has a sparse "
                     "gradient; sharded parameters take dense ones (build the embedding "
                     "without sparse(true)).");
  }
  // Where no hook attached them (the unit's outputs took no part in this
  // backward, or were not tensors): the gradients that autograd made, if
  // any, end to end in a block of the pool.
  attach_gradients(pool);
  const auto& flat = grad_full_;
  for (auto& member : members_) {
    const auto& grad = member.param.grad();
    if (!grad.defined()) {
      continue;
    }
    auto slot = flat.narrow(0, member.offset, member.numel);
    if (grad.data_ptr() != slot.data_ptr()) {
      slot.copy_(grad.reshape({-1}));
    }
    member.param.mutable_grad().reset();
  }
  scatter_into_pieces(world, flat, wire, replicas);
  release_memory(grad_full_, grad_block_, pool);
  gradients_attached_ = false;
}

void FlatUnit::scatter_into_pieces(World& world, const at::Tensor& flat,
                                   std::optional<at::ScalarType> wire, World* replicas) {
  int64_t mine_first = rank_ * per_rank_;
  // This rank's slice of the average of the groups' averages (one group:
  // of `flat` over the ranks); in `wire`'s dtype on the way where one is
  // asked for.
  auto across_groups = [&](at::Tensor& slice) {
    if (replicas != nullptr) {
      replicas->all_reduce_async(slice, ReduceOp::Average,
                                 str("all-reduce of ", describe(), "'s gradient shard across "
                                     "the replicas"))
          .wait();
    }
  };
  auto average_into = [&](at::Tensor& out) {
    auto what = str("reduce-scatter of ", describe(), "'s gradients");
    if ((!wire || *wire == flat.scalar_type()) && out.scalar_type() == flat.scalar_type()) {
      reduce_scatter(world, out, flat, ReduceOp::Average, what);
      across_groups(out);
      return;
    }
    auto sent = flat.to(wire.value_or(flat.scalar_type()));
    auto received = at::empty({per_rank_}, sent.options());
    reduce_scatter(world, received, sent, ReduceOp::Average, what);
    across_groups(received);
    out.copy_(received);
  };
  auto piece_of = [&](const at::Tensor& slice, const Member& member) {
    return alias_of(slice, member.piece_offset - mine_first, member.piece.numel());
  };
  bool none_yet = true;
  for (size_t k = 0; k < members_.size(); ++k) {
    const auto& piece = members_[k].piece;
    had_gradient_[k] = piece.defined() && piece.grad().defined() ? 1 : 0;
    none_yet = none_yet && had_gradient_[k] == 0;
  }
  // The first backward of a step (an optimizer that sets gradients to
  // None): the averages land in the shard's gradients themselves.
  if (none_yet) {
    if (!shard_grad_.defined()) { // a unit unfrozen since it was made
      shard_grad_ = at::empty({per_rank_}, shard_.options());
    }
    average_into(shard_grad_);
    for (auto& member : members_) {
      if (member.piece.defined() && member.param.requires_grad()) {
        member.piece.mutable_grad() = piece_of(shard_grad_, member);
      }
    }
    return;
  }
  auto mine = at::empty({per_rank_}, shard_.options());
  average_into(mine);
  for (auto& member : members_) {
    if (!member.piece.defined() || !member.param.requires_grad()) {
      continue;
    }
    auto& grad = member.piece.mutable_grad();
    if (grad.defined()) {
      grad.add_(piece_of(mine, member));
    } else {
      grad = piece_of(mine, member).clone();
    }
  }
}

} // namespace lockstep::detail
