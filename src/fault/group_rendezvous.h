#pragma once

// A replica group that comes back as a unit under a FaultTolerance over
// replica groups (fault_tolerance.h): see group_rendezvous.cpp.

#include <lockstep/world.h>

namespace lockstep::detail {

/// The world of this rank's replica group (launcher ranks cut into groups
/// of `group_size`), formed again after the group was restarted as a unit:
/// `world` is a restarted rank's world of its own, and the group's other
/// ranks, restarted too, call this as well. Raises FaultToleranceError
/// where the job's loop has ended meanwhile (nothing to rejoin), and
/// RendezvousError where the others do not all come within the world's
/// timeout.
World rejoin_group(const World& world, int group_size);

} // namespace lockstep::detail
