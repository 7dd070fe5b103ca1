#pragma once

// The worlds of fault tolerance (fault_tolerance.h). The world that init()
// formed carries the job's store; after a failure the survivors, and any
// rank restarted since, form a new world among themselves from that store,
// under keys of their own, and give up the old one without waiting for it.

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>

#include <lockstep/world.h>

namespace lockstep::store {
class StoreClient;
} // namespace lockstep::store

namespace lockstep::detail {

class Liveness;

struct WorldAccess {
  /// The rank the launcher gave this process (the slot a restart refills).
  static int replica(const World& world);
  /// How many times a launcher restarted this rank alone.
  static int incarnation(const World& world);
  /// How many ranks the launcher started.
  static int slots(const World& world);
  /// Whether `world` is the one init() formed (or gave a restarted rank).
  static bool formed_by_init(const World& world);
  /// How many of them on each host (a replica group's size by default).
  static int slots_per_host(const World& world);
  /// A proof that this process holds the job's secret, bound to `message`
  /// and the job's nonce ("-" for a job without a secret), and its check.
  static std::string prove(const World& world, const std::string& message);
  static bool proven(const World& world, const std::string& message, const std::string& proof);
  /// Whether init() gave this process a world of its own because it was
  /// restarted alone while the others go on (lockstep-run --restart rank).
  static bool standby(const World& world);
  /// Whether the job may span hosts (its store is reached over a network).
  static bool across_hosts(const World& world);
  /// The address the job's other hosts reach this process at (127.0.0.1
  /// on one host).
  static std::string local_address(const World& world);
  /// Whether the job has a secret (WorldOptions::secret).
  static bool has_secret(const World& world);
  /// This process's part in the job's liveness, started if need be, with
  /// `heartbeat_timeout` declared from now on.
  static std::shared_ptr<Liveness> liveness(const World& world,
                                            std::chrono::milliseconds heartbeat_timeout);
  /// A connection of this process's own to the job's store, and the prefix
  /// of the job's keys there.
  static std::unique_ptr<store::StoreClient> store_client(const World& world);
  static const std::string& key_prefix(const World& world);
  /// Whether `a` and `b` are one world (copies of the same World).
  static bool same(const World& a, const World& b);
  /// Deletes what the world formed under `scope` left in the job's store
  /// and beside it (JobStore::retire).
  static void retire(const World& world, const std::string& scope);
  /// A collective of `world` that waits `timeout` calls `report` once with
  /// the ranks that have not reached it (hung, to fault tolerance).
  static void watch_hangs(const World& world, std::chrono::milliseconds timeout,
                          std::function<void(const std::vector<int>& ranks,
                                             const std::string& what)> report);
  /// Collective among the `size` processes that call it with the same
  /// `scope`: a world over `base`'s job store in which this process is
  /// `rank`. Raises (RendezvousError, or the transport's) when a process
  /// does not come within the world's timeout.
  static World form(const World& base, int rank, int size, const std::string& scope);
  /// lockstep::split (replica_groups.h), which needs the world's own key
  /// prefix to name its sub-worlds' keys apart from every other world's.
  static World split(const World& world, int color);
  /// Every collective of `world`, waiting or to come, fails with
  /// CollectiveError saying `why`; once the world is let go of, what it
  /// held is released on a thread of its own (a stopped peer may hold its
  /// Gloo threads until Gloo's timeout).
  static void abandon(const World& world, const std::string& why);
  /// Why `world` can run no collective, or "".
  static std::string broken(const World& world);
  /// sharded_collectives.h's, on flat contiguous tensors of one dtype whose
  /// sizes were checked.
  static void all_gather_into(const World& world, const at::Tensor& output,
                              const at::Tensor& input, const std::string& description);
  /// all_gather_into that runs while the caller goes on (a prefetch);
  /// `output` and `input` must live until it is waited for.
  static PendingCollective all_gather_into_async(const World& world, const at::Tensor& output,
                                                 const at::Tensor& input,
                                                 const std::string& description);
  static void reduce_scatter(const World& world, const at::Tensor& output,
                             const at::Tensor& input, ReduceOp op,
                             const std::string& description);
  /// A summing reduce_scatter that runs while the caller goes on (a
  /// sharded bucket). `input` is spent: where the transport has no
  /// reduce-scatter of its own, its first `unpadded` elements are
  /// all-reduced in place (the rest are zeros on every rank) and this
  /// rank's slice copied out at the wait, so that the sums are those of an
  /// all-reduce of the unpadded tensor to the bit. Both must live until it
  /// is waited for.
  static PendingCollective reduce_scatter_async(const World& world, const at::Tensor& output,
                                                const at::Tensor& input, int64_t unpadded,
                                                const std::string& description);
};

} // namespace lockstep::detail
