#pragma once

// The definition of each collective, checked on a formed world: sums,
// averages and minima bit for bit against the definition on values whose
// sums are exact in every dtype; values that round, as close to the exact
// sum as the dtype allows and the same bits on every rank; broadcast and
// all_gather bit for bit; reduce_scatter and all_gather_into likewise (a
// reduce-scatter into a slice of its own input too). Over float32, float64,
// bfloat16 and float16, sizes from one element to a million (odd ones included) and, when `large`,
// float32 at 64 MiB; the program's own tensors and World::allocate's; views
// of every kind (narrow, select, transpose: the view's elements change and
// nothing else), and an expanded tensor refused.
// Used by the transport tests and, across network namespaces, by
// tests/programs/check_collectives.

#include <string>
#include <vector>

#include <lockstep/world.h>

namespace lockstep::testing {

/// Every difference from the definition, one line each; empty when none.
std::vector<std::string> check_collectives(World& world, bool large);

} // namespace lockstep::testing
