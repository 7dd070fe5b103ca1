#include "support/elastic_reference.h"

#include <fstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/step_sampler.h>

#include "support/models.h"
#include "support/training.h"

namespace lockstep::testing {

Reference elastic_reference(int64_t steps) {
  torch::manual_seed(7);
  Mlp model;
  model->to(torch::kDouble);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::StepLR scheduler(optimizer, 50, 0.5);
  torch::manual_seed(11);
  auto inputs = torch::randn({120, 20}, torch::kDouble);
  auto targets = torch::randn({120, 5}, torch::kDouble);
  StepSampler sampler(120, StepSamplerOptions().global_batch_size(12));
  Reference result;
  for (int64_t step = 0; step < steps; ++step) {
    auto index = torch::tensor(sampler.indices(step, 0, 1), torch::kLong);
    optimizer.zero_grad();
    auto error = model(inputs.index_select(0, index)) - targets.index_select(0, index);
    error.pow(2).mean().backward();
    result.squared_errors.push_back(error.detach().pow(2).sum().item<double>());
    optimizer.step();
    scheduler.step();
    double sum = 0;
    for (const auto& param : model->parameters()) {
      sum += param.sum().item<double>();
    }
    result.sums.push_back(sum);
  }
  result.parameters =
      torch::cat({model->fc1->weight.flatten(), model->fc1->bias, model->fc2->weight.flatten(),
                  model->fc2->bias, model->fc3->weight.flatten(), model->fc3->bias});
  return result;
}

// Each parameter differs from the reference's by at most kFloat64Tolerance
// (see training.h); a sum of about 1000 of them, by at most 1000 times it.
constexpr double kSumTolerance = 1000 * kFloat64Tolerance;

void expect_committed_steps_match(const ScratchFolder& out, int ranks, const Reference& ref) {
  for (int rank = 0; rank < ranks; ++rank) {
    std::ifstream log(out / ("rank-" + std::to_string(rank) + ".log"));
    int64_t step = 0;
    int size = 0;
    double sum = 0;
    double squared_error = 0;
    double samples = 0;
    int lines = 0;
    while (log >> step >> size >> sum >> squared_error >> samples) {
      ++lines;
      ASSERT_GE(step, 1);
      ASSERT_LE(step, static_cast<int64_t>(ref.sums.size()));
      EXPECT_NEAR(sum, ref.sums[step - 1], kSumTolerance)
          << "rank " << rank << " after step " << step << " in a world of " << size;
      // ft.commit(sums): each committed step's figures cover its global
      // batch once, whichever ranks trained it.
      EXPECT_EQ(samples, 12) << "rank " << rank << " at step " << step;
      EXPECT_NEAR(squared_error, ref.squared_errors[step - 1], kSumTolerance)
          << "rank " << rank << " at step " << step << " in a world of " << size;
    }
    EXPECT_GT(lines, 0) << "rank " << rank << " committed no step";
  }
  std::ifstream file(out / "parameters.bin", std::ios::binary);
  std::vector<double> values(static_cast<size_t>(ref.parameters.numel()));
  file.read(reinterpret_cast<char*>(values.data()),
            static_cast<std::streamsize>(values.size() * sizeof(double)));
  ASSERT_TRUE(file) << "the run wrote no final parameters";
  auto actual = torch::tensor(values, torch::kDouble);
  EXPECT_TRUE(torch::allclose(actual, ref.parameters, 0, kFloat64Tolerance))
      << "largest difference " << (actual - ref.parameters).abs().max().item<double>();
}

} // namespace lockstep::testing
