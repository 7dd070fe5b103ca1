#pragma once

// A fault-tolerant job's data loader: the batches of a StepSampler taken
// from a LibTorch dataset, so that the loop asks for "this step's batch"
// and nothing else:
//
//   auto train = torch::data::datasets::MNIST(path)
//                    .map(torch::data::transforms::Stack<>());
//   lockstep::StepLoader loader(std::move(train),
//                               lockstep::StepSamplerOptions().global_batch_size(96));
//   while (ft.step() < steps) {
//     ft.begin_step();
//     auto batch = loader.batch(ft);   // this rank's share, in this world
//     ...
//   }
//
// A step that is dropped is retried with the same batch; a world that
// shrinks or grows divides the same global batch among its ranks.

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include <lockstep/error.h>
#include <lockstep/fault_tolerance.h>
#include <lockstep/step_sampler.h>

namespace lockstep {

/// `Dataset` is a LibTorch dataset whose get_batch takes indices (a
/// dataset mapped through `transforms::Stack<>` gives one tensor batch).
template <typename Dataset>
class StepLoader {
  static_assert(
      std::is_constructible_v<typename Dataset::BatchRequestType, std::vector<size_t>>,
      "StepLoader needs a dataset whose get_batch takes a list of indices "
      "(a stateful dataset chooses its own samples)");

 public:
  using BatchType = typename Dataset::BatchType;

  StepLoader(Dataset dataset, StepSamplerOptions options = {})
      : dataset_(std::move(dataset)), sampler_(size_of(dataset_), options) {}

  /// The share of global batch `step` that rank `rank` of `size` takes.
  BatchType batch(int64_t step, int rank, int size) {
    auto indices = sampler_.indices(step, rank, size);
    return dataset_.get_batch(std::vector<size_t>(indices.begin(), indices.end()));
  }
  /// This rank's share of the batch of ft's current step, in ft's current
  /// world: call it after begin_step().
  BatchType batch(const FaultTolerance& ft) {
    return batch(ft.step(), ft.world().rank(), ft.world().size());
  }
  /// Which epoch step `step` belongs to.
  int64_t epoch_of(int64_t step) const {
    return step / sampler_.steps_per_epoch();
  }
  /// Not to be called from another thread while the loop takes batches
  /// (the sampler keeps the current epoch's order).
  const StepSampler& sampler() const {
    return sampler_;
  }
  Dataset& dataset() {
    return dataset_;
  }

 private:
  static int64_t size_of(const Dataset& dataset) {
    auto size = dataset.size();
    LOCKSTEP_ENFORCE(size.has_value(), ConfigError,
                     "StepLoader needs a dataset of known size: a StepSampler draws each "
                     "epoch's order from the number of samples");
    return static_cast<int64_t>(*size);
  }

  Dataset dataset_;
  StepSampler sampler_;
};

} // namespace lockstep
