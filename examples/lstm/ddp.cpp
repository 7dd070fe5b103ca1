// A character-level LSTM language model trained on the GNU GPL, a text
// that every Debian ships: single.cpp in one process with plain LibTorch,
// ddp.cpp data-parallel with lockstep. The lines that differ between the
// two twins are the whole port (docs/examples.md).
//
//   lstm_single --epochs 5
//   lockstep-run --nproc-per-node 2 -- lstm_ddp --epochs 5
//
// Truncated backpropagation through time: the text is cut into parallel
// streams, read a window at a time; the hidden state carries over from one
// window to the next, detached, so that backward stops at the window's
// start. Gradients are clipped to a norm of 0.5. The last tenth of the
// text is held out.

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <tuple>

#include <torch/torch.h>

#include <lockstep/lockstep.h>

using State = std::tuple<torch::Tensor, torch::Tensor>;  // the LSTM's (h, c)

struct Flags {
  std::string text = "/usr/share/common-licenses/GPL-3";
  int64_t epochs = 5;
  int64_t streams = 16;
  int64_t window = 64;     // characters per backward
  int64_t max_steps = 0;   // per epoch; 0: the whole epoch
};

Flags parse(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string name = argv[i];
    std::string value = argv[i + 1];
    if (name == "--text") {
      flags.text = value;
    } else if (name == "--epochs") {
      flags.epochs = std::stoll(value);
    } else if (name == "--streams") {
      flags.streams = std::stoll(value);
    } else if (name == "--window") {
      flags.window = std::stoll(value);
    } else if (name == "--max-steps") {
      flags.max_steps = std::stoll(value);
    } else {
      throw std::invalid_argument("unknown flag " + name);
    }
  }
  return flags;
}

constexpr int64_t kVocabulary = 256;  // bytes

struct LanguageModelImpl : torch::nn::Module {
  explicit LanguageModelImpl(int64_t hidden)
      : embedding(register_module("embedding", torch::nn::Embedding(kVocabulary, 64))),
        lstm(register_module("lstm", torch::nn::LSTM(
                                         torch::nn::LSTMOptions(64, hidden).num_layers(2)))),
        decoder(register_module("decoder", torch::nn::Linear(hidden, kVocabulary))) {}

  // (time, stream) bytes -> (time, stream, byte) logits, and the state
  // after the window.
  std::tuple<torch::Tensor, State> forward(const torch::Tensor& x, const State& state) {
    auto [output, next] = lstm(embedding(x), state);
    return {decoder(output), next};
  }

  State zero_state(int64_t streams) const {
    auto zeros = torch::zeros({2, streams, lstm->options.hidden_size()});
    return {zeros, zeros.clone()};
  }

  torch::nn::Embedding embedding;
  torch::nn::LSTM lstm;
  torch::nn::Linear decoder;
};
TORCH_MODULE(LanguageModel);

torch::Tensor read_bytes(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (text.empty()) {
    throw std::runtime_error("no text in " + path);
  }
  return torch::from_blob(text.data(), {static_cast<int64_t>(text.size())}, torch::kUInt8)
      .to(torch::kLong);
}

// (time, stream): `streams` equal pieces of `tokens` side by side.
torch::Tensor as_streams(const torch::Tensor& tokens, int64_t streams) {
  int64_t length = tokens.numel() / streams;
  return tokens.narrow(0, 0, length * streams).view({streams, length}).t().contiguous();
}

State detached(const State& state) {
  return {std::get<0>(state).detach(), std::get<1>(state).detach()};
}

// Mean cross-entropy per byte over `data`, window by window.
double evaluate(LanguageModel& model, const torch::Tensor& data, int64_t window) {
  torch::NoGradGuard no_grad;
  model->eval();
  auto state = model->zero_state(data.size(1));
  double total = 0;
  for (int64_t start = 0; start + 1 < data.size(0); start += window) {
    int64_t length = std::min(window, data.size(0) - 1 - start);
    auto [logits, next] = model(data.narrow(0, start, length), state);
    total += torch::nn::functional::cross_entropy(
                 logits.view({-1, kVocabulary}), data.narrow(0, start + 1, length).reshape(-1),
                 torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                 .item<double>();
    state = next;
  }
  model->train();
  return total / static_cast<double>((data.size(0) - 1) * data.size(1));
}

int train(int argc, char** argv) {
  Flags flags = parse(argc, argv);
  auto world = lockstep::init();
  torch::manual_seed(1);
  auto& out = lockstep::on_rank_zero(world);
  auto tokens = read_bytes(flags.text);
  int64_t held_out = tokens.numel() / 10;
  auto train_tokens = tokens.narrow(0, 0, tokens.numel() - held_out);
  int64_t share = train_tokens.numel() / world.size();  // equal: the same steps
  train_tokens = train_tokens.narrow(0, world.rank() * share, share);
  auto train = as_streams(train_tokens, flags.streams);
  auto valid = as_streams(tokens.narrow(0, tokens.numel() - held_out, held_out), flags.streams);

  LanguageModel model(256);
  lockstep::DDP<LanguageModel> ddp(model, world);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(2e-3));

  for (int64_t epoch = 1; epoch <= flags.epochs; ++epoch) {
    auto figures = torch::zeros({2}, torch::kDouble);  // loss summed, bytes
    auto state = model->zero_state(flags.streams);
    int64_t step = 0;
    for (int64_t start = 0; start + 1 < train.size(0); start += flags.window) {
      if (flags.max_steps > 0 && step++ == flags.max_steps) {
        break;
      }
      int64_t length = std::min(flags.window, train.size(0) - 1 - start);
      optimizer.zero_grad();
      auto [logits, next] = ddp(train.narrow(0, start, length), detached(state));
      auto loss = torch::nn::functional::cross_entropy(
          logits.view({-1, kVocabulary}), train.narrow(0, start + 1, length).reshape(-1));
      loss.backward();
      torch::nn::utils::clip_grad_norm_(model->parameters(), 0.5);
      optimizer.step();
      state = next;
      figures[0] += loss.item<double>() * static_cast<double>(length * flags.streams);
      figures[1] += static_cast<double>(length * flags.streams);
    }
    world.all_reduce(figures);
    double train_loss = (figures[0] / figures[1]).item<double>();
    double valid_loss = evaluate(model, valid, flags.window);
    out << "epoch " << epoch << ": train loss " << train_loss << " nats/byte, held-out "
        << "perplexity " << std::exp(valid_loss) << std::endl;
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return train(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << argv[0] << ": " << e.what() << std::endl;
    return 1;
  }
}
