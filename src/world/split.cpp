// Sub-worlds (replica_groups.h): the ranks of a color learn each other's
// colors through the parent's store, then form a world of their own as the
// worlds of fault tolerance are formed (epoch_world.h), under keys that
// name the parent world, the split and the color, so that no two sub-worlds
// of a job share a key.

#include <lockstep/replica_groups.h>

#include <algorithm>
#include <string>

#include "common/wording.h"
#include "world/epoch_world.h"
#include "world/world_impl.h"

namespace lockstep {
namespace detail {

World WorldAccess::split(const World& world, int color) {
  LOCKSTEP_ENFORCE(color >= 0, UsageError, "split: a color is 0 or more, not ", color, ".");
  auto colors = const_cast<World&>(world).all_gather_strings(std::to_string(color));
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
  std::string parent = world.impl_->config.key_prefix;
  std::replace(parent.begin(), parent.end(), '/', '.');
  return form(world, rank, size, str("split", split_number, "c", color, "of", parent));
}

} // namespace detail

World split(const World& world, int color) {
  return detail::WorldAccess::split(world, color);
}

ReplicaGroups replica_groups(const World& world, int ranks_per_replica) {
  int per = ranks_per_replica == 0 ? world.local_size() : ranks_per_replica;
  LOCKSTEP_ENFORCE(per > 0 && world.size() % per == 0, ConfigError, "replica_groups: ",
                   per, " ranks per replica do not divide the world's ", world.size(),
                   " ranks.");
  World replica = split(world, world.rank() / per);
  World across = split(world, world.rank() % per);
  return ReplicaGroups{std::move(replica), std::move(across)};
}

} // namespace lockstep
