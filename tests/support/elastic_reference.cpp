#include "support/elastic_reference.h"

#include <fstream>
#include <functional>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/step_sampler.h>

#include "support/models.h"
#include "support/normed_mlp.h"
#include "support/training.h"

namespace lockstep::testing {

namespace {

// The programs' loop in one process: SGD with momentum and a StepLR over
// `model`'s parameters, the same data; `error_of(step, inputs, targets)`
// runs the step's forward over its global batch.
using ErrorOf = std::function<torch::Tensor(int64_t step, const torch::Tensor& inputs,
                                            const torch::Tensor& targets)>;

Reference train_reference(torch::nn::Module& model, int64_t steps, const ErrorOf& error_of) {
  model.to(torch::kDouble);
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::StepLR scheduler(optimizer, 50, 0.5);
  torch::manual_seed(11);
  auto inputs = torch::randn({120, 20}, torch::kDouble);
  auto targets = torch::randn({120, 5}, torch::kDouble);
  Reference result;
  for (int64_t step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    auto error = error_of(step, inputs, targets);
    error.pow(2).mean().backward();
    result.squared_errors.push_back(error.detach().pow(2).sum().item<double>());
    optimizer.step();
    scheduler.step();
    double sum = 0;
    for (const auto& param : model.parameters()) {
      sum += param.sum().item<double>();
    }
    result.sums.push_back(sum);
  }
  std::vector<torch::Tensor> flat;
  for (const auto& param : model.parameters()) {
    flat.push_back(param.detach().flatten());
  }
  result.parameters = torch::cat(flat);
  return result;
}

// A line of OUT_DIR/rank-R.log: one committed step.
struct Logged {
  int64_t step = 0;
  int size = 0; // the world's, in ranks
  double sum = 0; // of the parameters after it
  double squared_error = 0;
  double samples = 0;
};

std::vector<Logged> logged(const ScratchFolder& out, int rank) {
  std::ifstream log(out / ("rank-" + std::to_string(rank) + ".log"));
  std::vector<Logged> lines;
  Logged line;
  while (log >> line.step >> line.size >> line.sum >> line.squared_error >> line.samples) {
    lines.push_back(line);
  }
  return lines;
}

const StepSampler& sampler() {
  static const StepSampler sampler(120, StepSamplerOptions().global_batch_size(12));
  return sampler;
}

} // namespace

Reference elastic_reference(int64_t steps) {
  torch::manual_seed(7);
  Mlp model;
  return train_reference(*model, steps, [&](int64_t step, const torch::Tensor& inputs,
                                           const torch::Tensor& targets) {
    auto index = torch::tensor(sampler().indices(step, 0, 1), torch::kLong);
    return model(inputs.index_select(0, index)) - targets.index_select(0, index);
  });
}

Reference grouped_norm_reference(const std::vector<int>& ranks, int group_size) {
  torch::manual_seed(7);
  NormedMlp model;
  auto steps = static_cast<int64_t>(ranks.size());
  torch::Tensor statistics;
  auto result = train_reference(*model, steps, [&](int64_t step, const torch::Tensor& inputs,
                                                  const torch::Tensor& targets) {
    const int world = ranks[static_cast<size_t>(step)];
    std::vector<torch::Tensor> errors;
    for (int first = 0; first < world; first += group_size) {
      // The group's rows: its ranks' shares, in their order.
      std::vector<int64_t> rows;
      for (int rank = first; rank < first + group_size; ++rank) {
        auto share = sampler().indices(step, rank, world);
        rows.insert(rows.end(), share.begin(), share.end());
      }
      auto index = torch::tensor(rows, torch::kLong);
      // The model's forward, its norm over this group's rows alone; the
      // running statistics are the first group's (every group takes them
      // at commit), updated apart so that no forward's saved tensor changes.
      auto hidden = model->fc1(inputs.index_select(0, index));
      if (first == 0) {
        torch::NoGradGuard no_grad;
        model->norm(hidden.detach());
      }
      auto& norm = *model->norm;
      auto normed = torch::nn::functional::batch_norm(
          hidden, torch::Tensor(), torch::Tensor(),
          torch::nn::functional::BatchNormFuncOptions()
              .weight(norm.weight)
              .bias(norm.bias)
              .training(true)
              .eps(norm.options.eps()));
      auto output = model->fc3(torch::relu(model->fc2(torch::relu(normed))));
      errors.push_back(output - targets.index_select(0, index));
    }
    return torch::cat(errors);
  });
  result.statistics = model->statistics();
  return result;
}

std::vector<int> committed_world_sizes(const ScratchFolder& out, int ranks, int64_t steps) {
  std::vector<int> sizes(static_cast<size_t>(steps), 0);
  for (int rank = 0; rank < ranks; ++rank) {
    for (const auto& line : logged(out, rank)) {
      if (line.step < 1 || line.step > steps) {
        continue; // expect_committed_steps_match names it
      }
      auto& known = sizes[static_cast<size_t>(line.step - 1)];
      EXPECT_TRUE(known == 0 || known == line.size)
          << "step " << line.step << " committed by worlds of " << known << " and " << line.size;
      known = line.size;
    }
  }
  for (size_t step = 0; step < sizes.size(); ++step) {
    EXPECT_NE(sizes[step], 0) << "no rank logged step " << step + 1;
  }
  return sizes;
}

// Each parameter differs from the reference's by at most kFloat64Tolerance
// (see training.h); a sum of about 1000 of them, by at most 1000 times it.
constexpr double kSumTolerance = 1000 * kFloat64Tolerance;

void expect_committed_steps_match(const ScratchFolder& out, int ranks, const Reference& ref) {
  for (int rank = 0; rank < ranks; ++rank) {
    auto lines = logged(out, rank);
    for (const auto& line : lines) {
      ASSERT_GE(line.step, 1);
      ASSERT_LE(line.step, static_cast<int64_t>(ref.sums.size()));
      EXPECT_NEAR(line.sum, ref.sums[line.step - 1], kSumTolerance)
          << "rank " << rank << " after step " << line.step << " in a world of " << line.size;
      // ft.commit(sums): each committed step's figures cover its global
      // batch once, whichever ranks trained it.
      EXPECT_EQ(line.samples, 12) << "rank " << rank << " at step " << line.step;
      EXPECT_NEAR(line.squared_error, ref.squared_errors[line.step - 1], kSumTolerance)
          << "rank " << rank << " at step " << line.step << " in a world of " << line.size;
    }
    EXPECT_FALSE(lines.empty()) << "rank " << rank << " committed no step";
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

void expect_statistics_match(const ScratchFolder& out, int ranks, const Reference& ref) {
  for (int rank = 0; rank < ranks; ++rank) {
    std::ifstream file(out / ("statistics-" + std::to_string(rank) + ".bin"), std::ios::binary);
    std::vector<double> values(static_cast<size_t>(ref.statistics.numel()));
    file.read(reinterpret_cast<char*>(values.data()),
              static_cast<std::streamsize>(values.size() * sizeof(double)));
    ASSERT_TRUE(file) << "rank " << rank << " wrote no running statistics";
    auto actual = torch::tensor(values, torch::kDouble);
    EXPECT_TRUE(torch::allclose(actual, ref.statistics, 0, kFloat64Tolerance))
        << "rank " << rank << ": largest difference "
        << (actual - ref.statistics).abs().max().item<double>();
  }
}

} // namespace lockstep::testing
