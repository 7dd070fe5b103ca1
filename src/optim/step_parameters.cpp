#include <lockstep/step_in_backward.h>

#include <unordered_set>
#include <utility>

#include <torch/optim/optimizer.h>

namespace lockstep {

void step_parameters(torch::optim::Optimizer& optimizer,
                     const std::vector<at::Tensor>& parameters) {
  // torch::optim's optimizers skip a parameter without a gradient, state
  // and all: hiding the others' gradients steps the chosen ones alone.
  std::unordered_set<const c10::TensorImpl*> chosen;
  for (const auto& param : parameters) {
    chosen.insert(param.unsafeGetTensorImpl());
  }
  struct Hidden {
    std::vector<std::pair<at::Tensor, at::Tensor>> grads; // parameter, its gradient
    ~Hidden() {
      for (auto& [param, grad] : grads) {
        param.mutable_grad() = std::move(grad);
      }
    }
  } hidden;
  for (auto& group : optimizer.param_groups()) {
    for (auto& param : group.params()) {
      if (!chosen.count(param.unsafeGetTensorImpl()) && param.grad().defined()) {
        hidden.grads.emplace_back(param, std::exchange(param.mutable_grad(), at::Tensor()));
      }
    }
  }
  optimizer.step();
}

} // namespace lockstep
