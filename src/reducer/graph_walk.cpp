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

bool reaches_beyond_call(const std::vector<at::Tensor>& outputs, uint64_t first,
                         const std::unordered_set<const torch::autograd::Node*>& stops) {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& output : outputs) {
    if (output.defined() && output.requires_grad() && output.grad_fn() &&
        seen.insert(output.grad_fn().get()).second) {
      stack.push_back(output.grad_fn().get());
    }
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (stops.count(node) != 0) {
      continue;
    }
    // Accumulators are numbered UINT64_MAX: one not among `stops` is
    // another leaf's.
    if (node->sequence_nr() < first || node->sequence_nr() == UINT64_MAX) {
      return true;
    }
    for (const auto& edge : node->next_edges()) {
      auto* next = edge.function.get();
      if (next != nullptr && seen.insert(next).second) {
        stack.push_back(next);
      }
    }
  }
  return false;
}

} // namespace lockstep::detail
