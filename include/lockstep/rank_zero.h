#pragma once

// Lines printed once per job, not once per rank:
//
//   lockstep::on_rank_zero(world) << "epoch " << epoch << " loss " << loss << std::endl;
//
// Every rank evaluates the expression (so a collective inside it still
// runs everywhere); only rank 0's text reaches `out`. It is `out` itself on
// rank 0: flags set through it (precision, hex) stay set there. On the
// other ranks the stream is in a failed state from the start, so test
// nothing on it, and it has no buffer. Under
// FaultTolerance, pass ft.world(): rank 0 of the current world, whichever
// process that is. To keep other ranks' lines too, see
// `lockstep-run --ranks-filter`.

#include <iostream>

#include <lockstep/world.h>

namespace lockstep {

/// `out` on rank 0 of `world`, a stream that discards everything on the
/// other ranks.
std::ostream& on_rank_zero(const World& world, std::ostream& out = std::cout);

} // namespace lockstep
