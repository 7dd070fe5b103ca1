// The gradients a ZeroRedundancyOptimizer's shard steps with under
// DdpOptions::shard_gradients (ZeRO-2), as fault tolerance over replica
// groups averages them across the groups (each rank with the ranks of its
// place, which own the same shard): only the shard's elements exist on a
// rank, and they are averaged where step() reads them.

#include <ATen/ATen.h>

#include <lockstep/zero_redundancy_optimizer.h>

namespace lockstep::detail {

std::vector<at::Tensor> ShardedOptimizer::shard_gradients() const {
  TORCH_INTERNAL_ASSERT(by_buckets(), "the gradients are sharded only under shard_gradients");
  std::vector<at::Tensor> gradients;
  for (const auto& piece : shard_) {
    // The pieces' gradients are the buckets' slices (take_average).
    const auto& grad = piece.grad();
    gradients.push_back(grad.defined() ? grad.view({-1}) : at::Tensor());
  }
  return gradients;
}

void ShardedOptimizer::give_shard_gradient(size_t i, const at::Tensor& flat) {
  TORCH_INTERNAL_ASSERT(by_buckets() && i < shard_.size() && flat.numel() == shard_[i].numel());
  shard_[i].mutable_grad() = flat.view(shard_[i].sizes());
}

} // namespace lockstep::detail
