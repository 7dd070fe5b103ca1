#pragma once

// The CNN of the MNIST examples (mnist_train, mnist_elastic).

#include <torch/torch.h>

namespace mnist {

struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool batch_norm)
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3)))),
        fc1(register_module("fc1", torch::nn::Linear(9216, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {
    if (batch_norm) {
      // In Sequentials, so that convert_sync_batchnorm can replace them.
      norm1 = register_module("norm1", torch::nn::Sequential(torch::nn::BatchNorm2d(32)));
      norm2 = register_module("norm2", torch::nn::Sequential(torch::nn::BatchNorm2d(64)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    x = conv1(x);
    x = torch::relu(norm1 ? norm1->forward(x) : x);
    x = conv2(x);
    x = torch::relu(norm2 ? norm2->forward(x) : x);
    x = torch::max_pool2d(x, 2).flatten(1);
    return torch::log_softmax(fc2(torch::relu(fc1(x))), 1);
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
  torch::nn::Sequential norm1{nullptr}, norm2{nullptr};
};
TORCH_MODULE(Net);

} // namespace mnist
