#pragma once

// The casts behind the 16-bit hooks, for DDP's mixed-precision policy too,
// which averages in its reduce_dtype through them.

#include <ATen/core/ScalarType.h>

#include <lockstep/comm_hook.h>

namespace lockstep::detail {

/// Averages each bucket in `wire`: this rank's gradients divided by the
/// world size and rounded once, summed (in float32 for a 16-bit `wire`),
/// written back in the gradients' dtype.
CommHook compress_to(at::ScalarType wire);
/// Runs `inner` on the bucket's gradients in `wire`, and writes its result
/// back in the gradients' dtype.
CommHook wrap_in(at::ScalarType wire, CommHook inner);

} // namespace lockstep::detail
