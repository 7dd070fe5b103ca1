// What feeds each rank its data: lockstep::DistributedSampler (PyTorch's
// DistributedSampler index for index, and an epoch that reaches the copy
// make_data_loader holds), and the StepLoader of a fault-tolerant loop.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/distributed_sampler.h>
#include <lockstep/step_loader.h>

namespace lockstep {
namespace {

using Shards = std::vector<std::vector<size_t>>;

Shards shards_of(size_t size, int ranks, DistributedSamplerOptions options, int64_t epoch) {
  Shards shards;
  for (int rank = 0; rank < ranks; ++rank) {
    DistributedSampler sampler(size, rank, ranks, options);
    sampler.set_epoch(epoch);
    sampler.reset(torch::nullopt);
    EXPECT_EQ(sampler.indices().size(), sampler.size());
    shards.push_back(sampler.indices());
  }
  return shards;
}

// What torch.utils.data.DistributedSampler gives, printed by PyTorch 1.13
// and by PyTorch 2.6 alike (list(sampler) per rank after set_epoch).
TEST(DistributedSampler, GivesPyTorchsIndices) {
  auto options = DistributedSamplerOptions();
  EXPECT_EQ(shards_of(10, 3, options, 0), (Shards{{4, 5, 0, 2}, {1, 3, 8, 4}, {7, 9, 6, 1}}));
  EXPECT_EQ(shards_of(10, 3, options, 1), (Shards{{5, 2, 9, 4}, {6, 0, 3, 5}, {1, 8, 7, 6}}));
  auto dropping = DistributedSamplerOptions().drop_last(true);
  EXPECT_EQ(shards_of(10, 3, dropping, 0), (Shards{{4, 5, 0}, {1, 3, 8}, {7, 9, 6}}));
  EXPECT_EQ(shards_of(10, 3, dropping, 1), (Shards{{5, 2, 9}, {6, 0, 3}, {1, 8, 7}}));
  auto seeded = DistributedSamplerOptions().seed(42);
  EXPECT_EQ(shards_of(7, 3, seeded, 0), (Shards{{1, 5, 2}, {6, 4, 1}, {3, 0, 6}}));
  EXPECT_EQ(shards_of(7, 3, seeded, 1), (Shards{{3, 4, 6}, {1, 5, 3}, {2, 0, 1}}));
  // Fewer samples than ranks: the order repeats.
  EXPECT_EQ(shards_of(2, 3, DistributedSamplerOptions().seed(5), 0), (Shards{{1}, {0}, {1}}));
  auto in_order = DistributedSamplerOptions().shuffle(false);
  EXPECT_EQ(shards_of(10, 4, in_order, 0), (Shards{{0, 4, 8}, {1, 5, 9}, {2, 6, 0}, {3, 7, 1}}));
}

// The program's copy and the loader's share the epoch: each pass of one
// loader takes the order of the epoch set before it.
TEST(DistributedSampler, SetEpochReachesTheLoadersCopy) {
  auto dataset = torch::data::datasets::TensorDataset(torch::arange(12).view({12, 1}))
                     .map(torch::data::transforms::Stack<torch::data::TensorExample>());
  DistributedSampler sampler(12, /*rank=*/1, /*world_size=*/2);
  auto loader = torch::data::make_data_loader(std::move(dataset), sampler,
                                              torch::data::DataLoaderOptions().batch_size(4));
  std::vector<std::vector<int64_t>> passes;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    sampler.set_epoch(epoch);
    std::vector<int64_t> seen;
    for (auto& batch : *loader) {
      for (int64_t i = 0; i < batch.data.size(0); ++i) {
        seen.push_back(batch.data[i][0].item<int64_t>());
      }
    }
    sampler.reset(torch::nullopt);
    EXPECT_EQ(seen, std::vector<int64_t>(sampler.indices().begin(), sampler.indices().end()))
        << "epoch " << epoch;
    passes.push_back(seen);
  }
  EXPECT_NE(passes[0], passes[1]);
  EXPECT_NE(passes[1], passes[2]);
}

// Each rank of any world gets its share of the step's global batch: the
// shares of one step, put together, are the StepSampler's batch for that
// step, whatever the world's size, and asking again gives the same batch
// (a dropped step is retried with it).
TEST(StepLoader, GivesEachRankItsShareOfTheStepsBatch) {
  auto dataset = torch::data::datasets::TensorDataset(torch::arange(50).view({50, 1}))
                     .map(torch::data::transforms::Stack<torch::data::TensorExample>());
  auto options = StepSamplerOptions().global_batch_size(12).seed(7);
  StepLoader loader(std::move(dataset), options);
  StepSampler sampler(50, options);
  EXPECT_EQ(loader.sampler().steps_per_epoch(), 4);
  EXPECT_EQ(loader.epoch_of(3), 0);
  EXPECT_EQ(loader.epoch_of(4), 1);
  for (int size : {1, 2, 3, 5}) {
    for (int64_t step : {0, 3, 4, 9}) {
      std::vector<int64_t> together;
      for (int rank = 0; rank < size; ++rank) {
        auto batch = loader.batch(step, rank, size).data.view(-1);
        EXPECT_TRUE(batch.equal(loader.batch(step, rank, size).data.view(-1)));
        auto expected = sampler.indices(step, rank, size);
        EXPECT_TRUE(batch.equal(torch::tensor(expected, torch::kLong)))
            << "step " << step << ", rank " << rank << " of " << size;
        together.insert(together.end(), expected.begin(), expected.end());
      }
      EXPECT_EQ(together.size(), 12u);
    }
  }
}

TEST(StepLoader, ADatasetOfUnknownSizeIsRefused) {
  struct Endless : torch::data::datasets::Dataset<Endless, torch::data::TensorExample> {
    torch::data::TensorExample get(size_t index) override {
      return torch::data::TensorExample(torch::tensor(static_cast<int64_t>(index)));
    }
    torch::optional<size_t> size() const override {
      return torch::nullopt;
    }
  };
  try {
    StepLoader<Endless> loader(Endless{});
    FAIL() << "a dataset of unknown size was taken";
  } catch (const ConfigError& error) {
    EXPECT_NE(std::string(error.what()).find("StepLoader needs a dataset of known size"),
              std::string::npos)
        << error.what();
  }
}

} // namespace
} // namespace lockstep
