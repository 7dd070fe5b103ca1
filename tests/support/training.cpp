#include "support/training.h"

#include <cmath>
#include <map>

#include <ATen/CPUGeneratorImpl.h>

namespace lockstep::testing {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(
    OptimizerKind kind, std::vector<torch::Tensor> params) {
  if (kind == OptimizerKind::Adam) {
    return std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(1e-2));
  }
  return std::make_unique<torch::optim::SGD>(
      params, torch::optim::SGDOptions(0.1).momentum(0.9));
}

std::pair<torch::Tensor, torch::Tensor> global_batch(
    int64_t step, int64_t samples, const std::vector<int64_t>& input_shape) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  std::vector<int64_t> shape{samples};
  shape.insert(shape.end(), input_shape.begin(), input_shape.end());
  auto x = at::randn(shape, generator);
  auto y = at::randn({samples, 5}, generator);
  return {x, y};
}

torch::Tensor flatten(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> parts;
  for (const auto& tensor : tensors) {
    parts.push_back(tensor.detach().to(torch::kDouble).reshape({-1}));
  }
  return parts.empty() ? torch::zeros({0}, torch::kDouble) : torch::cat(parts);
}

void expect_same_on_every_rank(
    World& world, const torch::Tensor& tensor, const std::string& what) {
  auto gathered = world.all_gather(tensor.contiguous());
  for (int rank = 1; rank < world.size(); ++rank) {
    EXPECT_TRUE(gathered[rank].equal(gathered[0]))
        << what << ": rank " << rank << " differs from rank 0 by up to "
        << (gathered[rank] - gathered[0]).abs().max().item<double>();
  }
}

void expect_close_parameters(
    torch::nn::Module& actual,
    torch::nn::Module& reference,
    double tolerance,
    const std::string& context) {
  auto actual_params = actual.named_parameters();
  auto reference_params = reference.named_parameters();
  ASSERT_EQ(actual_params.size(), reference_params.size());
  for (const auto& item : actual_params) {
    const auto& expected = reference_params[item.key()];
    auto a = item.value().detach().to(torch::kDouble);
    auto b = expected.detach().to(torch::kDouble);
    EXPECT_TRUE(torch::allclose(a, b, tolerance, tolerance))
        << item.key() << " " << context << ": differs from the one-process "
        << "reference by up to " << (a - b).abs().max().item<double>();
  }
}

namespace {

// The distance from 1 to the next representable value.
double precision_unit(torch::Dtype dtype) {
  switch (dtype) {
    case torch::kDouble:
      return std::ldexp(1.0, -52);
    case torch::kFloat:
      return std::ldexp(1.0, -23);
    case torch::kHalf:
      return std::ldexp(1.0, -10);
    case torch::kBFloat16:
      return std::ldexp(1.0, -7);
    default:
      ADD_FAILURE() << "no precision for " << dtype;
      return 0;
  }
}

} // namespace

void expect_as_close_to_exact(
    torch::nn::Module& actual,
    torch::nn::Module& reference,
    torch::nn::Module& exact,
    const std::string& context) {
  auto actual_params = actual.named_parameters();
  auto reference_params = reference.named_parameters();
  auto exact_params = exact.named_parameters();
  std::map<torch::Dtype, std::vector<std::string>> by_dtype;
  for (const auto& item : actual_params) {
    by_dtype[item.value().scalar_type()].push_back(item.key());
  }
  for (const auto& [dtype, names] : by_dtype) {
    auto gather = [&](const torch::OrderedDict<std::string, torch::Tensor>& params) {
      std::vector<torch::Tensor> tensors;
      for (const auto& name : names) {
        tensors.push_back(params[name]);
      }
      return flatten(tensors);
    };
    auto exact_values = gather(exact_params);
    double actual_distance = (gather(actual_params) - exact_values).abs().max().item<double>();
    double reference_distance =
        (gather(reference_params) - exact_values).abs().max().item<double>();
    double unit = precision_unit(dtype);
    double allowed = 8 * reference_distance + 2 * unit * exact_values.abs().max().item<double>();
    EXPECT_LE(actual_distance, allowed)
        << context << ", " << dtype << " parameters: the DDP model is " << actual_distance
        << " from the float64 trajectory, the one-process model " << reference_distance;
  }
}

} // namespace lockstep::testing
