#pragma once

// The Mlp of models.h with a SyncBatchNorm after its first layer: bound by
// the DDP that wraps it (over a replica group, it normalises over the
// group's batch), and alone (in a reference of one process) it normalises
// what it is given, as BatchNorm does.

#include <torch/torch.h>

#include <lockstep/sync_batch_norm.h>

namespace lockstep::testing {

struct NormedMlpImpl : torch::nn::Module {
  NormedMlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(20, 32))),
        norm(register_module("norm", SyncBatchNorm(torch::nn::BatchNormOptions(32)))),
        fc2(register_module("fc2", torch::nn::Linear(32, 32))),
        fc3(register_module("fc3", torch::nn::Linear(32, 5))) {}
  torch::Tensor forward(torch::Tensor x) {
    return fc3(torch::relu(fc2(torch::relu(norm(fc1(x))))));
  }
  /// Its running statistics, end to end.
  torch::Tensor statistics() const {
    return torch::cat({norm->running_mean, norm->running_var}).detach();
  }
  torch::nn::Linear fc1;
  SyncBatchNorm norm;
  torch::nn::Linear fc2, fc3;
};
TORCH_MODULE(NormedMlp);

} // namespace lockstep::testing
