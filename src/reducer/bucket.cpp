#include "reducer/bucket.h"

#include <map>
#include <optional>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>

namespace lockstep::detail {

std::vector<std::vector<size_t>> plan_buckets(
    const std::vector<at::Tensor>& params,
    const std::vector<size_t>& order,
    double first_cap_mb,
    double cap_mb) {
  struct Open {
    size_t bucket;
    int64_t bytes;
    bool first;
  };
  std::vector<std::vector<size_t>> buckets;
  // Per (dtype, device): the bucket being filled, if any, and whether the
  // first bucket of that kind has been closed yet.
  std::map<std::pair<int, std::string>, std::optional<Open>> open;
  std::map<std::pair<int, std::string>, bool> had_first;
  for (size_t index : order) {
    const auto& param = params[index];
    auto kind = std::make_pair(static_cast<int>(param.scalar_type()),
                               param.device().str());
    auto& current = open[kind];
    if (!current) {
      buckets.emplace_back();
      current = Open{buckets.size() - 1, 0, !had_first[kind]};
      had_first[kind] = true;
    }
    buckets[current->bucket].push_back(index);
    current->bytes += param.numel() * static_cast<int64_t>(param.element_size());
    // A bucket closes once it reaches its cap, the parameter that reached it
    // included (PyTorch's rule): a large gradient then leaves with the
    // small ones ready before it, instead of waiting for those after it.
    double cap = (current->first ? first_cap_mb : cap_mb) * 1024 * 1024;
    if (static_cast<double>(current->bytes) >= cap) {
      current.reset();
    }
  }
  return buckets;
}

Bucket::Bucket(
    std::vector<size_t> members,
    const std::vector<at::Tensor>& params,
    bool with_extras,
    Allocate allocate,
    int shards)
    : members_(std::move(members)),
      shards_(shards),
      with_extras_(with_extras),
      allocate_(std::move(allocate)) {
  for (size_t index : members_) {
    offsets_.push_back(gradient_numel_);
    shapes_.push_back(params[index].sizes().vec());
    gradient_numel_ += params[index].numel();
  }
  const auto& first = params[members_.front()];
  options_ = first.options().requires_grad(false);
  element_size_ = static_cast<int64_t>(first.element_size());
  unpadded_numel_ = gradient_numel_ + static_cast<int64_t>(members_.size()) +
      (with_extras_ ? int64_t{kExtraCount} : int64_t{0});
  total_numel_ = shards_ == 0 ? unpadded_numel_
                              : (unpadded_numel_ + shards_ - 1) / shards_ * shards_;
  if (shards_ == 0) {
    allocate_buffer();
  }
}

void Bucket::allocate_buffer() {
  buffer_ = allocate_(total_numel_, options_);
  if (shards_ > 0) {
    // The padding is summed as it is: it must be zero.
    buffer_.narrow(0, gradient_numel_, total_numel_ - gradient_numel_).zero_();
  }
}

at::Tensor Bucket::release_buffer() {
  TORCH_INTERNAL_ASSERT(shards_ > 0, "only a sharded bucket lets go of its buffer");
  return std::exchange(buffer_, at::Tensor());
}

at::Tensor Bucket::slot(size_t k) const {
  // Below the autograd and view-tracking layers: the result aliases the
  // bucket without being a differentiable view of it.
  at::AutoDispatchBelowADInplaceOrView guard;
  int64_t numel = 1;
  for (int64_t size : shapes_[k]) {
    numel *= size;
  }
  return buffer_.narrow(0, offsets_[k], numel).view(shapes_[k]);
}

bool Bucket::holds(size_t k, const at::Tensor& grad) const {
  return grad.defined() && buffer_.defined() && !grad.is_sparse() && grad.device() == buffer_.device() &&
      grad.data_ptr() ==
      static_cast<char*>(buffer_.data_ptr()) + offsets_[k] * buffer_.element_size();
}

at::Tensor Bucket::gradients() const {
  return buffer_.narrow(0, 0, gradient_numel_);
}

at::Tensor Bucket::flags_and_extras() const {
  return buffer_.narrow(0, gradient_numel_, unpadded_numel_ - gradient_numel_);
}

int64_t Bucket::unpadded_numel() const {
  return unpadded_numel_;
}

int64_t Bucket::shard_numel() const {
  TORCH_INTERNAL_ASSERT(shards_ > 0, "the bucket is not sharded");
  return total_numel_ / shards_;
}

at::Tensor Bucket::flags() const {
  return buffer_.narrow(0, gradient_numel_, static_cast<int64_t>(members_.size()));
}

at::Tensor Bucket::extras() const {
  TORCH_INTERNAL_ASSERT(with_extras_, "only the last bucket carries extras");
  return buffer_.narrow(
      0, gradient_numel_ + static_cast<int64_t>(members_.size()), kExtraCount);
}

int64_t Bucket::bytes() const {
  return total_numel_ * element_size_;
}

} // namespace lockstep::detail
