// A model built sharded (lockstep::build_sharded): each unit keeps this
// rank's shard as its constructor returns. It must start from the values
// of a plain build after the same seed, bit for bit, and train as one
// process on the whole batch; under a memory limit below the whole model's
// parameters, where a plain build fails, it must build and train; and ranks
// that build differently must be refused by name on every rank.

#include <sys/resource.h>

#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/fsdp.h>
#include <lockstep/world.h>

#include "support/expect_error.h"
#include "support/multiprocess.h"
#include "support/tiny_transformer.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

using namespace tiny;

template <typename Model, typename... Args>
Model built_sharded_in_float64(const World& world, uint64_t seed, Args&&... args) {
  ShardedConstruction construction(world);
  return built_in_float64<Model>(seed, std::forward<Args>(args)...);
}

class FsdpConstruction : public ::testing::TestWithParam<std::tuple<WorldSetup, bool>> {};

TEST_P(FsdpConstruction, StartsFromAPlainBuildsValuesAndTrainsAsOneProcess) {
  auto [setup, nested] = GetParam();
  run_ranks(setup, [&, setup = setup, nested = nested](int rank) {
    World world = init();
    auto reference = built_in_float64<TinyTransformer>(0, nested);
    auto model = built_sharded_in_float64<TinyTransformer>(world, 0, nested);
    // The units' parameters are empty from the build on; the root's
    // (the tied embedding, the final norm) are whole until the wrapper.
    for (const auto& item : model->named_parameters()) {
      bool in_unit = item.key().rfind("block", 0) == 0;
      EXPECT_EQ(item.value().numel() == 0, in_unit) << item.key();
    }
    FullyShardedDataParallel<TinyTransformer> fsdp(model, world);
    auto start = fsdp.full_parameters();
    for (const auto& item : reference->named_parameters()) {
      EXPECT_TRUE(torch::equal(start[item.key()], item.value())) << item.key();
    }
    torch::optim::Adam reference_optimizer(reference->parameters(),
                                           torch::optim::AdamOptions(1e-2));
    torch::optim::Adam optimizer(fsdp.parameters(), torch::optim::AdamOptions(1e-2));
    int64_t share = kSamples / setup.size;
    for (int64_t step = 0; step < 4; ++step) {
      auto [tokens, targets] = token_batch(step);
      reference_optimizer.zero_grad();
      loss_of(reference(tokens), targets).backward();
      reference_optimizer.step();
      optimizer.zero_grad();
      loss_of(fsdp(tokens.narrow(0, rank * share, share)),
              targets.narrow(0, rank * share, share))
          .backward();
      optimizer.step();
      expect_close_parameters(fsdp.full_parameters(), *reference,
                              "step " + std::to_string(step));
    }
  });
}

std::vector<WorldSetup> two_three_and_four_ranks_over_shared_memory() {
  return {{2, "shm"}, {3, "shm"}, {4, "shm"}, {3, "gloo"}};
}

INSTANTIATE_TEST_SUITE_P(
    WorldSizeAndNesting,
    FsdpConstruction,
    ::testing::Combine(::testing::ValuesIn(two_three_and_four_ranks_over_shared_memory()),
                       ::testing::Bool()),
    [](const auto& info) {
      return std::get<0>(info.param).name() + (std::get<1>(info.param) ? "_nested" : "_flat");
    });

// Layers of Linear(kWide, kWide), each a unit, then a head in the root.
constexpr int64_t kWide = 1024;
constexpr int64_t kLayers = 48; // 384 MiB of float64 parameters

struct WideImpl : torch::nn::Module {
  WideImpl() {
    for (int64_t i = 0; i < kLayers; ++i) {
      layers.push_back(register_module("layer" + std::to_string(i),
                                       Sharded<torch::nn::Linear>(kWide, kWide)));
    }
    head = register_module("head", torch::nn::Linear(kWide, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : layers) {
      x = torch::tanh(layer(x));
    }
    return head(x);
  }
  std::vector<Sharded<torch::nn::Linear>> layers;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Wide);

int64_t virtual_memory_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmSize:", 0) == 0) {
      return std::stoll(line.substr(7)) * 1024;
    }
  }
  return 0;
}

// Each rank's address space is limited to what it uses before the model
// plus 80% of the model's parameters: a plain build cannot fit, the sharded
// one (a quarter of the parameters and of their gradients, a unit or two
// gathered) must. The limit is then lifted, and the rank checks what it
// trained against the one-process reference. The ranks map every block of
// 1 MiB or more on its own (docs/ddp.md, "A model larger than one rank"):
// in glibc's heap, a freed unit leaves a hole that the next one, aligned,
// does not quite fit, and the address space grows by a unit each time.
TEST(FsdpConstructionUnderALimit, AModelLargerThanARankBuildsAndTrainsAsOneProcess) {
  LaunchOptions options;
  options.world_size = 4;
  options.timeout = std::chrono::seconds(240);
  options.environment = [](int, RankEnvironment& env) {
    env["LOCKSTEP_TRANSPORT"] = "shm";
    env["GLIBC_TUNABLES"] = "glibc.malloc.mmap_threshold=1048576";
    // Debian 13's LibTorch loads UCX, whose memory hooks (libucm) retry a
    // brk that the limit refuses instead of failing it: off.
    env["UCX_MEM_EVENTS"] = "no";
  };
  auto result = launch_ranks(
      options,
      [](int rank) {
        World world = init();
        // One thread of ATen's a rank (4 ranks share the machine), and what
        // the step's machinery costs before the limit is read: the
        // transport's threads, the first matmul.
        at::set_num_threads(1);
        {
          // A product of the layers' size in float64: OpenBLAS makes its
          // buffers at the first, and in Debian 13's LibTorch a failed brk
          // under the limit spins in UCX's memory hooks (libucm) rather
          // than fail.
          auto warm = torch::randn({16, kWide}, torch::dtype(torch::kDouble).requires_grad(true));
          auto weight = torch::randn({kWide, kWide}, torch::kDouble);
          torch::matmul(warm, weight).sum().backward();
          world.barrier();
        }
        const int64_t parameters = kLayers * (kWide * kWide + kWide) * 8;
        rlimit limit{};
        getrlimit(RLIMIT_AS, &limit);
        const rlimit unlimited = limit;
        limit.rlim_cur = static_cast<rlim_t>(virtual_memory_bytes() + parameters * 8 / 10);
        ASSERT_EQ(setrlimit(RLIMIT_AS, &limit), 0);
        // The limit binds: the whole model does not fit.
        EXPECT_THROW(built_in_float64<Wide>(0), std::exception);

        auto model = built_sharded_in_float64<Wide>(world, 0);
        FullyShardedDataParallel<Wide> fsdp(model, world);
        torch::optim::SGD optimizer(fsdp.parameters(), torch::optim::SGDOptions(0.1));
        constexpr int64_t kBatch = 16;
        const int64_t share = kBatch / world.size();
        auto generator = at::make_generator<at::CPUGeneratorImpl>(7);
        auto inputs = at::randn({5, kBatch, kWide}, generator, at::kDouble);
        auto targets = at::randint(10, {5, kBatch}, generator);
        for (int64_t step = 0; step < 5; ++step) {
          optimizer.zero_grad();
          torch::cross_entropy_loss(fsdp(inputs[step].narrow(0, rank * share, share)),
                                    targets[step].narrow(0, rank * share, share))
              .backward();
          optimizer.step();
        }

        ASSERT_EQ(setrlimit(RLIMIT_AS, &unlimited), 0);
        auto reference = built_in_float64<Wide>(0);
        torch::optim::SGD reference_optimizer(reference->parameters(),
                                              torch::optim::SGDOptions(0.1));
        for (int64_t step = 0; step < 5; ++step) {
          reference_optimizer.zero_grad();
          torch::cross_entropy_loss(reference(inputs[step]), targets[step]).backward();
          reference_optimizer.step();
        }
        expect_close_parameters(fsdp.full_parameters(), *reference, "after 5 steps");
      });
  EXPECT_TRUE(result.ok()) << result.report();
}

// Ranks that build the units differently are refused, on every rank, by
// name: another seed, a build in full beside a sharded one, a conversion
// after the build, a construction for another world.
TEST(FsdpConstructionErrors, RanksThatBuildDifferentlyAreRefusedByNameOnEveryRank) {
  run_ranks(3, [](int rank) {
    World world = init();
    {
      auto model = built_sharded_in_float64<TinyTransformer>(world, rank == 2 ? 1 : 0, false);
      expect_error<ConfigError>(
          [&] { FullyShardedDataParallel<TinyTransformer> fsdp(model, world); },
          {"the ranks built unit block0 differently", "ranks 0 1: with the values of checksum",
           "ranks 2: with the values of checksum", "seed every rank alike"});
    }
    {
      auto model = rank == 1 ? built_in_float64<TinyTransformer>(0, false)
                             : built_sharded_in_float64<TinyTransformer>(world, 0, false);
      expect_error<ConfigError>(
          [&] { FullyShardedDataParallel<TinyTransformer> fsdp(model, world); },
          {"the ranks built unit block0 differently", "ranks 1: built in full"});
    }
    {
      auto model = built_sharded_in_float64<TinyTransformer>(world, 0, false);
      model->to(torch::kFloat);
      expect_error<ConfigError>(
          [&] { FullyShardedDataParallel<TinyTransformer> fsdp(model, world); },
          {"unit block0 changed after it was built under a ShardedConstruction",
           "torch::set_default_dtype"});
    }
    {
      // A checkpoint loaded into the module before the wrapper.
      auto model = built_sharded_in_float64<TinyTransformer>(world, 0, false);
      torch::NoGradGuard no_grad;
      model->blocks[0]->qkv->weight.set_data(torch::ones({3 * kWidth, kWidth}, torch::kDouble));
      expect_error<ConfigError>(
          [&] { FullyShardedDataParallel<TinyTransformer> fsdp(model, world); },
          {"unit block0 changed after it was built under a ShardedConstruction",
           "given values such as a checkpoint's"});
    }
    {
      auto pair = split(world, rank == 2 ? 1 : 0);
      auto model = built_sharded_in_float64<TinyTransformer>(pair, 0, false);
      expect_error<ConfigError>(
          [&] { FullyShardedDataParallel<TinyTransformer> fsdp(model, world); },
          {"unit block0 was built under a ShardedConstruction for shards of 2 ranks (as rank 0 "
           "of them) and is sharded over 3 (rank 0 as rank 0 of them)"});
    }
    ShardedConstruction construction(world);
    expect_error<UsageError>([&] { ShardedConstruction again(world); },
                             {"a ShardedConstruction lives already on this thread"});
  });
}

} // namespace
} // namespace lockstep::testing
