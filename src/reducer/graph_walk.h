#pragma once

// find_unused_parameters: which gradient accumulators the autograd graph of
// a forward's outputs can reach.

#include <unordered_set>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::autograd {
struct Node;
} // namespace torch::autograd

namespace lockstep::detail {

std::unordered_set<const torch::autograd::Node*> reachable_nodes(
    const std::vector<at::Tensor>& outputs);

} // namespace lockstep::detail
