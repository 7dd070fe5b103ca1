// A small ResNet trained on MNIST: single.cpp in one process with plain
// LibTorch, ddp.cpp data-parallel with lockstep. The lines that differ
// between the two twins are the whole port (docs/examples.md).
//
//   resnet_single --data data/mnist --epochs 2
//   lockstep-run --nproc-per-node 2 -- resnet_ddp --data data/mnist --epochs 2
//
// Its BatchNorms are typed fields, as most C++ models declare them; Adam
// with a learning rate that a StepLR halves after each epoch.

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <string>

#include <torch/torch.h>

using BatchNorm = torch::nn::BatchNorm2d;

struct Flags {
  std::string data = "data/mnist";
  int64_t epochs = 2;
  int64_t batch_size = 64;
  int64_t max_steps = 0;     // per epoch; 0: the whole epoch
  int64_t test_samples = 0;  // 0: the whole test set
};

Flags parse(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string name = argv[i];
    std::string value = argv[i + 1];
    if (name == "--data") {
      flags.data = value;
    } else if (name == "--epochs") {
      flags.epochs = std::stoll(value);
    } else if (name == "--batch-size") {
      flags.batch_size = std::stoll(value);
    } else if (name == "--max-steps") {
      flags.max_steps = std::stoll(value);
    } else if (name == "--test-samples") {
      flags.test_samples = std::stoll(value);
    } else {
      throw std::invalid_argument("unknown flag " + name);
    }
  }
  return flags;
}

struct BasicBlockImpl : torch::nn::Module {
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride) {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3)
                                                           .stride(stride).padding(1).bias(false)));
    bn1 = register_module("bn1", BatchNorm(out));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(out, out, 3)
                                                           .padding(1).bias(false)));
    bn2 = register_module("bn2", BatchNorm(out));
    if (stride != 1 || in != out) {
      shortcut = register_module("shortcut", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1)
                                                                   .stride(stride).bias(false)));
      shortcut_bn = register_module("shortcut_bn", BatchNorm(out));
    }
  }

  torch::Tensor forward(const torch::Tensor& x) {
    auto y = bn2(conv2(torch::relu(bn1(conv1(x)))));
    return torch::relu(y + (shortcut ? shortcut_bn(shortcut(x)) : x));
  }

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, shortcut{nullptr};
  BatchNorm bn1{nullptr}, bn2{nullptr}, shortcut_bn{nullptr};
};
TORCH_MODULE(BasicBlock);

struct ResNetImpl : torch::nn::Module {
  ResNetImpl() {
    stem = register_module("stem", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3)
                                                         .padding(1).bias(false)));
    stem_bn = register_module("stem_bn", BatchNorm(16));
    stages = register_module("stages", torch::nn::Sequential(
        BasicBlock(16, 16, 1), BasicBlock(16, 16, 1),
        BasicBlock(16, 32, 2), BasicBlock(32, 32, 1),
        BasicBlock(32, 64, 2), BasicBlock(64, 64, 1)));
    fc = register_module("fc", torch::nn::Linear(64, 10));
  }

  torch::Tensor forward(const torch::Tensor& x) {
    auto features = stages->forward(torch::relu(stem_bn(stem(x))));
    return fc(torch::adaptive_avg_pool2d(features, {1, 1}).flatten(1));
  }

  torch::nn::Conv2d stem{nullptr};
  BatchNorm stem_bn{nullptr};
  torch::nn::Sequential stages{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ResNet);

auto mnist(const std::string& root, torch::data::datasets::MNIST::Mode mode) {
  return torch::data::datasets::MNIST(root, mode)
      .map(torch::data::transforms::Normalize<>(0.1307, 0.3081))
      .map(torch::data::transforms::Stack<>());
}

int train(int argc, char** argv) {
  Flags flags = parse(argc, argv);
  torch::manual_seed(1);
  auto& out = std::cout;
  ResNet model;
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  torch::optim::StepLR scheduler(optimizer, /*step_size=*/1, /*gamma=*/0.5);

  auto train = mnist(flags.data, torch::data::datasets::MNIST::Mode::kTrain);
  torch::data::samplers::RandomSampler sampler(train.size().value());
  auto loader = torch::data::make_data_loader(
      train, sampler, torch::data::DataLoaderOptions().batch_size(flags.batch_size));
  auto test = mnist(flags.data, torch::data::datasets::MNIST::Mode::kTest);
  torch::data::samplers::SequentialSampler test_sampler(test.size().value());
  auto test_loader = torch::data::make_data_loader(
      test, test_sampler, torch::data::DataLoaderOptions().batch_size(500));

  for (int64_t epoch = 1; epoch <= flags.epochs; ++epoch) {
    model->train();
    auto figures = torch::zeros({2}, torch::kDouble);  // loss summed, samples
    int64_t step = 0;
    for (auto& batch : *loader) {
      if (flags.max_steps > 0 && step++ == flags.max_steps) {
        break;
      }
      optimizer.zero_grad();
      auto loss = torch::cross_entropy_loss(model(batch.data), batch.target);
      loss.backward();
      optimizer.step();
      figures[0] += loss.item<double>() * batch.data.size(0);
      figures[1] += batch.data.size(0);
    }
    scheduler.step();

    torch::NoGradGuard no_grad;
    model->eval();
    auto scores = torch::zeros({2}, torch::kDouble);  // right, seen
    for (auto& batch : *test_loader) {
      if (flags.test_samples > 0 && scores[1].item<int64_t>() >= flags.test_samples) {
        break;
      }
      scores[0] += model(batch.data).argmax(1).eq(batch.target).sum().item<int64_t>();
      scores[1] += batch.data.size(0);
    }
    out << "epoch " << epoch << ": train loss "
        << (figures[0] / figures[1]).item<double>() << ", test accuracy "
        << (scores[0] / scores[1]).item<double>() * 100 << "% of "
        << scores[1].item<int64_t>() << std::endl;
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
