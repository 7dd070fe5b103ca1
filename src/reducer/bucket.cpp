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
    const Allocate& allocate)
    : members_(std::move(members)), with_extras_(with_extras) {
  for (size_t index : members_) {
    offsets_.push_back(gradient_numel_);
    shapes_.push_back(params[index].sizes().vec());
    gradient_numel_ += params[index].numel();
  }
  const auto& first = params[members_.front()];
  int64_t total = gradient_numel_ + static_cast<int64_t>(members_.size()) +
      (with_extras_ ? int64_t{kExtraCount} : int64_t{0});
  buffer_ = allocate(total, first.options().requires_grad(false));
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
  return grad.defined() && !grad.is_sparse() && grad.device() == buffer_.device() &&
      grad.data_ptr() ==
      static_cast<char*>(buffer_.data_ptr()) + offsets_[k] * buffer_.element_size();
}

at::Tensor Bucket::gradients() const {
  return buffer_.narrow(0, 0, gradient_numel_);
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
  return buffer_.numel() * static_cast<int64_t>(buffer_.element_size());
}

} // namespace lockstep::detail
