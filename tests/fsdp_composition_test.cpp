// Where FullyShardedDataParallel meets the other features: a GradScaler
// whose inf lands in one rank's shard, checkpoints of a decayed learning
// rate, gradient accumulation, units that a model calls around their
// holders, parameters that no rank uses, frozen parameters, a forward
// order unlike the registration order, and FSDP's own mixed precision.
// Each against one process (float64) or a loop written by hand (16 bits).

#include <limits>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/fsdp.h>
#include <lockstep/grad_scaler.h>
#include <lockstep/world.h>

#include "support/expect_error.h"
#include "support/multiprocess.h"
#include "support/scratch_folder.h"
#include "support/shared_folder.h"
#include "support/tiny_transformer.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

using namespace tiny;

constexpr int64_t kPairWidth = 6;

// Two layers and a residual; `extra` is a trainable layer that forward
// never uses (with `unused`); with `frozen`, the first layer is frozen.
struct PairImpl : torch::nn::Module {
  PairImpl(bool frozen, bool unused)
      : first(register_module("first", torch::nn::Linear(kPairWidth, kPairWidth))),
        second(register_module("second", torch::nn::Linear(kPairWidth, kPairWidth))) {
    if (unused) {
      extra = register_module("extra", torch::nn::Linear(kPairWidth, kPairWidth));
    }
    if (frozen) {
      for (auto& param : first->parameters()) {
        param.set_requires_grad(false);
      }
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x + second(torch::tanh(first(x)));
  }
  torch::nn::Linear first, second;
  torch::nn::Linear extra{nullptr};
};
TORCH_MODULE(Pair);

// Three units, and a head and a side branch in the root. `odd` names the
// block that is frozen in part or holds an unused layer; `reversed` runs the
// blocks last first; with `frozen_first`, the block that runs first is
// frozen whole, so that the frozen block after it gets an input that
// requires no grad. During backward, the hook on each block's output
// records which blocks are then gathered: the gradient of a block's output
// comes once the block that consumed it has finished its backward, which
// must have freed it. The side branch, computed before the blocks, runs its
// backward after theirs: its hook records every block.
struct StackImpl : torch::nn::Module {
  StackImpl(bool frozen, bool unused, bool reversed, bool frozen_first = false)
      : reversed(reversed) {
    for (int i = 0; i < 3; ++i) {
      bool odd = i == 1;
      bool first = i == (reversed ? 2 : 0);
      blocks.push_back(register_module("block" + std::to_string(i),
                                       Sharded<Pair>(odd && frozen, odd && unused)));
      if (first && frozen_first) {
        for (auto& param : blocks.back()->parameters()) {
          param.set_requires_grad(false);
        }
      }
    }
    head = register_module("head", torch::nn::Linear(kPairWidth, 3));
    side = register_module("side", torch::nn::Linear(kPairWidth, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto beside = side(x);
    beside.register_hook([this](const torch::Tensor&) {
      for (size_t block = 0; block < blocks.size(); ++block) {
        freed_after_backward_of.push_back({block, blocks[block]->second->weight.numel() == 0});
      }
    });
    std::vector<size_t> order{0, 1, 2};
    if (reversed) {
      order = {2, 1, 0};
    }
    for (size_t i = 0; i < order.size(); ++i) {
      x = blocks[order[i]](x);
      if (i + 1 < order.size() && x.requires_grad()) {
        size_t consumer = order[i + 1];
        x.register_hook([this, consumer](const torch::Tensor&) {
          freed_after_backward_of.push_back(
              {consumer, blocks[consumer]->second->weight.numel() == 0});
        });
      }
    }
    return head(x) + beside;
  }
  bool reversed;
  std::vector<Sharded<Pair>> blocks;
  torch::nn::Linear head{nullptr};
  torch::nn::Linear side{nullptr};
  // (block, whether it was freed) when its backward had sent its input's
  // gradient on.
  std::vector<std::pair<size_t, bool>> freed_after_backward_of;
};
TORCH_MODULE(Stack);

Stack float64_stack(bool frozen, bool unused, bool reversed, bool frozen_first = false) {
  torch::manual_seed(3);
  Stack stack(frozen, unused, reversed, frozen_first);
  stack->to(torch::kDouble);
  return stack;
}

std::vector<torch::Tensor> trainable(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> kept;
  for (const auto& param : params) {
    if (param.requires_grad()) {
      kept.push_back(param);
    }
  }
  return kept;
}

// Step `step` of `reference` (a module holder) on the whole batch: float64,
// 3 targets. Returns this rank's share of that batch, `per_rank` samples.
template <typename Reference>
std::pair<torch::Tensor, torch::Tensor> step_reference_and_share(
    Reference& reference, torch::optim::Optimizer& optimizer, int64_t step, int64_t per_rank,
    int ranks, int rank) {
  auto [x, y] = global_batch(step, per_rank * ranks, {kPairWidth});
  x = x.to(torch::kDouble);
  y = y.narrow(1, 0, 3).to(torch::kDouble);
  optimizer.zero_grad();
  torch::mse_loss(reference(x), y).backward();
  optimizer.step();
  return {x.narrow(0, rank * per_rank, per_rank), y.narrow(0, rank * per_rank, per_rank)};
}

struct StackCase {
  bool frozen = false;
  bool unused = false;
  bool reversed = false;
  bool frozen_first = false;
  std::string name;
};
void PrintTo(const StackCase& c, std::ostream* out) {
  *out << c.name;
}

class FsdpUnits : public ::testing::TestWithParam<std::tuple<WorldSetup, StackCase>> {};

// A unit with a frozen or an unused parameter, or units run in another
// order than registered, cost no more memory than the rest: each is freed
// once its backward is over (from the second step on, once the ranks agree
// on the forward order). And the training is one process's: a parameter
// that no rank used gets no gradient, so that Adam leaves it alone.
TEST_P(FsdpUnits, AreFreedAfterTheirBackwardAndTrainAsOneProcess) {
  auto [setup, c] = GetParam();
  run_ranks(setup, [&, setup = setup, c = c](int rank) {
    World world = init();
    auto reference = float64_stack(c.frozen, c.unused, c.reversed, c.frozen_first);
    auto model = float64_stack(c.frozen, c.unused, c.reversed, c.frozen_first);
    FullyShardedDataParallel<Stack> fsdp(model, world);
    torch::optim::Adam reference_optimizer(trainable(reference->parameters()),
                                           torch::optim::AdamOptions(0.01));
    torch::optim::Adam optimizer(trainable(fsdp.parameters()), torch::optim::AdamOptions(0.01));
    for (int64_t step = 0; step < 4; ++step) {
      auto [x, y] = step_reference_and_share(reference, reference_optimizer, step,
                                             /*per_rank=*/2, setup.size, rank);
      optimizer.zero_grad();
      model->freed_after_backward_of.clear();
      torch::mse_loss(fsdp(x), y).backward();
      if (step > 0 || !c.reversed) {
        // Two blocks' outputs feed a block, unless the first is frozen
        // whole; then the side branch's hook sees all three.
        ASSERT_EQ(model->freed_after_backward_of.size(), (c.frozen_first ? 1u : 2u) + 3u);
        for (const auto& [block, freed] : model->freed_after_backward_of) {
          EXPECT_TRUE(freed) << "block" << block << " still gathered after its backward, step "
                             << step;
        }
      }
      optimizer.step();
      auto full = fsdp.full_parameters();
      expect_close_parameters(full, *reference, "step " + std::to_string(step));
    }
    if (c.unused) {
      for (const auto& item : fsdp.named_parameters()) {
        if (item.key().find("extra") != std::string::npos) {
          EXPECT_FALSE(item.value().grad().defined()) << item.key() << " got a gradient";
        }
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Cases, FsdpUnits,
    ::testing::Combine(::testing::ValuesIn(two_and_three_rank_setups()),
                       ::testing::Values(StackCase{true, false, false, false, "frozen"},
                                         StackCase{false, true, false, false, "unused"},
                                         StackCase{false, false, true, false, "reversed"},
                                         StackCase{true, true, true, false, "all"},
                                         StackCase{true, false, false, true, "fed_by_frozen"},
                                         StackCase{true, true, true, true, "all_fed_by_frozen"})),
    [](const auto& info) {
      return std::get<0>(info.param).name() + "_" + std::get<1>(info.param).name;
    });

// Ways a unit with a frozen layer is read after its trainable gradients
// are in, where no hook on its tensor arguments sees it: the frozen layer
// reads a tensor handed in a struct, or one the unit holds (set before the
// call), computed from the root's trainable layer, or the root's parameter
// itself; or a checkpoint recomputes the unit inside backward. The frozen
// layer ran first, so its backward comes after the trainable layer's
// gradient: a unit freed then would compute on freed memory. Each stays
// gathered to the end of backward, and trains as one process. So does a
// unit called without autograd and never recomputed (its parameters get no
// gradient, as in one process).
struct TwoInputs {
  torch::Tensor through_frozen;
  torch::Tensor through_trainable;
};
struct TwoPathsImpl : torch::nn::Module {
  TwoPathsImpl()
      : frozen(register_module("frozen", torch::nn::Linear(kPairWidth, kPairWidth))),
        trainable(register_module("trainable", torch::nn::Linear(kPairWidth, kPairWidth))) {
    for (auto& param : frozen->parameters()) {
      param.set_requires_grad(false);
    }
  }
  torch::Tensor forward(const TwoInputs& inputs) {
    // In this order (the operands of + could run in either): the frozen
    // layer's node is made first, so the backward runs it last.
    auto through_frozen = frozen(inputs.through_frozen);
    auto through_trainable = trainable(inputs.through_trainable);
    return through_frozen + through_trainable;
  }
  torch::nn::Linear frozen, trainable;
};
TORCH_MODULE(TwoPaths);

// Reads `held` (set by the caller) through the frozen layer.
struct HeldInputImpl : torch::nn::Module {
  HeldInputImpl() : paths(register_module("paths", TwoPaths())) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return paths(TwoInputs{held, x});
  }
  TwoPaths paths;
  torch::Tensor held;
};
TORCH_MODULE(HeldInput);

// Activation checkpointing by hand: the unit runs without autograd in
// forward and again inside backward. (On one process each rank's own.)
Sharded<Pair> recomputed_unit{nullptr};
struct Recompute : torch::autograd::Function<Recompute> {
  static torch::Tensor forward(torch::autograd::AutogradContext* context, torch::Tensor x) {
    context->save_for_backward({x});
    return recomputed_unit(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                 torch::autograd::variable_list grads) {
    auto x = context->get_saved_variables()[0].detach().requires_grad_(true);
    torch::AutoGradMode with_grad(true);
    torch::autograd::backward({recomputed_unit(x)}, {grads[0]});
    return {x.grad()};
  }
};

enum class LateRead { StructInput, HeldTensor, HeldParameter, Recomputed, WithoutAutograd };

struct ReadLateModelImpl : torch::nn::Module {
  explicit ReadLateModelImpl(LateRead way)
      : way(way),
        before(register_module("before", torch::nn::Linear(kPairWidth, kPairWidth))),
        head(register_module("head", torch::nn::Linear(kPairWidth, 3))),
        scale(register_parameter("scale", torch::randn({1, kPairWidth}))) {
    if (way == LateRead::StructInput) {
      paths = register_module("paths", Sharded<TwoPaths>());
    } else if (way == LateRead::HeldTensor || way == LateRead::HeldParameter) {
      held = register_module("held", Sharded<HeldInput>());
    } else {
      pair = register_module("pair", Sharded<Pair>(/*frozen=*/true, /*unused=*/false));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    switch (way) {
      case LateRead::StructInput:
        return head(paths(TwoInputs{before(x), x}));
      case LateRead::HeldTensor:
        held->held = before(x);
        return head(held(x));
      case LateRead::HeldParameter:
        held->held = scale;
        return head(held(before(x)));
      case LateRead::Recomputed:
        recomputed_unit = pair;
        return head(Recompute::apply(before(x)));
      case LateRead::WithoutAutograd: {
        torch::Tensor constant;
        {
          torch::NoGradGuard no_grad;
          constant = pair(x);
        }
        return head(before(x) + constant);
      }
    }
    return {};
  }
  LateRead way;
  torch::nn::Linear before;
  Sharded<TwoPaths> paths{nullptr};
  Sharded<HeldInput> held{nullptr};
  Sharded<Pair> pair{nullptr};
  torch::nn::Linear head;
  torch::Tensor scale;
};
TORCH_MODULE(ReadLateModel);

class FsdpUnitsReadLate : public ::testing::TestWithParam<LateRead> {};

TEST_P(FsdpUnitsReadLate, StayGatheredToTheEndOfBackwardAndTrainAsOneProcess) {
  LateRead way = GetParam();
  run_ranks(2, [way](int rank) {
    World world = init();
    torch::manual_seed(5);
    ReadLateModel reference(way);
    reference->to(torch::kDouble);
    torch::manual_seed(5);
    ReadLateModel model(way);
    model->to(torch::kDouble);
    FullyShardedDataParallel<ReadLateModel> fsdp(model, world);
    torch::optim::SGD reference_optimizer(trainable(reference->parameters()),
                                          torch::optim::SGDOptions(0.1));
    torch::optim::SGD optimizer(trainable(fsdp.parameters()), torch::optim::SGDOptions(0.1));
    for (int64_t step = 0; step < 3; ++step) {
      auto [x, y] = step_reference_and_share(reference, reference_optimizer, step,
                                             /*per_rank=*/2, /*ranks=*/2, rank);
      optimizer.zero_grad();
      torch::mse_loss(fsdp(x), y).backward();
      optimizer.step();
      expect_close_parameters(fsdp.full_parameters(), *reference, "step " + std::to_string(step));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ways, FsdpUnitsReadLate,
                         ::testing::Values(LateRead::StructInput, LateRead::HeldTensor,
                                           LateRead::HeldParameter, LateRead::Recomputed,
                                           LateRead::WithoutAutograd),
                         [](const auto& info) {
                           switch (info.param) {
                             case LateRead::StructInput: return std::string("struct_input");
                             case LateRead::HeldTensor: return std::string("held_tensor");
                             case LateRead::HeldParameter: return std::string("held_parameter");
                             case LateRead::Recomputed: return std::string("recomputed");
                             case LateRead::WithoutAutograd: return std::string("without_autograd");
                           }
                           return std::string();
                         });

// A unit recomputed twice in one backward brings its gradients a second
// time after its reduction: named on every rank, not lost.
struct TwiceRecomputedImpl : torch::nn::Module {
  TwiceRecomputedImpl()
      : pair(register_module("pair", Sharded<Pair>(/*frozen=*/false, /*unused=*/false))),
        head(register_module("head", torch::nn::Linear(kPairWidth, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    recomputed_unit = pair;
    return head(Recompute::apply(Recompute::apply(x.clone().requires_grad_(true))));
  }
  Sharded<Pair> pair;
  torch::nn::Linear head;
};
TORCH_MODULE(TwiceRecomputed);

TEST(FsdpUnits, RecomputedTwiceInOneBackwardAreRefusedByName) {
  run_ranks(2, [](int rank) {
    World world = init();
    torch::manual_seed(5);
    TwiceRecomputed model;
    FullyShardedDataParallel<TwiceRecomputed> fsdp(model, world);
    auto [x, y] = global_batch(0, 4, {kPairWidth});
    expect_error<UsageError>(
        [&, x = x, y = y] {
          torch::mse_loss(fsdp(x.narrow(0, rank * 2, 2)), y.narrow(0, rank * 2, 2).narrow(1, 0, 3))
              .backward();
        },
        {"came after unit pair was reduced", "recomputed more than once in one backward"});
  });
}

// Gradient accumulation: the first micro-batch inside fsdp.no_sync()
// reduces nothing; the second reduces the sum once. As one process that
// accumulates both micro-batches' gradients.
TEST(FsdpNoSync, AccumulatesInFullAndReducesOnceAsOneProcess) {
  for (int ranks : {2, 3}) {
    run_ranks(ranks, [ranks](int rank) {
      World world = init();
      auto reference = float64_model<TinyTransformer>(0, false);
      auto model = float64_model<TinyTransformer>(0, false);
      FullyShardedDataParallel<TinyTransformer> fsdp(model, world);
      torch::optim::SGD reference_optimizer(reference->parameters(),
                                            torch::optim::SGDOptions(0.1).momentum(0.9));
      torch::optim::SGD optimizer(fsdp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      int64_t share = kSamples / ranks;
      int64_t half = share / 2;
      for (int64_t step = 0; step < 3; ++step) {
        auto [tokens, targets] = token_batch(step);
        reference_optimizer.zero_grad();
        optimizer.zero_grad();
        for (int micro = 0; micro < 2; ++micro) {
          // Each micro-batch: half of every rank's share.
          std::vector<torch::Tensor> parts, part_targets;
          for (int r = 0; r < ranks; ++r) {
            parts.push_back(tokens.narrow(0, r * share + micro * half, half));
            part_targets.push_back(targets.narrow(0, r * share + micro * half, half));
          }
          loss_of(reference(torch::cat(parts)), torch::cat(part_targets)).backward();
          auto mine = tokens.narrow(0, rank * share + micro * half, half);
          auto my_targets = targets.narrow(0, rank * share + micro * half, half);
          if (micro == 0) {
            auto guard = fsdp.no_sync();
            loss_of(fsdp(mine), my_targets).backward();
            // As optimizer.zero_grad() left them: none (LibTorch 2) or zeros.
            for (const auto& piece : fsdp.parameters()) {
              ASSERT_TRUE(!piece.grad().defined() || piece.grad().count_nonzero().item<int64_t>() == 0)
                  << "reduced inside no_sync";
            }
          } else {
            loss_of(fsdp(mine), my_targets).backward();
          }
        }
        reference_optimizer.step();
        optimizer.step();
        expect_close_parameters(fsdp.full_parameters(), *reference,
                                "step " + std::to_string(step));
      }
    });
  }
}

// An inf that lands in one rank's shard only (an overflow of the scaled
// gradients of some elements): every rank skips the step and backs off.
TEST(FsdpGradScaler, EveryRankSkipsAnInfInOneRanksShard) {
  run_ranks(3, [](int rank) {
    World world = init();
    auto model = float64_model<TinyTransformer>(0, false);
    model->to(torch::kFloat);
    FullyShardedDataParallel<TinyTransformer> fsdp(model, world);
    torch::optim::SGD optimizer(fsdp.parameters(), torch::optim::SGDOptions(0.1));
    amp::GradScaler scaler(amp::GradScalerOptions().init_scale(1024));
    int64_t share = kSamples / 3;
    for (int64_t step = 0; step < 3; ++step) {
      auto [tokens, targets] = token_batch(step);
      optimizer.zero_grad();
      scaler.scale(loss_of(fsdp(tokens.narrow(0, rank * share, share)),
                           targets.narrow(0, rank * share, share)))
          .backward();
      if (step == 1 && rank == 1) {
        auto pieces = fsdp.parameters();
        ASSERT_FALSE(pieces.empty());
        pieces.front().mutable_grad()[0] = std::numeric_limits<float>::infinity();
      }
      auto before = flatten(fsdp.parameters());
      bool stepped = scaler.step(optimizer);
      scaler.update();
      EXPECT_EQ(stepped, step != 1) << "rank " << rank << " at step " << step;
      if (step == 1) {
        EXPECT_TRUE(torch::equal(before, flatten(fsdp.parameters())));
      }
      expect_same_on_every_rank(world, torch::tensor({scaler.get_scale()}, torch::kDouble),
                                "the scale after step " + std::to_string(step));
    }
    EXPECT_EQ(scaler.get_scale(), 512.0);
  });
}

// A model of two elements at three ranks: rank 2 holds no piece, so its
// optimizer steps nothing; it must still take part in the found-inf
// agreement, or the others would wait for it there.
TEST(FsdpGradScaler, ARankThatHoldsNoPieceStillAgrees) {
  run_ranks(3, [](int rank) {
    World world = init();
    torch::nn::Linear tiny(1, 1);
    FullyShardedDataParallel<torch::nn::Linear> fsdp(tiny, world);
    EXPECT_EQ(fsdp.parameters().empty(), rank == 2);
    torch::optim::SGD optimizer(fsdp.parameters(), torch::optim::SGDOptions(0.1));
    amp::GradScaler scaler(amp::GradScalerOptions().init_scale(1024));
    optimizer.zero_grad();
    scaler.scale(fsdp(torch::ones({2, 1})).sum()).backward();
    if (rank == 0) {
      fsdp.parameters().front().mutable_grad()[0] = std::numeric_limits<float>::infinity();
    }
    EXPECT_FALSE(scaler.step(optimizer)) << "rank " << rank;
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 512.0);
  });
}

// A learning rate changed during training (a schedule's decay) survives
// both kinds of checkpoint, as the rest of the optimizer's state does.
TEST(FsdpCheckpoint, BothKindsRestoreEachGroupsOptions) {
  ScratchFolder folder("fsdp-options");
  auto result = launch_ranks(with_shared_folder(2, folder.path()), [](int) {
    World world = init();
    auto model = float64_model<TinyTransformer>(0, false);
    FullyShardedDataParallel<TinyTransformer> fsdp(model, world);
    torch::optim::Adam optimizer(fsdp.parameters(), torch::optim::AdamOptions(0.01));
    auto [tokens, targets] = token_batch(0);
    loss_of(fsdp(tokens.narrow(0, world.rank() * 6, 6)), targets.narrow(0, world.rank() * 6, 6))
        .backward();
    optimizer.step();
    static_cast<torch::optim::AdamOptions&>(optimizer.param_groups()[0].options()).lr(0.004);
    auto lr_of = [](torch::optim::Optimizer& held) {
      return static_cast<torch::optim::AdamOptions&>(held.param_groups()[0].options()).lr();
    };

    torch::optim::Adam full(model->parameters(), torch::optim::AdamOptions(0.01));
    fsdp.consolidate_optimizer_state(optimizer, full, 0);
    if (world.rank() == 0) {
      EXPECT_EQ(lr_of(full), 0.004) << "consolidated";
    }
    torch::optim::SGD other_type(model->parameters(), torch::optim::SGDOptions(0.01));
    expect_error<UsageError>([&] { fsdp.load_optimizer_state(optimizer, other_type); },
                             {"build the full one of the sharded one's type"});
    torch::optim::Adam resumed(fsdp.parameters(), torch::optim::AdamOptions(0.01));
    fsdp.load_optimizer_state(resumed, full);
    if (world.rank() == 0) {
      EXPECT_EQ(lr_of(resumed), 0.004) << "loaded from the consolidated state";
    }

    fsdp.save_sharded(shared_folder() + "/fsdp", optimizer);
    torch::optim::Adam from_shards(fsdp.parameters(), torch::optim::AdamOptions(0.01));
    fsdp.load_sharded(shared_folder() + "/fsdp", from_shards);
    EXPECT_EQ(lr_of(from_shards), 0.004) << "sharded";
  });
  ASSERT_TRUE(result.ok()) << result.report();
}

struct ScaleImpl : torch::nn::Module {
  ScaleImpl() : gain(register_parameter("gain", torch::ones({kPairWidth}))) {}
  // Used through a sum: on freed (empty) parameters this is 0, not an error.
  torch::Tensor forward(const torch::Tensor& x) {
    return x * (1 + gain.sum());
  }
  torch::Tensor gain;
};
TORCH_MODULE(Scale);

struct AroundHolderImpl : torch::nn::Module {
  AroundHolderImpl()
      : scale(register_module("scale", Sharded<Scale>())),
        head(register_module("head", torch::nn::Linear(kPairWidth, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return head(scale->forward(x)); // the block, not the holder
  }
  Sharded<Scale> scale;
  torch::nn::Linear head;
};
TORCH_MODULE(AroundHolder);

struct AroundLinearImpl : torch::nn::Module {
  AroundLinearImpl()
      : fc(register_module("fc", Sharded<torch::nn::Linear>(kPairWidth, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return fc->forward(x); // the block, not the holder
  }
  Sharded<torch::nn::Linear> fc;
};
TORCH_MODULE(AroundLinear);

struct InSequentialImpl : torch::nn::Module {
  InSequentialImpl()
      : layers(register_module("layers", torch::nn::Sequential(Sharded<Pair>(false, false),
                                                               torch::nn::Linear(6, 3)))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return layers->forward(x);
  }
  torch::nn::Sequential layers;
};
TORCH_MODULE(InSequential);

// A unit that the model calls around its holder computes on freed
// parameters: refused at construction where a Sequential holds it, and
// named after the forward (before any backward or step) where a silent
// result would otherwise follow.
TEST(FsdpUnits, CalledAroundTheirHoldersAreRefusedByName) {
  run_ranks(2, [](int) {
    World world = init();
    expect_error<ConfigError>(
        [&] { FullyShardedDataParallel<InSequential> fsdp(InSequential(), world); },
        {"unit layers.0 is held in a torch::nn::Sequential", "call the holder"});
    AroundHolder model;
    FullyShardedDataParallel<AroundHolder> fsdp(model, world);
    expect_error<UsageError>([&] { fsdp(torch::ones({2, kPairWidth})); },
                             {"unit scale took part in this forward without its "
                              "lockstep::Sharded holder gathering it",
                              "not the block's ->forward(x)"});
    // A unit whose block cannot compute on empty parameters: ATen's error
    // comes with the units the forward had not gathered.
    AroundLinear linear;
    FullyShardedDataParallel<AroundLinear> around(linear, world);
    expect_error<UsageError>([&] { around(torch::ones({2, kPairWidth})); },
                             {"the forward raised while these units had not been gathered in "
                              "it: fc", "call the holder (unit(x))"});
  });
}

// FsdpOptions::param_dtype: the units gathered in bfloat16 from float32
// shards, their gradients averaged in bfloat16 into float32 pieces: equal
// to the bit to a loop written by hand over the same world (a bfloat16 copy
// of float32 masters, each gradient averaged as World averages 16 bits).
TEST(FsdpMixedPrecision, EqualsAHandCastLoopBitForBit) {
  for (const auto& setup : two_and_three_rank_setups()) {
    run_ranks(setup, [setup](int rank) {
      World world = init();
      torch::manual_seed(0);
      TinyTransformer model(false);
      torch::manual_seed(0);
      TinyTransformer masters(false);
      FullyShardedDataParallel<TinyTransformer> fsdp(
          model, world, FsdpOptions().param_dtype(torch::kBFloat16));
      torch::optim::SGD optimizer(fsdp.parameters(), torch::optim::SGDOptions(0.1));
      torch::optim::SGD reference(masters->parameters(), torch::optim::SGDOptions(0.1));
      int64_t share = kSamples / setup.size;
      for (int64_t step = 0; step < 3; ++step) {
        auto [tokens, targets] = token_batch(step);
        tokens = tokens.narrow(0, rank * share, share);
        targets = targets.narrow(0, rank * share, share);
        // By hand.
        TinyTransformer copy(false);
        {
          torch::NoGradGuard no_grad;
          copy->to(torch::kBFloat16);
          auto to = copy->parameters();
          auto from = masters->parameters();
          for (size_t i = 0; i < to.size(); ++i) {
            to[i].copy_(from[i]);
          }
        }
        loss_of(copy(tokens).to(torch::kFloat), targets).backward();
        reference.zero_grad();
        {
          torch::NoGradGuard no_grad;
          auto low = copy->parameters();
          auto high = masters->parameters();
          for (size_t i = 0; i < low.size(); ++i) {
            auto wire = low[i].grad().clone();
            world.all_reduce(wire, ReduceOp::Average);
            high[i].mutable_grad() = wire.to(torch::kFloat);
          }
        }
        reference.step();
        // Through the wrapper.
        optimizer.zero_grad();
        auto logits = fsdp(tokens);
        EXPECT_EQ(logits.scalar_type(), torch::kBFloat16);
        loss_of(logits.to(torch::kFloat), targets).backward();
        optimizer.step();
        auto full = fsdp.full_parameters();
        for (const auto& item : masters->named_parameters()) {
          ASSERT_EQ(full[item.key()].scalar_type(), torch::kFloat);
          ASSERT_TRUE(torch::equal(full[item.key()], item.value()))
              << setup.name() << ": " << item.key() << " after step " << step << " differs by "
              << (full[item.key()] - item.value()).abs().max().item<double>();
        }
      }
    });
  }
}

} // namespace
} // namespace lockstep::testing
