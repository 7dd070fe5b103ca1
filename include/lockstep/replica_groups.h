#pragma once

// Worlds within a world. Hierarchical training runs per-step DDP inside a
// replica (the ranks of one host, over shared memory) and synchronises the
// replicas across the slow link only now and then (DiLoCo, LocalSGD): each
// rank then belongs to two worlds, its replica's and the one of the ranks
// that hold the same part in every other replica.
//
//   auto groups = lockstep::replica_groups(world);   // a replica per host
//   lockstep::DDP<Net> ddp(model, groups.replica);   // every step, in the host
//   lockstep::DiLoCo diloco(groups.across, ...);     // every H steps, across

#include <lockstep/world.h>

namespace lockstep {

/// Collective over `world`: the ranks that pass the same `color` (0 or
/// more) form a world of their own, ranked in `world`'s order. Every
/// collective of it runs among them alone, over the transports that fit
/// them (shared memory among the ranks of one host, Gloo across hosts).
World split(const World& world, int color);

struct ReplicaGroups {
  /// This rank's replica: ranks_per_replica consecutive ranks of the world.
  World replica;
  /// The ranks that hold this rank's place (replica.rank()) in every
  /// replica.
  World across;
  /// The world they were cut from.
  World parent;
};

/// Collective over `world`: its ranks cut into replicas of
/// `ranks_per_replica` consecutive ranks (0: world.local_size(), a replica
/// per host as lockstep-run numbers them). Raises ConfigError unless it
/// divides the world's size. On a rank that lockstep-run restarted alone
/// (--restart rank), under a FaultTolerance over replica groups: local to
/// its group, whose other ranks were restarted with it; `replica` is the
/// group's world formed anew, and `across` the rank's world of its own,
/// until FaultTolerance takes the group back in.
ReplicaGroups replica_groups(const World& world, int ranks_per_replica = 0);

} // namespace lockstep
