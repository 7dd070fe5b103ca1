// What FullyShardedDataParallel's ranks must agree on about a step, beyond
// the gathers and reductions themselves: the order backward reduces the
// units in (rank 0's forward order, once), and the parameters that no rank
// used (they get no gradient, as in one process). And the units that a
// model calls around their holders: refused at construction where a
// Sequential holds them, named after a forward that computed with them.

#include <algorithm>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <lockstep/error.h>
#include <lockstep/fsdp.h>

#include "fsdp/sharded_model_state.h"
#include "fsdp/unit_registry.h"

namespace lockstep::detail {

void ShardedModel::State::agree_on_order() {
  // Rank 0's forward order, padded with -1, reversed: a unit that ran last
  // is the first whose gradients complete. Units that did not run follow,
  // the last registered first; the root is reduced last, at the end.
  auto order = at::full({static_cast<int64_t>(units.size())}, -1, at::kLong);
  for (size_t i = 0; i < last_forward_order.size() && i < units.size(); ++i) {
    order[static_cast<int64_t>(i)] = static_cast<int64_t>(last_forward_order[i]);
  }
  world.broadcast(order, 0, "FullyShardedDataParallel's order of units from rank 0");
  std::vector<size_t> agreed;
  std::vector<char> placed(units.size(), 0);
  for (int64_t i = order.numel(); i-- > 0;) {
    auto unit = order[i].item<int64_t>();
    if (unit >= 0 && static_cast<size_t>(unit) < units.size() && placed[unit] == 0 &&
        !unit_names[unit].empty()) {
      agreed.push_back(static_cast<size_t>(unit));
      placed[unit] = 1;
    }
  }
  for (size_t u = units.size(); u-- > 0;) {
    if (placed[u] == 0 && !unit_names[u].empty()) {
      agreed.push_back(u);
    }
  }
  if (!units.empty() && unit_names[0].empty()) {
    agreed.push_back(0);
  }
  reduce_order = std::move(agreed);
  order_agreed = true;
}

void ShardedModel::State::settle_unused() {
  std::vector<float> used;
  for (size_t u = 0; u < units.size(); ++u) {
    for (size_t k = 0; k < units[u]->members().size(); ++k) {
      used.push_back(used_since_sync[u][k] != 0 ? 1.0F : 0.0F);
    }
  }
  auto flags = at::tensor(used, at::kFloat);
  world.all_reduce(flags, ReduceOp::Max);
  const float* any = flags.data_ptr<float>();
  for (size_t u = 0; u < units.size(); ++u) {
    const auto& members = units[u]->members();
    for (size_t k = 0; k < members.size(); ++k, ++any) {
      // Zeros were added to what its piece held: no gradient stays none.
      auto piece = members[k].piece;
      if (piece.defined() && members[k].param.requires_grad() && *any == 0 &&
          units[u]->had_gradient()[k] == 0) {
        piece.mutable_grad().reset();
      }
      used_since_sync[u][k] = 0;
    }
  }
}

std::vector<size_t> ShardedModel::State::units_not_run() const {
  std::vector<size_t> missing;
  for (size_t u = 0; u < units.size(); ++u) {
    if (!unit_names[u].empty() &&
        std::find(forward_order.begin(), forward_order.end(), u) == forward_order.end()) {
      missing.push_back(u);
    }
  }
  return missing;
}

void ShardedModel::State::refuse_bypassed_units(
    const std::unordered_set<const torch::autograd::Node*>& nodes) const {
  // A unit that no holder ran since the last backward took part only if
  // the graph reaches its parameters' accumulators: then it computed on
  // the freed placeholders.
  for (size_t unit = 0; unit < units.size(); ++unit) {
    if (unit_names[unit].empty() || calls[unit] > 0) {
      continue;
    }
    for (const auto& accumulator : accumulators[unit]) {
      LOCKSTEP_ENFORCE(!accumulator || nodes.count(accumulator.get()) == 0, UsageError,
                       "FullyShardedDataParallel: ", FlatUnit::describe(unit_names[unit]),
                       " took part in this forward without its lockstep::Sharded holder "
                       "gathering it, so that it computed on freed, empty parameters. Call "
                       "the holder (unit(x)), not the block's ->forward(x), and keep units "
                       "out of containers that call their blocks themselves (Sequential, "
                       "AnyModule); a ModuleList may hold them if the model calls each "
                       "Sharded holder.");
    }
  }
}

void refuse_units_in_sequentials(
    const torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>& modules) {
  for (const auto& item : modules) {
    if (dynamic_cast<const torch::nn::SequentialImpl*>(item.value().get()) == nullptr) {
      continue;
    }
    for (const auto& child : item.value()->named_children()) {
      LOCKSTEP_ENFORCE(!is_declared_unit(*child.value()), ConfigError,
                       "FullyShardedDataParallel: unit ",
                       item.key().empty() ? child.key() : item.key() + "." + child.key(),
                       " is held in a torch::nn::Sequential, which calls its block's forward "
                       "itself, around the lockstep::Sharded holder that gathers it. Hold "
                       "the unit as a member (or in a ModuleList) and call the holder.");
    }
  }
}

} // namespace lockstep::detail
