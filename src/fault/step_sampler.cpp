#include <lockstep/step_sampler.h>

#include <numeric>

#include <lockstep/error.h>

#include "common/splitmix.h"

namespace lockstep {

StepSampler::StepSampler(int64_t dataset_size, StepSamplerOptions options)
    : dataset_size_(dataset_size), options_(options) {
  LOCKSTEP_ENFORCE(options.global_batch_size() > 0 && dataset_size >= options.global_batch_size(),
                   ConfigError, "StepSampler needs a global batch of at least one sample and "
                   "no larger than the dataset (", options.global_batch_size(), " of ",
                   dataset_size, ").");
}

int64_t StepSampler::steps_per_epoch() const {
  return dataset_size_ / options_.global_batch_size();
}

std::vector<int64_t> StepSampler::indices(int64_t step, int rank, int size) const {
  LOCKSTEP_ENFORCE(step >= 0 && size > 0 && rank >= 0 && rank < size, UsageError,
                   "StepSampler::indices(step ", step, ", rank ", rank, ", size ", size,
                   "): the step must not be negative and 0 <= rank < size.");
  int64_t batch = options_.global_batch_size();
  LOCKSTEP_ENFORCE(size <= batch, UsageError, "a global batch of ", batch,
                   " samples cannot be shared among ", size, " ranks.");
  int64_t epoch = step / steps_per_epoch();
  if (epoch != epoch_) {
    order_.resize(dataset_size_);
    std::iota(order_.begin(), order_.end(), 0);
    if (options_.shuffle()) {
      uint64_t state = options_.seed() ^ (0x5851f42d4c957f2dULL * static_cast<uint64_t>(epoch + 1));
      for (int64_t i = dataset_size_ - 1; i > 0; --i) {
        std::swap(order_[i], order_[detail::splitmix64(state) % static_cast<uint64_t>(i + 1)]);
      }
    }
    epoch_ = epoch;
  }
  int64_t first = (step % steps_per_epoch()) * batch;
  int64_t share = batch / size;
  int64_t extra = batch % size;
  int64_t begin = first + rank * share + std::min<int64_t>(rank, extra);
  int64_t count = share + (rank < extra ? 1 : 0);
  return {order_.begin() + begin, order_.begin() + begin + count};
}

} // namespace lockstep
