#pragma once

// Small models for the DDP tests: each stands for one kind of model that
// DistributedDataParallel must handle.

#include <torch/torch.h>

namespace lockstep::testing {

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int64_t in = 20, int64_t hidden = 32, int64_t out = 5)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        fc3(register_module("fc3", torch::nn::Linear(hidden, out))) {}
  torch::Tensor forward(torch::Tensor x) {
    return fc3(torch::relu(fc2(torch::relu(fc1(x)))));
  }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Mlp);

/// Input 1x12x12.
struct CnnImpl : torch::nn::Module {
  explicit CnnImpl(bool batch_norm = false)
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 8, 3)))),
        fc1(register_module("fc1", torch::nn::Linear(8 * 8 * 8, 16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 5))) {
    if (batch_norm) {
      bn1 = register_module("bn1", torch::nn::BatchNorm2d(4));
      bn2 = register_module("bn2", torch::nn::BatchNorm2d(8));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    x = conv1(x);
    if (bn1) {
      x = bn1(x);
    }
    x = conv2(torch::relu(x));
    if (bn2) {
      x = bn2(x);
    }
    x = torch::relu(x).flatten(1);
    return fc2(torch::relu(fc1(x)));
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
};
TORCH_MODULE(Cnn);

/// A trunk and three heads; each forward uses one head, chosen by the
/// caller (by rank and by step in the tests), so the unused set changes
/// between ranks and iterations.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl()
      : trunk(register_module("trunk", torch::nn::Linear(20, 16))),
        head_a(register_module("head_a", torch::nn::Linear(16, 5))),
        head_b(register_module("head_b", torch::nn::Linear(16, 5))),
        head_c(register_module("head_c", torch::nn::Linear(16, 5))) {}
  torch::Tensor forward(torch::Tensor x, int64_t head) {
    x = torch::relu(trunk(x));
    switch (head % 3) {
      case 0:
        return head_a(x);
      case 1:
        return head_b(x);
      default:
        return head_c(x);
    }
  }
  torch::nn::Linear trunk, head_a, head_b, head_c;
};
TORCH_MODULE(Branchy);

/// One weight used twice and registered twice, under two names (as tied
/// input and output embeddings are).
struct TiedImpl : torch::nn::Module {
  TiedImpl()
      : weight(register_parameter("weight", torch::randn({20, 20}) * 0.2)),
        holder(register_module("holder", std::make_shared<torch::nn::Module>())),
        out(register_module("out", torch::nn::Linear(20, 5))) {
    holder->register_parameter("weight_again", weight);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::tanh(x.matmul(weight));
    return out(torch::tanh(x.matmul(weight)));
  }
  torch::Tensor weight;
  std::shared_ptr<torch::nn::Module> holder;
  torch::nn::Linear out;
};
TORCH_MODULE(Tied);

/// An MLP whose first layer is frozen.
inline Mlp frozen_mlp() {
  Mlp mlp;
  for (auto& param : mlp->fc1->parameters()) {
    param.set_requires_grad(false);
  }
  return mlp;
}

/// An MLP with a constant buffer that forward reads and never writes
/// (reference/004: PyTorch broadcasts it before every forward anyway).
struct ConstantBufferMlpImpl : torch::nn::Module {
  explicit ConstantBufferMlpImpl(int64_t width = 20)
      : mlp(register_module("mlp", Mlp(width))),
        mask(register_buffer("mask", torch::ones({width}))) {}
  torch::Tensor forward(torch::Tensor x) {
    return mlp(x * mask);
  }
  Mlp mlp;
  torch::Tensor mask;
};
TORCH_MODULE(ConstantBufferMlp);

/// fp32, fp64 and bf16 layers in one model.
struct MixedPrecisionImpl : torch::nn::Module {
  MixedPrecisionImpl()
      : f32(register_module("f32", torch::nn::Linear(20, 16))),
        f64(register_module("f64", torch::nn::Linear(16, 16))),
        bf16(register_module("bf16", torch::nn::Linear(16, 5))) {
    f64->to(torch::kDouble);
    bf16->to(torch::kBFloat16);
  }
  // Each layer's input in that layer's dtype, so that the whole model
  // converted to float64 computes the exact counterpart.
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(f32(x.to(f32->weight.scalar_type())));
    x = torch::relu(f64(x.to(f64->weight.scalar_type())));
    return bf16(x.to(bf16->weight.scalar_type())).to(f32->weight.scalar_type());
  }
  torch::nn::Linear f32, f64, bf16;
};
TORCH_MODULE(MixedPrecision);

} // namespace lockstep::testing
