#pragma once

#include <torch/torch.h>

#include <lockstep/fsdp.h>
#include <lockstep/sync_batch_norm.h>

namespace lockstep::testing {

// A CNN whose BatchNorms are SyncBatchNorms declared without a world: the
// wrapper binds them to its own, so that each normalises the global batch,
// as one process's BatchNorm does. Each convolution block is a unit.
struct ConvBlockImpl : torch::nn::Module {
  ConvBlockImpl(int64_t in, int64_t out)
      : conv(register_module(
            "conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1)))),
        norm(register_module("norm", SyncBatchNorm(torch::nn::BatchNormOptions(out)))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::relu(norm(conv(x)));
  }
  torch::nn::Conv2d conv;
  SyncBatchNorm norm;
};
TORCH_MODULE(ConvBlock);

struct SmallCnnImpl : torch::nn::Module {
  SmallCnnImpl()
      : first(register_module("first", Sharded<ConvBlock>(1, 4))),
        second(register_module("second", Sharded<ConvBlock>(4, 4))),
        head(register_module("head", torch::nn::Linear(4 * 4 * 4, 5))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return head(second(torch::max_pool2d(first(x), 2)).flatten(1));
  }
  Sharded<ConvBlock> first, second;
  torch::nn::Linear head;
};
TORCH_MODULE(SmallCnn);

} // namespace lockstep::testing
