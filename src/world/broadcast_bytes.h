#pragma once

// Bytes from one rank to all, or from every rank to all: a serialized
// archive (a checkpoint read by rank 0 alone, an optimizer's state at the
// end of a join, the shards of a ZeroRedundancyOptimizer's state).

#include <string>
#include <vector>

#include <lockstep/world.h>

namespace lockstep::detail {

/// Collective: every rank's `bytes` becomes rank `root`'s (its size first,
/// then its contents). `what` names the broadcasts in errors; empty, they
/// get World's default names.
void broadcast_bytes(World& world, int root, std::string& bytes, const std::string& what);

/// `bytes` as a 1-D uint8 tensor, and such a tensor's bytes.
at::Tensor tensor_of_bytes(const std::string& bytes);
std::string bytes_of_tensor(const at::Tensor& tensor);

/// Collective: each rank's `bytes`, on every rank (an all-gather of the
/// sizes, then of the bytes padded to the largest).
std::vector<at::Tensor> gather_bytes(World& world, const std::string& bytes);

} // namespace lockstep::detail
