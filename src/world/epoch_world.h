#pragma once

// The worlds of fault tolerance (fault_tolerance.h). The world that init()
// formed carries the job's store; after a failure the survivors, and any
// rank restarted since, form a new world among themselves from that store,
// under keys of their own, and give up the old one without waiting for it.

#include <string>

#include <c10/util/intrusive_ptr.h>

#include <lockstep/world.h>

namespace c10d {
class Store;
} // namespace c10d

namespace lockstep::detail {

struct WorldAccess {
  /// The rank the launcher gave this process (the slot a restart refills).
  static int replica(const World& world);
  /// How many times a launcher restarted this rank alone.
  static int incarnation(const World& world);
  /// How many ranks the launcher started.
  static int slots(const World& world);
  /// A proof that this process holds the job's secret, bound to `message`
  /// and the job's nonce ("-" for a job without a secret), and its check.
  static std::string prove(const World& world, const std::string& message);
  static bool proven(const World& world, const std::string& message, const std::string& proof);
  /// Whether init() gave this process a world of its own because it was
  /// restarted alone while the others go on (lockstep-run --restart rank).
  static bool standby(const World& world);
  /// A connection of this process's own to the job's store (for a thread).
  static c10::intrusive_ptr<c10d::Store> store_connection(const World& world);
  /// Collective among the `size` processes that call it with the same
  /// `scope`: a world over `base`'s job store in which this process is
  /// `rank`. Raises (RendezvousError, or the transport's) when a process
  /// does not come within the world's timeout.
  static World form(const World& base, int rank, int size, const std::string& scope);
  /// Every collective of `world`, waiting or to come, fails with
  /// CollectiveError saying `why`; its connections are let go of, not
  /// closed, since a stopped peer may hold them.
  static void abandon(const World& world, const std::string& why);
  /// Why `world` can run no collective, or "".
  static std::string broken(const World& world);
};

} // namespace lockstep::detail
