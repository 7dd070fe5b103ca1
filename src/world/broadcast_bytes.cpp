#include "world/broadcast_bytes.h"

#include <algorithm>
#include <cstring>

#include <ATen/ATen.h>

namespace lockstep::detail {

void broadcast_bytes(World& world, int root, std::string& bytes, const std::string& what) {
  auto size = at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong);
  world.broadcast(size, root, what.empty() ? what : "size of " + what);
  auto data = world.rank() == root ? tensor_of_bytes(bytes)
                                   : at::empty({size.item<int64_t>()}, at::kByte);
  world.broadcast(data, root, what);
  if (world.rank() != root) {
    bytes = bytes_of_tensor(data);
  }
}

at::Tensor tensor_of_bytes(const std::string& bytes) {
  auto tensor = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(tensor.data_ptr(), bytes.data(), bytes.size());
  return tensor;
}

std::string bytes_of_tensor(const at::Tensor& tensor) {
  auto contiguous = tensor.contiguous();
  return {static_cast<const char*>(contiguous.data_ptr()), static_cast<size_t>(contiguous.numel())};
}

std::vector<at::Tensor> gather_bytes(World& world, const std::string& bytes) {
  auto sizes = world.all_gather(at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong));
  int64_t widest = 0;
  for (const auto& size : sizes) {
    widest = std::max(widest, size.item<int64_t>());
  }
  auto mine = at::zeros({widest}, at::kByte);
  std::memcpy(mine.data_ptr(), bytes.data(), bytes.size());
  auto all = world.all_gather(mine);
  for (size_t rank = 0; rank < all.size(); ++rank) {
    all[rank] = all[rank].narrow(0, 0, sizes[rank].item<int64_t>());
  }
  return all;
}

} // namespace lockstep::detail
