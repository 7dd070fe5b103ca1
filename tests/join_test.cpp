// Uneven inputs: ranks with 3, 5 and 8 batches train inside a join guard.
// The reference is computed by hand in one process: at each step, the
// summed gradients of the ranks that still have a batch, divided as
// JoinOptions says, applied by the same optimizer. Float64, so "the same"
// is exact in kind (kFloat64Tolerance); at the end every rank holds the
// same bits.

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "support/expect_error.h"
#include "support/models.h"
#include "support/multiprocess.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

// Batches per rank: the longest on a rank other than 0, and at 4 ranks two
// ranks that finish last together.
int64_t batches_of(int rank, int world_size) {
  static const std::vector<int64_t> two{3, 8};
  static const std::vector<int64_t> more{3, 5, 8, 8};
  return (world_size == 2 ? two : more)[static_cast<size_t>(rank)];
}

// Rank `rank`'s batch `step`, in float64: 4 rows of 20 inputs, 5 targets.
std::pair<torch::Tensor, torch::Tensor> batch_of(int rank, int64_t step) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 * (rank + 1) + step);
  auto x = at::randn({4, 20}, generator).to(torch::kDouble);
  auto y = at::randn({4, 5}, generator).to(torch::kDouble);
  return {x, y};
}

enum class Case { Plain, DivideByActive, Unused, BatchNorm, NoSync };

struct JoinCase {
  int world_size = 2;
  Case kind = Case::Plain;
};

std::string case_name(const ::testing::TestParamInfo<JoinCase>& info) {
  static const char* names[] = {"plain", "divide_by_active", "unused_parameters", "batch_norm",
                                "no_sync"};
  return std::string(names[static_cast<int>(info.param.kind)]) + "_world" +
      std::to_string(info.param.world_size);
}

std::vector<JoinCase> every_case() {
  std::vector<JoinCase> cases;
  for (Case kind : {Case::Plain, Case::DivideByActive, Case::Unused, Case::BatchNorm,
                    Case::NoSync}) {
    for (int size : {2, 3, 4}) {
      cases.push_back({size, kind});
    }
  }
  return cases;
}

class Join : public ::testing::TestWithParam<JoinCase> {};
INSTANTIATE_TEST_SUITE_P(Cases, Join, ::testing::ValuesIn(every_case()), case_name);

/// Linear -> BatchNorm1d -> ReLU -> Linear, or one of three heads chosen
/// per rank and step (unused parameters that change), by `kind`.
struct JoinModelImpl : torch::nn::Module {
  explicit JoinModelImpl(Case kind_in) : kind(kind_in) {
    trunk = register_module("trunk", torch::nn::Linear(20, 16));
    if (kind == Case::BatchNorm) {
      norm = register_module("norm", torch::nn::BatchNorm1d(16));
    }
    for (int h = 0; h < 3; ++h) {
      heads.push_back(register_module("head" + std::to_string(h), torch::nn::Linear(16, 5)));
    }
  }
  torch::Tensor forward(torch::Tensor x, int64_t head) {
    x = trunk(x);
    if (norm) {
      x = norm(x);
    }
    x = torch::relu(x);
    return heads[static_cast<size_t>(kind == Case::Unused ? head % 3 : 0)](x);
  }
  Case kind;
  torch::nn::Linear trunk{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
  std::vector<torch::nn::Linear> heads;
};
TORCH_MODULE(JoinModel);

// The reference's buffers (BatchNorm's running statistics) follow the
// wrapper's rule: before each forward, every rank takes those of the lowest
// rank still training; at the end, those of the lowest of the last ranks.
void set_buffers(torch::nn::Module& module, const std::vector<torch::Tensor>& values) {
  torch::NoGradGuard no_grad;
  auto buffers = module.buffers();
  for (size_t i = 0; i < buffers.size(); ++i) {
    buffers[i].copy_(values[i]);
  }
}
std::vector<torch::Tensor> copy_buffers(torch::nn::Module& module) {
  std::vector<torch::Tensor> out;
  for (const auto& buffer : module.buffers()) {
    out.push_back(buffer.clone());
  }
  return out;
}

TEST_P(Join, RanksWithUnevenBatchesMatchTheAveragedGradientsByHand) {
  JoinCase setup = GetParam();
  run_ranks(setup.world_size, [setup](int rank) {
    World world = init();
    int n = world.size();
    Case kind = setup.kind;
    torch::manual_seed(5);
    JoinModel model(kind);
    torch::manual_seed(5);
    JoinModel reference(kind);
    model->to(torch::kDouble);
    reference->to(torch::kDouble);
    DDP<JoinModel> ddp(model, world);
    auto options = torch::optim::SGDOptions(0.1).momentum(0.9);
    torch::optim::SGD optimizer(model->parameters(), options);
    torch::optim::SGD reference_optimizer(reference->parameters(), options);
    auto join_options = JoinOptions()
                            .divide_by_initial_world_size(kind != Case::DivideByActive)
                            .optimizers({&optimizer});

    int64_t mine = batches_of(rank, n);
    int64_t longest = 0;
    for (int r = 0; r < n; ++r) {
      longest = std::max(longest, batches_of(r, n));
    }
    // Through the wrapper (net == nullptr) or the reference.
    auto loss_of = [&](JoinModel* net, int r, int64_t step, bool second_half) {
      auto [x, y] = batch_of(r, step);
      x = x.narrow(0, second_half ? 2 : 0, kind == Case::NoSync ? 2 : 4);
      y = y.narrow(0, second_half ? 2 : 0, kind == Case::NoSync ? 2 : 4);
      return torch::mse_loss(net ? (*net)(x, r + step) : ddp(x, r + step), y);
    };
    {
      auto join = ddp.join(join_options);
      for (int64_t step = 0; step < mine; ++step) {
        optimizer.zero_grad();
        if (kind == Case::NoSync) {
          auto guard = ddp.no_sync();
          loss_of(nullptr, rank, step, false).backward();
        }
        loss_of(nullptr, rank, step, kind == Case::NoSync).backward();
        optimizer.step();
      }
    }
    EXPECT_EQ(ddp.stats().total.join_agreements,
              longest * (kind == Case::NoSync ? 2 : 1) + 1)
        << "one agreement per forward of the longest rank, and the last one that finds "
           "no rank training";

    // Each rank's buffers after its forward; before the next, every rank
    // takes those of the lowest rank that still trains then.
    std::vector<std::vector<torch::Tensor>> after_forward(n, copy_buffers(*reference));
    std::vector<torch::Tensor> buffers;
    for (int64_t step = 0; step < longest; ++step) {
      std::vector<int> active;
      for (int r = 0; r < n; ++r) {
        if (step < batches_of(r, n)) {
          active.push_back(r);
        }
      }
      buffers = after_forward[active.front()];
      double divisor = kind == Case::DivideByActive ? active.size() : n;
      reference_optimizer.zero_grad();
      for (int r : active) {
        set_buffers(*reference, buffers);
        auto loss = loss_of(&reference, r, step, false);
        if (kind == Case::NoSync) {
          loss = loss + loss_of(&reference, r, step, true);
        }
        (loss / divisor).backward();
        after_forward[r] = copy_buffers(*reference);
      }
      reference_optimizer.step();
      if (step + 1 == longest) {
        buffers = after_forward[active.front()]; // the end of the join
      }
    }
    set_buffers(*reference, buffers);
    expect_close_parameters(*model, *reference, kFloat64Tolerance, "at the end of the join");
    for (size_t i = 0; i < buffers.size(); ++i) {
      EXPECT_TRUE(model->buffers()[i].to(torch::kDouble).allclose(
          buffers[i].to(torch::kDouble), kFloat64Tolerance, kFloat64Tolerance))
          << "buffer " << i;
    }
    std::vector<torch::Tensor> state = model->parameters();
    for (const auto& buffer : model->buffers()) {
      state.push_back(buffer);
    }
    expect_same_on_every_rank(world, flatten(state), "parameters and buffers");
    ddp.check_replicas();

    // Training goes on as before the guard: the momentum of the ranks that
    // ran out was brought up to date too.
    optimizer.zero_grad();
    loss_of(nullptr, rank, 100, false).backward();
    optimizer.step();
    ddp.check_replicas();
  });
}

TEST(JoinErrors, EarlyTerminationNamesTheRanksThatRanOutOnEveryRank) {
  run_ranks(3, [](int rank) {
    World world = init();
    torch::manual_seed(3);
    Mlp model;
    DDP<Mlp> ddp(model, world);
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    int64_t mine = batches_of(rank, 3);
    std::string message;
    try {
      auto join = ddp.join(JoinOptions().throw_on_early_termination(true));
      for (int64_t step = 0; step < mine; ++step) {
        auto [x, y] = batch_of(rank, step);
        optimizer.zero_grad();
        torch::mse_loss(ddp(x.to(torch::kFloat)), y.to(torch::kFloat)).backward();
        optimizer.step();
      }
      join.finish();
    } catch (const UsageError& e) {
      message = e.what();
    }
    EXPECT_NE(message.find("rank 0 ran out of batches before forward 4 while ranks 1, 2 "
                           "still had some"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("throw_on_early_termination"), std::string::npos) << message;
  });
}

TEST(JoinErrors, AModelWithSyncBatchNormIsRefused) {
  run_ranks(2, [](int) {
    World world = init();
    auto model = torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::BatchNorm1d(4));
    convert_sync_batchnorm(*model, world);
    DDP<torch::nn::Sequential> ddp(model, world);
    expect_error<UsageError>([&] { auto join = ddp.join(); },
                             {"a join guard cannot keep a model with SyncBatchNorm in step"});
  });
}

TEST(JoinErrors, WithoutAGuardARankThatRanOutIsNamed) {
  // What uneven batches do without a join guard: a named error at once,
  // not a hang (early_finish_test.cpp covers it further).
  auto result = launch_ranks({2, std::chrono::milliseconds(60000), {}}, [](int rank) {
    World world = init();
    torch::manual_seed(3);
    Mlp model;
    DDP<Mlp> ddp(model, world);
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    for (int64_t step = 0; step < batches_of(rank, 2); ++step) {
      auto [x, y] = batch_of(rank, step);
      optimizer.zero_grad();
      torch::mse_loss(ddp(x.to(torch::kFloat)), y.to(torch::kFloat)).backward();
      optimizer.step();
    }
  });
  if (in_rank_process()) {
    return;
  }
  ASSERT_EQ(result.ranks.size(), 2u);
  EXPECT_EQ(result.ranks[0].exit_code, 0) << result.report();
  EXPECT_NE(result.ranks[1].exit_code, 0) << result.report();
  EXPECT_NE(result.ranks[1].output.find("rank 0 closed its world"), std::string::npos)
      << result.report();
  EXPECT_NE(result.ranks[1].output.find("ddp.join()"), std::string::npos) << result.report();
  EXPECT_LT(result.elapsed, std::chrono::milliseconds(30000));
}

} // namespace
} // namespace lockstep::testing
