#include "optim/gradient_placement.h"

#include <map>
#include <mutex>
#include <unordered_map>

#include <torch/optim/optimizer.h>

#include <lockstep/error.h>
#include <lockstep/zero_redundancy_optimizer.h>

namespace lockstep::detail {
namespace {

// By the pieces' TensorImpl: a piece is a leaf that its maker holds for as
// long as it is registered.
struct Registry {
  std::mutex mutex;
  std::unordered_map<const c10::TensorImpl*, World> world_of;
  // By owner: its pieces and its world.
  std::map<const void*, std::pair<std::vector<const c10::TensorImpl*>, World>> owners;
};

Registry& registry() {
  static Registry instance;
  return instance;
}

std::vector<at::Tensor> parameters_of(torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> parameters;
  for (auto& group : optimizer.param_groups()) {
    parameters.insert(parameters.end(), group.params().begin(), group.params().end());
  }
  return parameters;
}

} // namespace

GradientPlacement gradient_placement(torch::optim::Optimizer& optimizer) {
  if (auto* sharded = dynamic_cast<ShardedOptimizer*>(&optimizer)) {
    // Under DdpOptions::shard_gradients the gradients are the pieces' of
    // its local optimizer; otherwise every rank holds every averaged one,
    // and the ranks still agree on them (ZeRO-1 steps each its own part).
    auto& holder = sharded->gradients_sharded() ? sharded->local_optimizer() : optimizer;
    return {parameters_of(holder), sharded->world()};
  }
  GradientPlacement placement{parameters_of(optimizer), std::nullopt};
  auto& known = registry();
  std::lock_guard<std::mutex> lock(known.mutex);
  for (const auto& parameter : placement.holders) {
    auto found = known.world_of.find(parameter.unsafeGetTensorImpl());
    if (found != known.world_of.end()) {
      placement.sharded_across = found->second;
      return placement;
    }
  }
  if (placement.holders.empty() && known.owners.size() == 1) {
    // This rank holds no piece of what the others' optimizers step.
    placement.sharded_across = known.owners.begin()->second.second;
  }
  return placement;
}

void register_pieces(const void* owner, const std::vector<at::Tensor>& pieces,
                     const World& world) {
  auto& known = registry();
  std::lock_guard<std::mutex> lock(known.mutex);
  auto& [impls, owner_world] =
      known.owners.insert_or_assign(owner, std::make_pair(std::vector<const c10::TensorImpl*>(),
                                                          world))
          .first->second;
  for (const auto& piece : pieces) {
    impls.push_back(piece.unsafeGetTensorImpl());
    known.world_of.insert_or_assign(piece.unsafeGetTensorImpl(), owner_world);
  }
}

void unregister_pieces(const void* owner) {
  auto& known = registry();
  std::lock_guard<std::mutex> lock(known.mutex);
  auto found = known.owners.find(owner);
  if (found == known.owners.end()) {
    return;
  }
  for (const auto* impl : found->second.first) {
    known.world_of.erase(impl);
  }
  known.owners.erase(found);
}

} // namespace lockstep::detail
