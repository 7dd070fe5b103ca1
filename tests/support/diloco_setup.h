#pragma once

// The setup that the DiLoCo tests and their program share: a float64 MLP
// cut into fragments, each replica's batches, and the optimizers of
// torchft's and the paper's examples.

#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "support/models.h"
#include "support/training.h"

namespace lockstep::testing {

constexpr int64_t kPerReplica = 4; // samples per replica per step

/// The parameters of `model` cut into `count` fragments: fc1 | fc2 + fc3,
/// or fc1 | fc2 | fc3.
inline std::vector<std::vector<torch::Tensor>> fragments_of(Mlp& model, int count) {
  auto layer = [](torch::nn::Linear& linear) {
    return std::vector<torch::Tensor>{linear->weight, linear->bias};
  };
  if (count == 1) {
    return {model->parameters()};
  }
  auto second = layer(model->fc2);
  if (count == 2) {
    auto third = layer(model->fc3);
    second.insert(second.end(), third.begin(), third.end());
    return {layer(model->fc1), second};
  }
  return {layer(model->fc1), second, layer(model->fc3)};
}

inline Mlp float64_mlp(uint64_t seed = 3) {
  torch::manual_seed(seed);
  Mlp model;
  model->to(torch::kDouble);
  return model;
}

/// Replica `replica`'s share of the batch of `step` (its 0-based inner step).
inline std::pair<torch::Tensor, torch::Tensor> replica_batch(int64_t step, int replicas,
                                                             int replica) {
  auto [x, y] = global_batch(step, kPerReplica * replicas, {20});
  return {x.to(torch::kDouble).narrow(0, kPerReplica * replica, kPerReplica),
          y.to(torch::kDouble).narrow(0, kPerReplica * replica, kPerReplica)};
}

inline torch::optim::SGDOptions inner_options() {
  return torch::optim::SGDOptions(0.05).momentum(0.9);
}

inline torch::optim::SGDOptions outer_options() {
  return torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true);
}

} // namespace lockstep::testing
