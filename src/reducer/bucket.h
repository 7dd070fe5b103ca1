#pragma once

// A bucket: one flat tensor holding the gradients of several parameters of
// one dtype and device, followed by one "used" flag per parameter (and, in
// the last bucket, the iteration's extras). The flags and extras ride in the
// same all-reduce as the gradients: knowing which parameters were used
// anywhere, or whether any rank broke a rule, costs no extra collective.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace lockstep::detail {

/// Groups the parameters, taken in `order`, into buckets of one dtype and
/// device each. A bucket closes as soon as it holds at least its cap:
/// `first_cap_mb` MiB for the first of each kind, `cap_mb` for the others
/// (a cap of 0 puts each parameter alone). Buckets come out in the order of
/// their first parameter.
std::vector<std::vector<size_t>> plan_buckets(
    const std::vector<at::Tensor>& params,
    const std::vector<size_t>& order,
    double first_cap_mb,
    double cap_mb);

/// Values carried after the flags of the last bucket.
enum Extra : int64_t {
  kProblems = 0, // ranks that found a problem this iteration
  kTrainableChanged = 1, // ranks where a parameter began to require grad
  kExtraCount = 2,
};

class Bucket {
 public:
  /// Makes the zero-filled flat tensor a bucket all-reduces: World::allocate
  /// for CPU tensors, so that the transport may keep it where it moves it
  /// fastest.
  using Allocate = std::function<at::Tensor(int64_t numel, const at::TensorOptions& options)>;

  /// `shards` 0: the buffer is made now and kept. N (DdpOptions::
  /// shard_gradients): zeros after the extras pad it to a multiple of N, so
  /// that a reduce-scatter leaves each of N ranks an equal slice, and the
  /// buffer exists only from allocate_buffer() to release_buffer(): a rank
  /// holds whole buckets only while they travel.
  Bucket(std::vector<size_t> members,
         const std::vector<at::Tensor>& params,
         bool with_extras,
         Allocate allocate,
         int shards = 0);

  const std::vector<size_t>& members() const {
    return members_;
  }
  /// The gradient slot of the k-th member, shaped like its parameter. A
  /// plain alias without autograd view tracking, so that it can serve as
  /// .grad and survive detach_() in Optimizer::zero_grad().
  at::Tensor slot(size_t k) const;
  /// Whether `grad` is the k-th member's slot (a gradient kept as a view).
  bool holds(size_t k, const at::Tensor& grad) const;
  /// All gradient slots together.
  at::Tensor gradients() const;
  /// The flags and, in the last bucket, the extras: what stays exact.
  at::Tensor flags_and_extras() const;
  /// Elements before the padding: what an unsharded bucket holds.
  int64_t unpadded_numel() const;
  /// Elements of buffer() each shard holds.
  int64_t shard_numel() const;
  bool allocated() const {
    return buffer_.defined();
  }
  /// Sharded: the allocator may hand back used memory, so the flags,
  /// extras and padding are zeroed here; every gradient slot is then
  /// written, by its gradient or with zeros.
  void allocate_buffer();
  /// Returns the buffer, for the next bucket to reuse.
  at::Tensor release_buffer();
  at::Tensor flags() const;
  at::Tensor extras() const;
  /// Everything that is all-reduced.
  const at::Tensor& buffer() const {
    return buffer_;
  }
  int64_t bytes() const;

 private:
  std::vector<size_t> members_;
  std::vector<int64_t> offsets_;
  std::vector<std::vector<int64_t>> shapes_;
  int64_t gradient_numel_ = 0;
  int64_t unpadded_numel_ = 0;
  int64_t total_numel_ = 0;
  int64_t element_size_ = 0;
  int shards_ = 0;
  bool with_extras_ = false;
  at::TensorOptions options_;
  Allocate allocate_;
  at::Tensor buffer_;
};

} // namespace lockstep::detail
