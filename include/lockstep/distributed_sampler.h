#pragma once

// Which samples each rank trains on in an epoch: PyTorch's
// torch.utils.data.DistributedSampler, the same indices for the same seed
// and epoch, as a LibTorch sampler whose epoch the program can still set
// once make_data_loader holds it:
//
//   lockstep::DistributedSampler sampler(dataset.size().value(), world);
//   auto loader = torch::data::make_data_loader(dataset, sampler, batch_options);
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);                 // reaches the loader's copy
//     for (auto& batch : *loader) { ... }
//   }
//
// LibTorch's own DistributedRandomSampler is moved into the loader, where
// set_epoch cannot reach it, so every epoch repeats one order unless the
// program builds a loader per epoch. A fault-tolerant job, whose world
// changes size, takes its batches from a StepSampler instead.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <torch/arg.h>
#include <torch/data/samplers/base.h>

#include <lockstep/world.h>

namespace lockstep {

struct DistributedSamplerOptions {
  /// A new order each epoch, drawn from seed + epoch (PyTorch's
  /// randperm with that seed); false: the dataset's own order.
  TORCH_ARG(bool, shuffle) = true;
  /// The same on every rank.
  TORCH_ARG(uint64_t, seed) = 0;
  /// False: the order is padded with its own first samples until every
  /// rank has as many (so that no rank runs out before the others). True:
  /// the samples that do not divide evenly are left out.
  TORCH_ARG(bool, drop_last) = false;
};

class DistributedSampler : public torch::data::samplers::Sampler<> {
 public:
  /// Rank `world.rank()` of `world.size()`.
  DistributedSampler(size_t dataset_size, const World& world,
                     DistributedSamplerOptions options = {});
  DistributedSampler(size_t dataset_size, int rank, int world_size,
                     DistributedSamplerOptions options = {});

  /// The epoch whose order the next reset (the loader's, at the start of
  /// each pass) draws; every copy of this sampler shares it.
  void set_epoch(int64_t epoch);
  int64_t epoch() const;
  /// Samples this rank takes per epoch (PyTorch's len(sampler)).
  size_t size() const;
  /// This rank's samples of the current epoch, in order.
  const std::vector<size_t>& indices() const;

  void reset(torch::optional<size_t> new_size = torch::nullopt) override;
  torch::optional<std::vector<size_t>> next(size_t batch_size) override;
  /// The epoch and the position in it.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  struct Shared {
    int64_t epoch = 0;
  };
  size_t dataset_size_;
  int rank_;
  int world_size_;
  DistributedSamplerOptions options_;
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  std::vector<size_t> indices_;
  size_t position_ = 0;
};

} // namespace lockstep
