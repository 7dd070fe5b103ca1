// lockstep::clip_grad_norm_ over gradients sharded across the ranks: whole
// parameters on some ranks, slices of two parameters over the ranks (empty
// slices among them), and a rank that holds nothing. Each rank's clipped shard must equal the same
// part of torch::nn::utils::clip_grad_norm_ on one process holding every
// gradient, in float64, and the norm returned must be the same on every
// rank; at 1 to 4 ranks over shared memory and Gloo, for the 1-, 2-, 3-
// and infinity-norm, clipping and not.

#include <cmath>
#include <limits>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/clip_grad_norm.h>
#include <lockstep/world.h>

#include "support/expect_error.h"
#include "support/multiprocess.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

// The gradients of one process: six parameters of several shapes, from a
// formula every rank computes alike.
std::vector<torch::Tensor> whole_gradients() {
  std::vector<std::vector<int64_t>> shapes{{12, 5}, {5}, {7, 3, 2}, {1}, {30}, {4, 4}};
  std::vector<torch::Tensor> grads;
  for (size_t i = 0; i < shapes.size(); ++i) {
    auto numel = c10::multiply_integers(shapes[i]);
    grads.push_back(torch::arange(numel, torch::kDouble)
                        .mul(0.37)
                        .add(static_cast<double>(i))
                        .sin()
                        .mul(0.5 + static_cast<double>(i))
                        .view(shapes[i]));
  }
  return grads;
}

std::vector<torch::Tensor> leaves_with(const std::vector<torch::Tensor>& grads) {
  std::vector<torch::Tensor> leaves;
  for (const auto& grad : grads) {
    auto leaf = torch::zeros_like(grad).requires_grad_(true);
    leaf.mutable_grad() = grad.clone();
    leaves.push_back(leaf);
  }
  return leaves;
}

// Rank r's shard: the first parameter sliced along dim 0 over the ranks
// (FSDP's way), the fourth (one element) too, so that every rank but the
// first holds an empty slice of it, and the others whole on one rank each.
// At 4 ranks the last holds nothing at all.
std::vector<torch::Tensor> shard_of(const std::vector<torch::Tensor>& grads, int rank,
                                    int world_size) {
  int holders = world_size == 4 ? 3 : world_size;
  std::vector<torch::Tensor> shard;
  for (size_t sliced : {size_t{0}, size_t{3}}) {
    auto slices = grads[sliced].tensor_split(holders, 0);
    if (rank < holders) {
      shard.push_back(slices[static_cast<size_t>(rank)]);
    }
  }
  for (size_t i = 1; i < grads.size(); ++i) {
    if (i != 3 && static_cast<int>(i) % holders == rank) {
      shard.push_back(grads[i]);
    }
  }
  return shard;
}

struct Case {
  double norm_type;
  double max_norm;
  std::string name;
};
void PrintTo(const Case& clip, std::ostream* out) {
  *out << clip.name;
}

class ClipGradNorm : public ::testing::TestWithParam<std::tuple<WorldSetup, Case>> {};

TEST_P(ClipGradNorm, ShardsClipAsOneProcessDoes) {
  auto [setup, clip] = GetParam();
  run_ranks(setup, [&, setup = setup, clip = clip](int rank) {
    World world = init();
    auto reference = leaves_with(whole_gradients());
    double expected = torch::nn::utils::clip_grad_norm_(reference, clip.max_norm,
                                                        clip.norm_type);
    std::vector<torch::Tensor> clipped;
    for (const auto& leaf : reference) {
      clipped.push_back(leaf.grad());
    }
    auto mine = leaves_with(shard_of(whole_gradients(), rank, setup.size));
    double norm = clip_grad_norm_(mine, clip.max_norm, world,
                                  ClipGradNormOptions().norm_type(clip.norm_type));
    // Powers summed in another order: relative float64 rounding over a few
    // hundred terms.
    EXPECT_NEAR(norm, expected, 1e-12 * expected);
    auto norms = world.all_gather(torch::tensor({norm}, torch::kDouble));
    for (const auto& other : norms) {
      EXPECT_EQ(other.item<double>(), norm) << "every rank returns the same norm";
    }
    auto wanted = shard_of(clipped, rank, setup.size);
    ASSERT_EQ(wanted.size(), mine.size());
    for (size_t i = 0; i < mine.size(); ++i) {
      if (expected <= clip.max_norm) {
        EXPECT_TRUE(torch::equal(mine[i].grad(), wanted[i])) << "within max_norm: untouched";
      } else {
        EXPECT_TRUE(torch::allclose(mine[i].grad(), wanted[i], 1e-12, kFloat64Tolerance))
            << "shard tensor " << i;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    WorldSizeAndNorm,
    ClipGradNorm,
    ::testing::Combine(::testing::ValuesIn(every_world_setup()),
                       ::testing::Values(Case{2.0, 1.0, "l2_clipped"},
                                         Case{2.0, 1e3, "l2_within"},
                                         Case{1.0, 2.0, "l1_clipped"},
                                         Case{3.0, 0.5, "l3_clipped"},
                                         Case{kInfinity, 0.25, "largest_clipped"})),
    [](const auto& info) {
      return std::get<0>(info.param).name() + "_" + std::get<1>(info.param).name;
    });

// A NaN on one rank reaches every rank: the error where it is asked for,
// NaN gradients everywhere where it is not (as torch's), for the sum and
// for the largest magnitude alike. A norm type that is not supported is
// refused on every rank before anything travels.
TEST(ClipGradNormErrors, ANanOnOneRankAndABadNormTypeReachEveryRank) {
  run_ranks(3, [](int rank) {
    World world = init();
    for (double p : {2.0, kInfinity}) {
      auto grads = shard_of(whole_gradients(), rank, 3);
      if (rank == 1) {
        grads.back()[0] = std::nan("");
      }
      auto mine = leaves_with(grads);
      expect_error<c10::Error>(
          [&] {
            clip_grad_norm_(mine, 1.0, world,
                            ClipGradNormOptions().norm_type(p).error_if_nonfinite(true));
          },
          {"is non-finite, so it cannot be clipped", "`error_if_nonfinite=false`"});
      double norm = clip_grad_norm_(mine, 1.0, world, ClipGradNormOptions().norm_type(p));
      EXPECT_TRUE(std::isnan(norm)) << "p = " << p;
      EXPECT_TRUE(mine[0].grad().isnan().all().item<bool>()) << "p = " << p;
    }
    auto mine = leaves_with(shard_of(whole_gradients(), rank, 3));
    for (double p : {0.0, -1.0, std::nan("")}) {
      expect_error<UsageError>(
          [&] { clip_grad_norm_(mine, 1.0, world, ClipGradNormOptions().norm_type(p)); },
          {"clip_grad_norm_: norm_type", "is not supported"});
    }
    // A rank that cannot take its norm (a sparse gradient's largest
    // magnitude) raises its own error; the others raise too, not wait.
    auto sparse = mine;
    if (rank == 2) {
      sparse.push_back(torch::zeros({4}, torch::kDouble).requires_grad_(true));
      sparse.back().mutable_grad() = torch::ones({4}, torch::kDouble).to_sparse();
      EXPECT_ANY_THROW(clip_grad_norm_(sparse, 1.0, world,
                                       ClipGradNormOptions().norm_type(kInfinity)));
    } else {
      expect_error<UsageError>(
          [&] {
            clip_grad_norm_(sparse, 1.0, world, ClipGradNormOptions().norm_type(kInfinity));
          },
          {"another rank could not take the norm of its gradients"});
    }
    // The world is still in step: a collective after the refusals.
    auto one = torch::ones({1});
    world.all_reduce(one);
    EXPECT_EQ(one.item<float>(), 3.0f);
  });
}

} // namespace
} // namespace lockstep::testing
