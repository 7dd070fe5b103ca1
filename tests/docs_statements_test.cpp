// Statements of the docs about LibTorch's or lockstep's behaviour that no
// other test checks, each checked here where it is cheap to: if one fails,
// the code or the page is wrong.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "transport/shm_layout.h"

namespace lockstep::testing {
namespace {

std::vector<size_t> shard(size_t samples, size_t ranks, size_t rank, bool allow_duplicates) {
  torch::data::samplers::DistributedRandomSampler sampler(samples, ranks, rank,
                                                          allow_duplicates);
  std::vector<size_t> indices;
  while (auto batch = sampler.next(1000)) {
    indices.insert(indices.end(), batch->begin(), batch->end());
  }
  return indices;
}

// troubleshooting.md, "Ranks with different numbers of batches".
TEST(DocsStatements, DistributedRandomSamplerGivesEveryRankTheSameCount) {
  for (size_t rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(shard(10, 3, rank, /*allow_duplicates=*/true).size(), 4u); // ceil(10 / 3)
    EXPECT_EQ(shard(10, 3, rank, /*allow_duplicates=*/false).size(), 3u); // floor(10 / 3)
  }
}

// world.md, "Transports": "2 MiB x (2 x ranks + 2) per host (12 MiB for 2
// ranks)".
TEST(DocsStatements, TheStagingSegmentSize) {
  for (int ranks : {2, 3, 4}) {
    size_t data = (2 * static_cast<size_t>(ranks) + 2) * (size_t{2} << 20);
    EXPECT_EQ(detail::Staging::bytes_for(ranks) - detail::Staging::data_offset(ranks), data);
  }
  EXPECT_EQ(detail::Staging::bytes_for(2) >> 20, 12u);
}

} // namespace
} // namespace lockstep::testing
