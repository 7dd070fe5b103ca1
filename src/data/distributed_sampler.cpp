// PyTorch's DistributedSampler, index for index: the order is randperm
// with a generator seeded with seed + epoch, padded with its own head (or
// cut) to a multiple of the world's size, and rank r takes every N-th
// sample from r.

#include <lockstep/distributed_sampler.h>

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <lockstep/error.h>

namespace lockstep {

DistributedSampler::DistributedSampler(size_t dataset_size, const World& world,
                                       DistributedSamplerOptions options)
    : DistributedSampler(dataset_size, world.rank(), world.size(), options) {}

DistributedSampler::DistributedSampler(size_t dataset_size, int rank, int world_size,
                                       DistributedSamplerOptions options)
    : dataset_size_(dataset_size), rank_(rank), world_size_(world_size), options_(options) {
  LOCKSTEP_ENFORCE(world_size > 0 && rank >= 0 && rank < world_size, UsageError,
                   "DistributedSampler: rank ", rank, " of a world of ", world_size,
                   " does not exist.");
  reset(torch::nullopt);
}

void DistributedSampler::set_epoch(int64_t epoch) {
  shared_->epoch = epoch;
}

int64_t DistributedSampler::epoch() const {
  return shared_->epoch;
}

size_t DistributedSampler::size() const {
  auto n = dataset_size_;
  auto ranks = static_cast<size_t>(world_size_);
  if (options_.drop_last() && n % ranks != 0) {
    return n < ranks ? 0 : (n - ranks + ranks - 1) / ranks;
  }
  return (n + ranks - 1) / ranks;
}

const std::vector<size_t>& DistributedSampler::indices() const {
  return indices_;
}

void DistributedSampler::reset(torch::optional<size_t> new_size) {
  if (new_size) {
    dataset_size_ = *new_size;
  }
  std::vector<int64_t> order(dataset_size_);
  if (options_.shuffle() && dataset_size_ > 0) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(
        options_.seed() + static_cast<uint64_t>(shared_->epoch));
    auto permutation = at::randperm(static_cast<int64_t>(dataset_size_), generator, at::kLong);
    const auto* values = permutation.data_ptr<int64_t>();
    std::copy(values, values + dataset_size_, order.begin());
  } else {
    for (size_t i = 0; i < dataset_size_; ++i) {
      order[i] = static_cast<int64_t>(i);
    }
  }
  size_t total = size() * static_cast<size_t>(world_size_);
  for (size_t i = 0; order.size() < total && dataset_size_ > 0; ++i) {
    order.push_back(order[i]); // the head again, as often as it takes
  }
  order.resize(total);
  indices_.clear();
  for (size_t i = static_cast<size_t>(rank_); i < total; i += static_cast<size_t>(world_size_)) {
    indices_.push_back(static_cast<size_t>(order[i]));
  }
  position_ = 0;
}

torch::optional<std::vector<size_t>> DistributedSampler::next(size_t batch_size) {
  if (position_ >= indices_.size()) {
    return torch::nullopt;
  }
  size_t end = std::min(indices_.size(), position_ + batch_size);
  std::vector<size_t> batch(indices_.begin() + static_cast<std::ptrdiff_t>(position_),
                            indices_.begin() + static_cast<std::ptrdiff_t>(end));
  position_ = end;
  return batch;
}

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", at::tensor(shared_->epoch, at::kLong), /*is_buffer=*/true);
  archive.write("position", at::tensor(static_cast<int64_t>(position_), at::kLong),
                /*is_buffer=*/true);
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  at::Tensor epoch;
  at::Tensor position;
  archive.read("epoch", epoch, /*is_buffer=*/true);
  archive.read("position", position, /*is_buffer=*/true);
  shared_->epoch = epoch.item<int64_t>();
  reset(torch::nullopt);
  position_ = std::min(indices_.size(), static_cast<size_t>(position.item<int64_t>()));
}

} // namespace lockstep
