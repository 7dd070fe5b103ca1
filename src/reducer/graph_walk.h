#pragma once

// find_unused_parameters: which gradient accumulators the autograd graph of
// a forward's outputs can reach; and, for FSDP, whether the graph of one
// unit's call reaches beyond that call.

#include <cstdint>
#include <unordered_set>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::autograd {
struct Node;
} // namespace torch::autograd

namespace lockstep::detail {

std::unordered_set<const torch::autograd::Node*> reachable_nodes(
    const std::vector<at::Tensor>& outputs);

/// Whether the graph of `outputs`, made by one call whose nodes this
/// thread numbered from `first` on (at::sequence_number), reaches a node
/// that the call did not make (an earlier node, another leaf's
/// accumulator) other than through `stops`, nodes whose further graph does
/// not count.
bool reaches_beyond_call(const std::vector<at::Tensor>& outputs, uint64_t first,
                         const std::unordered_set<const torch::autograd::Node*>& stops);

} // namespace lockstep::detail
