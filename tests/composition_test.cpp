// The composition table of docs/ddp.md, tested. Every way of data
// parallelism (DDP, DDP + ZeRO-1, ZeRO-2, FSDP, DiLoCo with DDP inside)
// meets every precision (float32, the bfloat16 policy, the float16 policy
// with a GradScaler), two models (LayerNorm; BatchNorm), and one or two
// micro-batches per step, at 2 and 3 ranks. Each cell either trains as a
// loop written here by hand (float64 where the cell is float32, within
// float64 rounding; in 16 bits the same casts and averages, to the bit) or
// is refused by name before any collective.

#include <cstdio>
#include <limits>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <lockstep/diloco.h>
#include <lockstep/fault_tolerance.h>
#include <lockstep/fsdp.h>
#include <lockstep/lockstep.h>
#include <lockstep/replica_groups.h>

#include "amp/sixteen_bit_support.h"
#include "support/expect_error.h"
#include "support/multiprocess.h"
#include "support/training.h"

namespace lockstep::testing {
namespace {

enum class Way { Ddp, Zero1, Zero2, Fsdp, DiLoCo };
enum class Precision { Float32, BFloat16, Float16 };
enum class Net { LayerNorm, BatchNorm };

std::string name_of(Way way) {
  switch (way) {
    case Way::Ddp: return "ddp";
    case Way::Zero1: return "zero1";
    case Way::Zero2: return "zero2";
    case Way::Fsdp: return "fsdp";
    case Way::DiLoCo: return "diloco";
  }
  return "";
}

struct NormBlockImpl : torch::nn::Module {
  NormBlockImpl()
      : fc(register_module("fc", torch::nn::Linear(8, 12))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({12})))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::gelu(norm(fc(x)));
  }
  torch::nn::Linear fc;
  torch::nn::LayerNorm norm;
};
TORCH_MODULE(NormBlock);

// Inputs of 8; a unit (for FSDP) with LayerNorm, a head in the root.
struct LayerNormNetImpl : torch::nn::Module {
  LayerNormNetImpl()
      : block(register_module("block", Sharded<NormBlock>())),
        head(register_module("head", torch::nn::Linear(12, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return head(block(x));
  }
  Sharded<NormBlock> block;
  torch::nn::Linear head;
};
TORCH_MODULE(LayerNormNet);

// Inputs of 1x8x8; each BatchNorm a unit of its own (FSDP computes units
// of BatchNorm parameters alone in their own dtype), the rest the root.
struct BatchNormNetImpl : torch::nn::Module {
  BatchNormNetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 3, 3)))),
        bn1(register_module("bn1", Sharded<torch::nn::BatchNorm2d>(3))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 3, 3)))),
        bn2(register_module("bn2", Sharded<torch::nn::BatchNorm2d>(3))),
        head(register_module("head", torch::nn::Linear(3 * 4 * 4, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = torch::relu(bn1(conv1(x)));
    y = torch::relu(bn2(conv2(y)));
    return head(y.flatten(1));
  }
  torch::nn::Conv2d conv1;
  Sharded<torch::nn::BatchNorm2d> bn1;
  torch::nn::Conv2d conv2;
  Sharded<torch::nn::BatchNorm2d> bn2;
  torch::nn::Linear head;
};
TORCH_MODULE(BatchNormNet);

bool is_batch_norm_parameter(const std::string& name) {
  return name.rfind("bn", 0) == 0;
}

struct Cell {
  Way way;
  Precision precision;
  Net net;
  bool accumulate;
  bool fault_tolerant;
  std::string name() const {
    std::string out = name_of(way);
    out += fault_tolerant ? "_ft" : "";
    out += precision == Precision::Float32 ? "_fp32" : precision == Precision::BFloat16 ? "_bf16"
                                                                                       : "_fp16";
    out += net == Net::LayerNorm ? "_layernorm" : "_batchnorm";
    out += accumulate ? "_accumulate" : "_plain";
    return out;
  }
  bool sixteen_bits() const {
    return precision != Precision::Float32;
  }
  at::ScalarType compute() const {
    return precision == Precision::BFloat16 ? at::kBFloat16 : at::kHalf;
  }
  at::ScalarType masters() const {
    return sixteen_bits() ? at::kFloat : at::kDouble;
  }
};

// What a cell must be refused with (a fragment of the error), or "" where
// it must train.
std::string expected_refusal(const Cell& cell) {
  // In the order the wrapper and then FaultTolerance check.
  if (cell.way == Way::Zero2 && cell.sixteen_bits()) {
    return "DdpOptions::shard_gradients does not take a mixed-precision policy yet";
  }
  if (cell.sixteen_bits()) {
    for (auto work : {detail::CpuWork::MatrixProducts, detail::CpuWork::Convolutions}) {
      if (work == detail::CpuWork::Convolutions && cell.net != Net::BatchNorm) {
        continue;
      }
      if (detail::cpu_work_unsupported(work, cell.compute())) {
        return "and this CPU with this LibTorch cannot";
      }
    }
  }
  if (cell.fault_tolerant && (cell.way == Way::Zero1 || cell.way == Way::Zero2)) {
    return "lockstep::FaultTolerance cannot take a ZeroRedundancyOptimizer";
  }
  return "";
}

// A model of the cell's kind, the same on every rank, in `dtype`.
std::shared_ptr<torch::nn::Module> build(Net net, at::ScalarType dtype) {
  torch::manual_seed(11);
  std::shared_ptr<torch::nn::Module> model;
  if (net == Net::LayerNorm) {
    model = LayerNormNet().ptr();
  } else {
    model = BatchNormNet().ptr();
  }
  model->to(dtype);
  return model;
}

torch::Tensor forward_of(const std::shared_ptr<torch::nn::Module>& model, Net net,
                         const torch::Tensor& x) {
  if (net == Net::LayerNorm) {
    return std::dynamic_pointer_cast<LayerNormNetImpl>(model)->forward(x);
  }
  return std::dynamic_pointer_cast<BatchNormNetImpl>(model)->forward(x);
}

// Step `step`'s batch of this rank, micro-batch `micro` of `micros`.
std::pair<torch::Tensor, torch::Tensor> batch_of(const Cell& cell, int64_t step, int rank,
                                                 int ranks, int micro, int micros) {
  constexpr int64_t kPerRank = 4;
  std::vector<int64_t> shape = cell.net == Net::LayerNorm ? std::vector<int64_t>{8}
                                                          : std::vector<int64_t>{1, 8, 8};
  auto [x, y] = global_batch(step, kPerRank * ranks, shape);
  int64_t size = kPerRank / micros;
  int64_t first = rank * kPerRank + micro * size;
  return {x.narrow(0, first, size).to(cell.masters()),
          y.narrow(0, first, size).narrow(1, 0, 3).to(cell.masters())};
}

constexpr double kLr = 0.01;
constexpr int64_t kSteps = 4;
constexpr double kInitScale = 1024;

// The loop by hand: masters stepped by a plain Adam (and GradScaler), each
// micro-batch's gradients computed on a copy in the compute dtype
// (BatchNorm kept in the masters'), averaged over `world` as the way
// averages them. DiLoCo: each rank a replica, its inner steps local, the
// pseudo-gradients summed over `world` every 2 steps, an outer SGD.
class Reference {
 public:
  Reference(const Cell& cell, World world) : cell_(cell), world_(std::move(world)) {
    masters_ = build(cell.net, cell.masters());
    optimizer_ = std::make_unique<torch::optim::Adam>(masters_->parameters(),
                                                      torch::optim::AdamOptions(kLr));
    if (cell.way == Way::DiLoCo) {
      outer_ = std::make_unique<torch::optim::SGD>(
          masters_->parameters(), torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
      for (const auto& param : masters_->parameters()) {
        global_.push_back(param.detach().clone());
      }
    }
  }

  void step(int64_t step) {
    // DDP's world inside a DiLoCo replica is the replica (one rank).
    int n = cell_.way == Way::DiLoCo ? 1 : world_.size();
    int micros = cell_.accumulate ? 2 : 1;
    auto copy = build(cell_.net, cell_.masters());
    {
      torch::NoGradGuard no_grad;
      auto masters = masters_->named_parameters();
      for (auto& item : copy->named_parameters()) {
        bool keep = !cell_.sixteen_bits() || is_batch_norm_parameter(item.key());
        item.value().set_data(keep ? masters[item.key()].clone()
                                   : masters[item.key()].to(cell_.compute()));
      }
    }
    std::vector<torch::Tensor> sums(masters_->parameters().size());
    for (int micro = 0; micro < micros; ++micro) {
      auto [x, y] = batch_of(cell_, step, world_.rank(), world_.size(), micro, micros);
      auto input = cell_.sixteen_bits() ? x.to(cell_.compute()) : x;
      auto loss = torch::mse_loss(forward_of(copy, cell_.net, input).to(cell_.masters()), y);
      (cell_.precision == Precision::Float16 ? scaler_.scale(loss) : loss).backward();
      // DDP accumulates in the masters' dtype; FSDP in the compute dtype,
      // as autograd adds into the gradients it holds.
      auto params = copy->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        if (cell_.way == Way::Fsdp && cell_.sixteen_bits()) {
          continue; // kept where autograd adds them up, in their own dtype
        }
        auto gradient = params[i].grad().to(cell_.masters());
        sums[i] = sums[i].defined() ? sums[i] + gradient : gradient;
        params[i].mutable_grad().reset();
      }
    }
    optimizer_->zero_grad();
    {
      torch::NoGradGuard no_grad;
      auto masters = masters_->parameters();
      auto params = copy->parameters();
      for (size_t i = 0; i < masters.size(); ++i) {
        at::Tensor average;
        if (!cell_.sixteen_bits()) {
          average = sums[i].clone();
          if (n > 1) {
            world_.all_reduce(average, ReduceOp::Sum);
          }
          average.div_(n);
        } else if (cell_.way == Way::Fsdp) {
          // Each rank's gradient in its dtype, averaged as World averages
          // 16 bits (each share divided, summed in float32, rounded once).
          auto wire = params[i].grad().clone();
          world_.all_reduce(wire, ReduceOp::Average);
          average = wire.to(cell_.masters());
        } else {
          // DDP's policy: divided in float32, rounded once, summed.
          auto wire = (sums[i] / n).to(cell_.compute());
          if (n > 1) {
            world_.all_reduce(wire, ReduceOp::Sum);
          }
          average = wire.to(cell_.masters());
        }
        masters[i].mutable_grad() = average;
      }
    }
    if (cell_.precision == Precision::Float16) {
      scaler_.step(*optimizer_);
      scaler_.update();
    } else {
      optimizer_->step();
    }
    if (cell_.way == Way::DiLoCo && (step + 1) % 2 == 0) {
      torch::NoGradGuard no_grad;
      auto params = masters_->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        auto pseudo = global_[i] - params[i];
        world_.all_reduce(pseudo, ReduceOp::Sum);
        params[i].copy_(global_[i]);
        params[i].mutable_grad() = pseudo.div_(world_.size());
      }
      outer_->step();
      for (size_t i = 0; i < params.size(); ++i) {
        global_[i].copy_(params[i]);
        params[i].mutable_grad().reset();
      }
    }
  }

  torch::OrderedDict<std::string, torch::Tensor> parameters() const {
    return masters_->named_parameters();
  }

 private:
  Cell cell_;
  World world_;
  std::shared_ptr<torch::nn::Module> masters_;
  std::unique_ptr<torch::optim::Adam> optimizer_;
  std::unique_ptr<torch::optim::SGD> outer_;
  std::vector<torch::Tensor> global_;
  amp::GradScaler scaler_{amp::GradScalerOptions().init_scale(kInitScale)};
};

void expect_equal(const torch::OrderedDict<std::string, torch::Tensor>& actual,
                  const torch::OrderedDict<std::string, torch::Tensor>& expected, const Cell& cell,
                  int64_t step) {
  ASSERT_EQ(actual.size(), expected.size()) << cell.name();
  for (const auto& item : expected) {
    const auto& ours = actual[item.key()];
    ASSERT_EQ(ours.scalar_type(), item.value().scalar_type()) << cell.name() << " " << item.key();
    bool equal = cell.sixteen_bits()
        ? torch::equal(ours, item.value())
        : torch::allclose(ours, item.value(), 0, kFloat64Tolerance);
    ASSERT_TRUE(equal) << cell.name() << ": " << item.key() << " after step " << step
                       << " differs by " << (ours - item.value()).abs().max().item<double>();
  }
  if (step + 1 == kSteps) {
    // A cell that trained nothing would equal a reference that did not either.
    auto initial = build(cell.net, cell.masters())->named_parameters();
    bool moved = false;
    for (const auto& item : expected) {
      moved = moved || !torch::equal(item.value(), initial[item.key()]);
    }
    ASSERT_TRUE(moved) << cell.name() << ": the parameters never moved";
  }
}

// No rank fails here: a heartbeat late on a loaded machine must not drop a
// step (which the test would then find unlike the loop by hand).
FaultToleranceOptions tolerant_options() {
  return FaultToleranceOptions().verbose(false).heartbeat_timeout(std::chrono::seconds(60));
}

// One cell on this rank. Every rank decides alike whether it is refused.
template <typename Holder>
void run_cell(const Cell& cell, World& world, Holder holder) {
  auto model = holder.ptr();
  DdpOptions options;
  if (cell.sixteen_bits()) {
    options.mixed_precision(lockstep::MixedPrecision().param_dtype(cell.compute()));
  }
  std::optional<amp::GradScaler> scaler;
  if (cell.precision == Precision::Float16) {
    scaler.emplace(amp::GradScalerOptions().init_scale(kInitScale));
  }
  Reference reference(cell, world);
  int micros = cell.accumulate ? 2 : 1;
  auto loss_of = [&](const torch::Tensor& output, const torch::Tensor& y) {
    auto loss = torch::mse_loss(output.to(cell.masters()), y);
    return scaler ? scaler->scale(loss) : loss;
  };
  auto step_with = [&](torch::optim::Optimizer& optimizer) {
    if (scaler) {
      scaler->step(optimizer);
      scaler->update();
    } else {
      optimizer.step();
    }
  };
  // Every micro-batch but the last under the wrapper's no_sync guard.
  auto backward = [&](auto& wrapper, int64_t step) {
    for (int micro = 0; micro < micros; ++micro) {
      auto [x, y] = batch_of(cell, step, world.rank(), world.size(), micro, micros);
      std::optional<decltype(wrapper.no_sync())> guard;
      if (micro + 1 < micros) {
        guard.emplace(wrapper.no_sync());
      }
      loss_of(wrapper(x), y).backward();
    }
  };
  if (cell.way == Way::Fsdp) {
    FsdpOptions fsdp_options;
    if (cell.sixteen_bits()) {
      fsdp_options.param_dtype(cell.compute());
    }
    FullyShardedDataParallel<Holder> fsdp(holder, world, fsdp_options);
    torch::optim::Adam optimizer(fsdp.parameters(), torch::optim::AdamOptions(kLr));
    for (int64_t step = 0; step < kSteps; ++step) {
      reference.step(step);
      optimizer.zero_grad();
      backward(fsdp, step);
      step_with(optimizer);
      expect_equal(fsdp.full_parameters(), reference.parameters(), cell, step);
    }
    return;
  }
  if (cell.way == Way::DiLoCo) {
    auto groups = replica_groups(world, 1);
    DDP<Holder> ddp(holder, groups.replica, options);
    torch::optim::Adam inner(model->parameters(), torch::optim::AdamOptions(kLr));
    torch::optim::SGD outer(model->parameters(),
                            torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
    DiLoCo diloco(groups.across, {model->parameters()}, inner, {&outer},
                  DiLoCoOptions().sync_every(2));
    std::optional<FaultTolerance> ft;
    if (cell.fault_tolerant) {
      ft.emplace(diloco, inner, tolerant_options());
      if (scaler) {
        ft->register_state("grad_scaler", *scaler);
      }
    }
    for (int64_t step = 0; step < kSteps; ++step) {
      reference.step(step);
      inner.zero_grad();
      backward(ddp, step);
      if (scaler) {
        diloco.step(*scaler);
        scaler->update();
      } else {
        diloco.step();
      }
      if (ft) {
        ASSERT_EQ(ft->stats().aborted_steps, 0) << cell.name() << ": no rank failed";
      }
      expect_equal(model->named_parameters(), reference.parameters(), cell, step);
    }
    return;
  }
  if (cell.way == Way::Zero2) {
    options.shard_gradients(true);
  }
  DDP<Holder> ddp(holder, world, options);
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (cell.way == Way::Zero1 || cell.way == Way::Zero2) {
    optimizer = std::make_unique<ZeroRedundancyOptimizer<torch::optim::Adam>>(
        model->parameters(), world, torch::optim::AdamOptions(kLr),
        ZeroOptions().partition(ZeroPartition::Elements));
    if (cell.way == Way::Zero2) {
      ddp.shard_gradients_with(*optimizer);
    }
  } else {
    optimizer = std::make_unique<torch::optim::Adam>(model->parameters(),
                                                     torch::optim::AdamOptions(kLr));
  }
  std::optional<FaultTolerance> ft;
  if (cell.fault_tolerant) {
    ft.emplace(ddp, *optimizer, tolerant_options());
    if (scaler) {
      ft->register_state("grad_scaler", *scaler);
    }
  }
  for (int64_t step = 0; step < kSteps; ++step) {
    reference.step(step);
    if (ft) {
      ft->begin_step();
    }
    optimizer->zero_grad();
    backward(ddp, step);
    if (ft) {
      ASSERT_TRUE(ft->commit()) << cell.name() << ": no rank failed";
    }
    step_with(*optimizer);
    expect_equal(model->named_parameters(), reference.parameters(), cell, step);
  }
}

// FullyShardedDataParallel has no FaultTolerance: no constructor takes it
// (a failed rank takes its shards of the parameters with it).
static_assert(!std::is_constructible_v<FaultTolerance, FullyShardedDataParallel<LayerNormNet>&,
                                       torch::optim::Optimizer&>);

struct Launch {
  Way way;
  int ranks;
  bool fault_tolerant;
};

class CompositionTable : public ::testing::TestWithParam<Launch> {};

// Every cell of a launch in one job; under FaultTolerance each cell a job
// of its own: a job takes one FaultTolerance (its keys in the job's store
// are the job's, docs/fault-tolerance.md).
TEST_P(CompositionTable, EachCellTrainsAsTheLoopByHandOrIsRefusedByName) {
  auto launch = GetParam();
  std::vector<Cell> cells;
  for (auto precision : {Precision::Float32, Precision::BFloat16, Precision::Float16}) {
    for (auto net : {Net::LayerNorm, Net::BatchNorm}) {
      for (bool accumulate : {false, true}) {
        cells.push_back({launch.way, precision, net, accumulate, launch.fault_tolerant});
      }
    }
  }
  auto run_cells = [](const std::vector<Cell>& some, int rank) {
    World world = init();
    for (const auto& cell : some) {
      auto refusal = expected_refusal(cell);
      auto dtype = cell.masters();
      auto run = [&] {
        if (cell.net == Net::LayerNorm) {
          LayerNormNet holder(std::dynamic_pointer_cast<LayerNormNetImpl>(build(cell.net, dtype)));
          run_cell(cell, world, holder);
        } else {
          BatchNormNet holder(std::dynamic_pointer_cast<BatchNormNetImpl>(build(cell.net, dtype)));
          run_cell(cell, world, holder);
        }
      };
      if (refusal.empty()) {
        run();
        ASSERT_FALSE(::testing::Test::HasFatalFailure()) << cell.name();
      } else {
        expect_error<Error>(run, {refusal});
      }
      if (rank == 0) { // what the table in docs/ddp.md says, cell by cell
        std::printf("cell %s: %s\n", cell.name().c_str(),
                    refusal.empty() ? "trained as the loop by hand"
                                    : ("refused: " + refusal).c_str());
      }
    }
  };
  if (!launch.fault_tolerant) {
    run_ranks(launch.ranks, [&](int rank) { run_cells(cells, rank); }, std::chrono::minutes(4));
    return;
  }
  for (const auto& cell : cells) {
    run_ranks(launch.ranks, [&](int rank) { run_cells({cell}, rank); }, std::chrono::minutes(2));
    ASSERT_FALSE(HasFatalFailure()) << cell.name();
  }
}

std::vector<Launch> launches() {
  std::vector<Launch> out;
  for (bool fault_tolerant : {false, true}) {
    for (auto way : {Way::Ddp, Way::Zero1, Way::Zero2, Way::Fsdp, Way::DiLoCo}) {
      if (fault_tolerant && way == Way::Fsdp) {
        continue; // the static_assert above
      }
      for (int ranks : {2, 3}) {
        out.push_back({way, ranks, fault_tolerant});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Ways, CompositionTable, ::testing::ValuesIn(launches()),
                         [](const auto& info) {
                           const Launch& launch = info.param;
                           return name_of(launch.way) + (launch.fault_tolerant ? "_ft_" : "_") +
                               std::to_string(launch.ranks) + "_ranks";
                         });

} // namespace
} // namespace lockstep::testing
