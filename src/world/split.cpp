// Sub-worlds (replica_groups.h): the ranks of a color learn each other's
// colors through the parent's store, then form a world of their own as the
// worlds of fault tolerance are formed (epoch_world.h), under keys that
// name the parent world, the split and the color, so that no two sub-worlds
// of a job share a key.

#include <lockstep/replica_groups.h>

#include <algorithm>
#include <string>

#include "common/wording.h"
#include "fault/group_rendezvous.h"
#include "world/epoch_world.h"
#include "world/world_impl.h"

namespace lockstep {
namespace detail {

World WorldAccess::split(const World& world, int color) {
  auto colors = const_cast<World&>(world).all_gather_strings(std::to_string(color));
  // After the exchange, so that every rank raises alike.
  for (size_t r = 0; r < colors.size(); ++r) {
    LOCKSTEP_ENFORCE(colors[r].rfind('-', 0) != 0, UsageError, "split: a color is 0 or more; "
                     "rank ", r, " passed ", colors[r], ".");
  }
  // The same on every rank: the parent's gathers so far, this one included.
  uint64_t split_number = world.impl_->string_gather_count;
  int rank = 0;
  int size = 0;
  for (int r = 0; r < static_cast<int>(colors.size()); ++r) {
    if (colors[static_cast<size_t>(r)] == std::to_string(color)) {
      rank += r < world.rank() ? 1 : 0;
      ++size;
    }
  }
  // The parent's place under the job's prefix ("" for init()'s world), so
  // that the scope grows by a few characters per level, not doubles.
  std::string parent = world.impl_->config.key_prefix;
  const std::string& job = world.impl_->job_store->key_prefix();
  if (parent.rfind(job, 0) == 0) {
    parent = parent.substr(job.size());
  }
  std::replace(parent.begin(), parent.end(), '/', '.');
  return form(world, rank, size, str("split", split_number, "c", color, "of", parent));
}

} // namespace detail

World split(const World& world, int color) {
  return detail::WorldAccess::split(world, color);
}

ReplicaGroups replica_groups(const World& world, int ranks_per_replica) {
  if (detail::WorldAccess::standby(world)) {
    // Restarted: its group was restarted as a unit, and forms again.
    int per = ranks_per_replica == 0 ? detail::WorldAccess::slots_per_host(world)
                                     : ranks_per_replica;
    LOCKSTEP_ENFORCE(per > 0 && detail::WorldAccess::slots(world) % per == 0, ConfigError,
                     "replica_groups: ", per, " ranks per replica do not divide the job's ",
                     detail::WorldAccess::slots(world), " ranks.");
    return ReplicaGroups{detail::rejoin_group(world, per), world, world};
  }
  int per = ranks_per_replica == 0 ? world.local_size() : ranks_per_replica;
  // The hosts may differ (local_size): every rank learns every rank's
  // count, and raises alike.
  auto counts = const_cast<World&>(world).all_gather_strings(std::to_string(per));
  LOCKSTEP_ENFORCE(std::all_of(counts.begin(), counts.end(),
                               [&](const std::string& c) { return c == counts[0]; }),
                   ConfigError, "replica_groups: the ranks differ on the ranks per replica ",
                   "(rank 0: ", counts[0], "); pass ranks_per_replica.");
  LOCKSTEP_ENFORCE(per > 0 && world.size() % per == 0, ConfigError, "replica_groups: ",
                   per, " ranks per replica do not divide the world's ", world.size(),
                   " ranks.");
  World replica = split(world, world.rank() / per);
  World across = split(world, world.rank() % per);
  return ReplicaGroups{std::move(replica), std::move(across), world};
}

} // namespace lockstep
