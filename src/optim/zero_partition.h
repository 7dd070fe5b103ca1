#pragma once

// One group's share of partition_parameter_groups, for an optimizer that
// takes its groups one at a time (ZeroRedundancyOptimizer::add_param_group).

#include <cstdint>
#include <vector>

#include <lockstep/zero_redundancy_optimizer.h>

namespace lockstep::detail {

/// Appends the pieces of group `group`, whose parameters of `numels`
/// elements are numbered from `first`; `owned` holds each rank's elements
/// so far (its size is the world's), and grows by the group's.
void partition_group(const std::vector<int64_t>& numels, size_t first, size_t group,
                     ZeroPartition partition, std::vector<int64_t>& owned,
                     std::vector<ZeroPiece>& pieces);

} // namespace lockstep::detail
