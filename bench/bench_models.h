#pragma once

// The benchmark models, the same as bench/ddp_torch.py builds in Python.

#include <cmath>

#include <torch/torch.h>

namespace lockstep::bench {

/// MLP 1024-2048-2048-2048-10 (10.5M parameters), optionally with a
/// constant 1024x1024 buffer that forward reads (reference/004).
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(bool constant_buffer = false) {
    int64_t widths[] = {1024, 2048, 2048, 2048, 10};
    for (int i = 0; i < 4; ++i) {
      layers.push_back(register_module(
          "fc" + std::to_string(i + 1), torch::nn::Linear(widths[i], widths[i + 1])));
    }
    if (constant_buffer) {
      scale = register_buffer("scale", torch::ones({1024, 1024}));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    if (scale.defined()) {
      x = x * scale[0];
    }
    for (size_t i = 0; i < layers.size(); ++i) {
      x = layers[i](x);
      if (i + 1 < layers.size()) {
        x = torch::relu(x);
      }
    }
    return x;
  }
  std::vector<torch::nn::Linear> layers;
  torch::Tensor scale;
};
TORCH_MODULE(Mlp);

/// The MNIST CNN of PyTorch's examples: conv 32, conv 64, fc 128, fc 10
/// (1.2M parameters), optionally with BatchNorm after each convolution.
struct CnnImpl : torch::nn::Module {
  explicit CnnImpl(bool batch_norm = false)
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3)))),
        fc1(register_module("fc1", torch::nn::Linear(9216, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {
    if (batch_norm) {
      // In Sequentials, so that convert_sync_batchnorm can replace them.
      bn1 = register_module("bn1", torch::nn::Sequential(torch::nn::BatchNorm2d(32)));
      bn2 = register_module("bn2", torch::nn::Sequential(torch::nn::BatchNorm2d(64)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    x = conv1(x);
    if (bn1) {
      x = bn1->forward(x);
    }
    x = conv2(torch::relu(x));
    if (bn2) {
      x = bn2->forward(x);
    }
    x = torch::max_pool2d(torch::relu(x), 2).flatten(1);
    return fc2(torch::relu(fc1(x)));
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
  torch::nn::Sequential bn1{nullptr}, bn2{nullptr};
};
TORCH_MODULE(Cnn);

/// A recommender's core: a 1M x 64 embedding table summed over 20 ids per
/// example, and a linear head. Its gradient touches about 1,280 rows per
/// rank and step: 320 KiB as a sparse tensor, 256 MiB dense.
struct RecommenderImpl : torch::nn::Module {
  explicit RecommenderImpl(bool sparse)
      : table(register_module("table", torch::nn::EmbeddingBag(
                                           torch::nn::EmbeddingBagOptions(kRows, 64)
                                               .mode(torch::kSum)
                                               .sparse(sparse)))),
        head(register_module("head", torch::nn::Linear(64, 10))) {}
  torch::Tensor forward(torch::Tensor ids) {
    return head(table(ids));
  }
  static constexpr int64_t kRows = 1000000;
  torch::nn::EmbeddingBag table;
  torch::nn::Linear head;
};
TORCH_MODULE(Recommender);

/// A small transformer encoder: 1000 token ids embedded in 256, 2 pre-norm
/// blocks (4-head self-attention, a 1024-wide GELU MLP), and a linear head
/// on the mean over 32 tokens (1.9M parameters).
struct TransformerImpl : torch::nn::Module {
  static constexpr int64_t kVocabulary = 1000, kWidth = 256, kHeads = 4, kTokens = 32;
  TransformerImpl()
      : embedding(register_module("embedding", torch::nn::Embedding(kVocabulary, kWidth))),
        head(register_module("head", torch::nn::Linear(kWidth, 10))) {
    for (int i = 0; i < 2; ++i) {
      auto name = "block" + std::to_string(i) + "_";
      auto norm = torch::nn::LayerNormOptions({kWidth});
      norm1.push_back(register_module(name + "norm1", torch::nn::LayerNorm(norm)));
      qkv.push_back(register_module(name + "qkv", torch::nn::Linear(kWidth, 3 * kWidth)));
      proj.push_back(register_module(name + "proj", torch::nn::Linear(kWidth, kWidth)));
      norm2.push_back(register_module(name + "norm2", torch::nn::LayerNorm(norm)));
      up.push_back(register_module(name + "up", torch::nn::Linear(kWidth, 4 * kWidth)));
      down.push_back(register_module(name + "down", torch::nn::Linear(4 * kWidth, kWidth)));
    }
  }
  // The layers run through torch::linear (aten::linear, as Python's
  // F.linear), not torch::nn::Linear's forward: the C++ frontend's
  // functional linear turns an input of more than 2 dimensions into matmul
  // and an in-place bias add, about 1.1x slower here in float32, and under
  // autocast a bfloat16 product plus a float32 bias added in place
  // (docs/troubleshooting.md). unbind, as Python's `q, k, v = parts`.
  static torch::Tensor linear(const torch::nn::Linear& layer, const torch::Tensor& x) {
    return torch::linear(x, layer->weight, layer->bias);
  }
  torch::Tensor forward(torch::Tensor ids) {
    auto x = embedding(ids);
    int64_t batch = x.size(0), tokens = x.size(1), depth = kWidth / kHeads;
    for (size_t i = 0; i < qkv.size(); ++i) {
      auto parts = linear(qkv[i], norm1[i](x))
                       .view({batch, tokens, 3, kHeads, depth})
                       .permute({2, 0, 3, 1, 4})
                       .unbind(0);
      auto scores = parts[0].matmul(parts[1].transpose(-2, -1)) / std::sqrt(double(depth));
      auto attended = torch::softmax(scores, -1).matmul(parts[2]);
      x = x + linear(proj[i], attended.transpose(1, 2).reshape({batch, tokens, kWidth}));
      x = x + linear(down[i], torch::gelu(linear(up[i], norm2[i](x))));
    }
    return head(x.mean(1));
  }
  torch::nn::Embedding embedding;
  torch::nn::Linear head;
  std::vector<torch::nn::LayerNorm> norm1, norm2;
  std::vector<torch::nn::Linear> qkv, proj, up, down;
};
TORCH_MODULE(Transformer);

/// The token ids both sides feed the transformer: 64 sequences of 32.
inline std::pair<torch::Tensor, torch::Tensor> deterministic_tokens() {
  auto ids = torch::arange(64 * TransformerImpl::kTokens, torch::kLong)
                 .mul(7919)
                 .remainder(TransformerImpl::kVocabulary);
  return {ids.view({64, TransformerImpl::kTokens}), torch::arange(64, torch::kLong).remainder(10)};
}

/// The ids both sides look up: 64 examples of 20, spread over the table.
inline std::pair<torch::Tensor, torch::Tensor> deterministic_ids() {
  auto ids = torch::arange(64 * 20, torch::kLong).mul(7919).remainder(RecommenderImpl::kRows);
  return {ids.view({64, 20}), torch::arange(64, torch::kLong).remainder(10)};
}

/// Sets every parameter from a formula that bench/ddp_torch.py repeats, so
/// that both sides compute on the same numbers (speed depends on them:
/// denormals, dead ReLUs).
inline void deterministic_init(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  int64_t k = 0;
  for (auto& param : module.parameters()) {
    double scale = param.dim() > 1
        ? 1.0 / std::sqrt(static_cast<double>(param.numel() / param.size(0)))
        : 0.01;
    auto values = torch::arange(param.numel(), torch::kFloat)
                      .mul(0.37)
                      .add(static_cast<double>(k++))
                      .sin()
                      .mul(scale);
    param.copy_(values.view(param.sizes()));
  }
}

/// The batch both sides train on: 64 inputs of `shape` and labels 0..9.
inline std::pair<torch::Tensor, torch::Tensor> deterministic_batch(
    std::vector<int64_t> shape) {
  shape.insert(shape.begin(), 64);
  int64_t numel = 1;
  for (auto size : shape) {
    numel *= size;
  }
  auto x = torch::arange(numel, torch::kFloat).mul(0.11).cos().view(shape);
  auto y = torch::arange(64, torch::kLong).remainder(10);
  return {x, y};
}

} // namespace lockstep::bench
