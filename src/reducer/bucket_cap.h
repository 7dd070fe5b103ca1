#pragma once

// The bucket size when DdpOptions::bucket_cap_mb is unset. Across hosts the
// best size depends on whether the wire or the computation bounds an
// iteration (bench-hosts.md, the 10.5M MLP with fp16): where the wire
// takes several times as long as backward (1 Gbit/s), 1 MiB buckets cost
// nothing (level with 25 MiB, 4% faster in one run), since each gradient
// starts crossing as soon as it is ready and the wire never waits for a
// bucket to fill; where they are comparable (10 Gbit/s), 1 MiB buckets were
// 20% slower, since each collective has a fixed cost and overlap hides the
// wire anyway.

#include <lockstep/world.h>

namespace lockstep::detail {

/// Collective: what the link between hosts carries, in bytes per second,
/// from a 4 MiB all-reduce timed on every rank (the slowest rank's time,
/// so that every rank gets the same figure); 0 when every rank shares a
/// host.
double measure_link(World& world);

/// The cap in MiB after the first iteration: 1 when the gradients'
/// `gradient_bytes` take more than 4 times the backward's computation
/// (`backward_seconds`, from the first gradient to the last bucket's
/// launch) on a link of
/// `link_bytes_per_second`, else 25.
double automatic_bucket_cap_mb(double gradient_bytes,
                               double link_bytes_per_second,
                               double backward_seconds);

/// The cap when none is set and before the first iteration is timed.
constexpr double kDefaultBucketCapMb = 25.0;

} // namespace lockstep::detail
