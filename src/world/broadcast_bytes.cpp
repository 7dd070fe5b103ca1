#include "world/broadcast_bytes.h"

#include <cstring>

#include <ATen/ATen.h>

namespace lockstep::detail {

void broadcast_bytes(World& world, int root, std::string& bytes, const std::string& what) {
  auto size = at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong);
  world.broadcast(size, root, what.empty() ? what : "size of " + what);
  auto data = at::empty({size.item<int64_t>()}, at::kByte);
  if (world.rank() == root) {
    std::memcpy(data.data_ptr(), bytes.data(), bytes.size());
  }
  world.broadcast(data, root, what);
  if (world.rank() != root) {
    bytes.assign(static_cast<const char*>(data.data_ptr()), static_cast<size_t>(data.numel()));
  }
}

} // namespace lockstep::detail
