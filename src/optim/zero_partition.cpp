// Who owns what in a ZeroRedundancyOptimizer: PyTorch's rule (whole
// parameters, largest first, to the least loaded rank) or equal slices.

#include "optim/zero_partition.h"

#include <algorithm>
#include <numeric>

namespace lockstep {
namespace detail {

void partition_group(const std::vector<int64_t>& numels, size_t first, size_t group,
                     ZeroPartition partition, std::vector<int64_t>& owned,
                     std::vector<ZeroPiece>& pieces) {
  int world_size = static_cast<int>(owned.size());
  if (partition == ZeroPartition::Elements) {
    int64_t total = std::accumulate(numels.begin(), numels.end(), int64_t{0});
    int64_t slice = std::max<int64_t>(1, (total + world_size - 1) / world_size);
    int64_t start = 0; // of the current parameter, end to end
    for (size_t index = 0; index < numels.size(); ++index) {
      for (int64_t offset = 0; offset < numels[index];) {
        int owner = static_cast<int>((start + offset) / slice);
        int64_t length = std::min(numels[index] - offset, (owner + 1) * slice - start - offset);
        pieces.push_back({first + index, offset, length, owner, group});
        owned[owner] += length;
        offset += length;
      }
      start += numels[index];
    }
    return;
  }
  std::vector<size_t> largest_first(numels.size());
  std::iota(largest_first.begin(), largest_first.end(), 0);
  std::stable_sort(largest_first.begin(), largest_first.end(),
                   [&](size_t a, size_t b) { return numels[a] > numels[b]; });
  size_t base = pieces.size();
  pieces.resize(base + numels.size());
  for (size_t index : largest_first) {
    int rank = static_cast<int>(std::min_element(owned.begin(), owned.end()) - owned.begin());
    pieces[base + index] = {first + index, 0, numels[index], rank, group};
    owned[rank] += numels[index];
  }
}

} // namespace detail

std::vector<ZeroPiece> partition_parameter_groups(
    const std::vector<std::vector<int64_t>>& numels, int world_size, ZeroPartition partition) {
  std::vector<ZeroPiece> pieces;
  std::vector<int64_t> owned(world_size, 0);
  size_t first = 0;
  for (size_t group = 0; group < numels.size(); ++group) {
    detail::partition_group(numels[group], first, group, partition, owned, pieces);
    first += numels[group].size();
  }
  return pieces;
}

std::vector<ZeroPiece> partition_parameters(const std::vector<int64_t>& numels, int world_size,
                                            ZeroPartition partition) {
  return partition_parameter_groups({numels}, world_size, partition);
}

} // namespace lockstep
