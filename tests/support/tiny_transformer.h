#pragma once

// A transformer-like model for FullyShardedDataParallel's tests: an
// embedding tied to the output layer, blocks of attention, MLP and
// LayerNorm, each block a unit (with `nested`, its feed-forward part a unit
// inside it), and its batches.

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <lockstep/fsdp.h>

#include "support/training.h"

namespace lockstep::testing::tiny {

constexpr int64_t kVocabulary = 11;
constexpr int64_t kWidth = 8;
constexpr int64_t kTokens = 5;
constexpr int64_t kSamples = 12; // divides among 2, 3 and 4 ranks

struct FeedForwardImpl : torch::nn::Module {
  FeedForwardImpl()
      : norm(register_module("norm", torch::nn::LayerNorm(
                                         torch::nn::LayerNormOptions({kWidth})))),
        up(register_module("up", torch::nn::Linear(kWidth, 2 * kWidth))),
        down(register_module("down", torch::nn::Linear(2 * kWidth, kWidth))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return x + down(torch::gelu(up(norm(x))));
  }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
};
TORCH_MODULE(FeedForward);

// Attention and a feed-forward part; with `nested`, the feed-forward part
// is a unit of its own inside the block's.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(bool nested)
      : norm(register_module("norm", torch::nn::LayerNorm(
                                         torch::nn::LayerNormOptions({kWidth})))),
        qkv(register_module("qkv", torch::nn::Linear(kWidth, 3 * kWidth))),
        out(register_module("out", torch::nn::Linear(kWidth, kWidth))),
        feed_forward(nested ? Sharded<FeedForward>() : Sharded<FeedForward>(nullptr)),
        plain_feed_forward(nested ? FeedForward(nullptr) : FeedForward()) {
    if (nested) {
      register_module("feed_forward", feed_forward);
    } else {
      register_module("feed_forward", plain_feed_forward);
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto parts = qkv(norm(x)).chunk(3, -1);
    auto scores = torch::matmul(parts[0], parts[1].transpose(-2, -1)) / std::sqrt(kWidth);
    auto attended = x + out(torch::matmul(scores.softmax(-1), parts[2]));
    return feed_forward.is_empty() ? plain_feed_forward(attended) : feed_forward(attended);
  }
  torch::nn::LayerNorm norm;
  torch::nn::Linear qkv, out;
  Sharded<FeedForward> feed_forward;
  FeedForward plain_feed_forward;
};
TORCH_MODULE(Block);

struct TinyTransformerImpl : torch::nn::Module {
  explicit TinyTransformerImpl(bool nested)
      : embedding(register_module("embedding", torch::nn::Embedding(kVocabulary, kWidth))),
        final_norm(register_module("final_norm", torch::nn::LayerNorm(
                                                     torch::nn::LayerNormOptions({kWidth})))) {
    for (int i = 0; i < 3; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), Sharded<Block>(nested)));
    }
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto x = embedding(tokens);
    gathered_after_block.clear();
    for (auto& block : blocks) {
      x = block(x);
      gathered_after_block.push_back(blocks.front()->qkv->weight.numel());
    }
    // The output layer is the embedding's weight (tied, both in the root).
    return torch::matmul(final_norm(x), embedding->weight.t());
  }
  torch::nn::Embedding embedding;
  torch::nn::LayerNorm final_norm;
  std::vector<Sharded<Block>> blocks;
  // After each block's forward, the elements that block0's qkv weight then
  // holds: what the wrapper gathered and freed.
  std::vector<int64_t> gathered_after_block;
};
TORCH_MODULE(TinyTransformer);

inline std::pair<torch::Tensor, torch::Tensor> token_batch(int64_t step) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  auto tokens = at::randint(kVocabulary, {kSamples, kTokens}, generator);
  auto targets = at::randint(kVocabulary, {kSamples, kTokens}, generator);
  return {tokens, targets};
}

/// A `Model` made under `seed`, in float64: a test's reference and its
/// sharded model start from the same values.
template <typename Model, typename... Args>
Model float64_model(uint64_t seed, Args&&... args) {
  torch::manual_seed(seed);
  Model model(std::forward<Args>(args)...);
  model->to(torch::kDouble);
  return model;
}

/// A `Model` made under `seed` in float64 from the start (torch's default
/// dtype set around the build): a sharded build (build_sharded), which a
/// conversion afterwards would not reach, and its reference.
template <typename Model, typename... Args>
Model built_in_float64(uint64_t seed, Args&&... args) {
  auto previous = torch::get_default_dtype();
  torch::set_default_dtype(caffe2::TypeMeta::Make<double>());
  torch::manual_seed(seed);
  try {
    Model model(std::forward<Args>(args)...);
    torch::set_default_dtype(previous);
    return model;
  } catch (...) {
    torch::set_default_dtype(previous);
    throw;
  }
}

/// Expects `actual` (FullyShardedDataParallel::full_parameters) to hold
/// every parameter of `reference`, each within float64 rounding of it.
inline void expect_close_parameters(const torch::OrderedDict<std::string, torch::Tensor>& actual,
                                    torch::nn::Module& reference, const std::string& what) {
  auto expected = reference.named_parameters();
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (const auto& item : expected) {
    ASSERT_TRUE(actual.contains(item.key())) << what << ": " << item.key();
    EXPECT_TRUE(torch::allclose(actual[item.key()], item.value(), 0, kFloat64Tolerance))
        << what << ": " << item.key() << " differs by "
        << (actual[item.key()] - item.value()).abs().max().item<double>();
  }
}

inline torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocabulary}),
                                              targets.reshape({-1}));
}

/// Steps [first, last) of `model` trained on the whole batch in one process.
inline void train_alone(TinyTransformer& model, torch::optim::Optimizer& optimizer,
                        int64_t first, int64_t last) {
  for (int64_t step = first; step < last; ++step) {
    auto [tokens, targets] = token_batch(step);
    optimizer.zero_grad();
    loss_of(model(tokens), targets).backward();
    optimizer.step();
  }
}

/// The same steps on `rank`'s share of each batch, through `fsdp`.
inline void train_sharded(FullyShardedDataParallel<TinyTransformer>& fsdp,
                          torch::optim::Optimizer& optimizer, int64_t first, int64_t last,
                          int rank, int ranks) {
  int64_t share = kSamples / ranks;
  for (int64_t step = first; step < last; ++step) {
    auto [tokens, targets] = token_batch(step);
    optimizer.zero_grad();
    loss_of(fsdp(tokens.narrow(0, rank * share, share)), targets.narrow(0, rank * share, share))
        .backward();
    optimizer.step();
  }
}

} // namespace lockstep::testing::tiny
