// Replica groups as fault tolerance's unit (fault_tolerance.h): inside a
// group the program's wrapper (DDP, FSDP) averages the step's gradients
// over the group's world, unguarded (a group with a dead rank drops out
// whole). Across groups, at commit, the gradients of what this rank's
// optimizer steps (FSDP: its shards) are averaged with the ranks of the
// same place in every other group: one all-reduce per dtype in the
// epoch's world, whose failure drops the step.

#include <map>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <lockstep/error.h>

#include "fault/guarded.h"

namespace lockstep::detail {
namespace {

class GroupReduction final : public Guarded {
 public:
  GroupReduction(World across, torch::nn::Module& module, torch::optim::Optimizer& optimizer)
      : across_(std::move(across)), module_(module), optimizer_(optimizer) {}

  World world() const override {
    return across_;
  }
  // Nothing inside the groups is guarded: a failure there ends the group.
  void tolerate_failures() override {}
  std::string take_failure() override {
    return "";
  }
  int64_t synchronisations() const override {
    return reductions_;
  }
  void adopt_world(World world) override {
    across_ = std::move(world);
  }
  std::vector<at::Tensor> replica_tensors(bool buffers_only) const override {
    std::vector<at::Tensor> tensors;
    if (!buffers_only) {
      tensors = stepped();
    }
    for (const auto& buffer : module_.buffers()) {
      tensors.push_back(buffer);
    }
    return tensors;
  }

  // Per dtype, one flat tensor: each parameter's gradient (zeros where it
  // has none) and then, per parameter, 1 where it has one. Summed, the
  // counts say where some group's batch reached the parameter: there the
  // gradient is the sum over the groups, divided by their number (as one
  // process over the whole batch, whose other rows add nothing to it);
  // where none did, it stays without one.
  std::string finish_step() override {
    at::NoGradGuard no_grad;
    auto params = stepped();
    std::map<at::ScalarType, std::vector<size_t>> by_dtype;
    for (size_t i = 0; i < params.size(); ++i) {
      by_dtype[params[i].scalar_type()].push_back(i);
    }
    bool any_here = false;
    for (const auto& [dtype, indices] : by_dtype) {
      std::vector<at::Tensor> parts;
      for (size_t i : indices) {
        const auto& grad = params[i].grad();
        parts.push_back(grad.defined() ? grad.detach().reshape({-1})
                                       : at::zeros({params[i].numel()}, params[i].options()));
      }
      std::vector<double> here;
      for (size_t i : indices) {
        here.push_back(params[i].grad().defined() ? 1.0 : 0.0);
        any_here = any_here || params[i].grad().defined();
      }
      parts.push_back(at::tensor(here, at::TensorOptions().dtype(at::kDouble)).to(dtype));
      auto flat = at::cat(parts);
      try {
        across_.all_reduce(flat, ReduceOp::Sum);
      } catch (const CollectiveError& e) {
        return e.what();
      } catch (const TimeoutError& e) {
        return e.what();
      }
      int64_t offset = 0;
      // Read once, not a host read per parameter.
      auto counts = flat.narrow(0, flat.numel() - static_cast<int64_t>(indices.size()),
                                static_cast<int64_t>(indices.size()))
                        .to(at::kDouble)
                        .contiguous();
      const double* count = counts.data_ptr<double>();
      const double groups = static_cast<double>(across_.size());
      for (size_t j = 0; j < indices.size(); ++j) {
        auto& param = params[indices[j]];
        auto sum = flat.narrow(0, offset, param.numel()).view(param.sizes());
        offset += param.numel();
        if (count[j] == 0) {
          continue;
        }
        if (param.grad().defined()) {
          param.mutable_grad().copy_(sum).div_(groups);
        } else {
          param.mutable_grad() = sum / groups;
        }
      }
    }
    if (any_here) {
      ++reductions_;
    }
    return "";
  }

 private:
  // What the optimizer steps on this rank, in its order (the same on every
  // rank of a place).
  std::vector<at::Tensor> stepped() const {
    std::vector<at::Tensor> params;
    for (const auto& group : optimizer_.param_groups()) {
      for (const auto& param : group.params()) {
        params.push_back(param);
      }
    }
    return params;
  }

  World across_;
  torch::nn::Module& module_;
  torch::optim::Optimizer& optimizer_;
  int64_t reductions_ = 0;
};

} // namespace

std::shared_ptr<Guarded> guard_across_groups(World across, torch::nn::Module& module,
                                             torch::optim::Optimizer& optimizer) {
  return std::make_shared<GroupReduction>(std::move(across), module, optimizer);
}

} // namespace lockstep::detail
