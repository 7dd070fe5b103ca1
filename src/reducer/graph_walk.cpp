#include "reducer/graph_walk.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

namespace lockstep::detail {

std::unordered_set<const torch::autograd::Node*> reachable_nodes(
    const std::vector<at::Tensor>& outputs) {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  auto visit = [&](torch::autograd::Node* node) {
    if (node != nullptr && seen.insert(node).second) {
      stack.push_back(node);
    }
  };
  for (const auto& output : outputs) {
    if (!output.defined() || !output.requires_grad()) {
      continue;
    }
    if (output.grad_fn()) {
      visit(output.grad_fn().get());
    } else {
      // A parameter returned as it is: its own accumulator.
      visit(torch::autograd::impl::try_get_grad_accumulator(output).get());
    }
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      visit(edge.function.get());
    }
  }
  return seen;
}

} // namespace lockstep::detail
