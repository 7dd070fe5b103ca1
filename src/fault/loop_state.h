#pragma once

// What a lockstep::FaultTolerance holds, shared by its two halves: the
// loop (fault_tolerance.cpp: begin_step, commit, the watch on the job's
// liveness) and the re-forming of the world after a failure or for a rank
// that joins (reform.cpp).

#include <chrono>
#include <exception>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <lockstep/fault_tolerance.h>

#include "fault/agreement.h"
#include "fault/guarded.h"
#include "fault/membership.h"
#include "fault/reachability.h"
#include "fault/scaler_registry.h"
#include "world/liveness.h"

namespace lockstep {

namespace detail {

class ShardedOptimizer;

/// The note that tells every watcher at once that an epoch was given up
/// ("ft abandon <epoch>"; the reason, signed, is in the store).
constexpr const char* kAbandonNote = "ft abandon ";

/// Proves and checks claims with `base`'s job secret.
Signer signer_of(const World& base);

/// Gives `epoch` up for every member: the first reason given stands in the
/// store, and a note wakes every watcher. Returns the reason that stands.
std::string give_up(Membership& membership, Liveness& liveness, int64_t epoch,
                    const std::string& why);

/// What the liveness thread watches: the current world and its members,
/// and why it gave that world up. Shared with the callback, which outlives
/// nothing: `alive` turns false before the loop goes.
struct Watch {
  std::mutex mutex;
  bool alive = true;
  int64_t epoch = -1;
  std::vector<Member> members;
  std::optional<World> world;
  /// The world that carries the live state to ranks that rejoin, while it
  /// does (given up with the epoch's).
  std::optional<World> transfer;
  std::string verdict;
  /// A rank asked to join a later epoch (kWantNote) since this world formed.
  bool join_asked = false;
  /// Over replica groups: this rank's group's world and its ranks
  /// (launcher rank, incarnation), set once; and why the group can train
  /// no more (a rank of it failed), or "".
  std::optional<World> group;
  std::vector<std::pair<int, int>> group_ranks;
  std::string group_lost;
};

/// Why `watch`'s replica group can train no more: the first of its ranks
/// that `liveness` sees failed; "" while all live, or without groups.
std::string group_failure(const Watch& watch, Liveness& liveness);

} // namespace detail

struct FaultTolerance::Impl {
  using Clock = std::chrono::steady_clock;
  std::shared_ptr<detail::Guarded> guarded;
  torch::optim::Optimizer& optimizer;
  /// `optimizer`, where it is a ZeroRedundancyOptimizer (over replica
  /// groups): a joining rank receives its local optimizer's state (the
  /// place's shard), asked for at each transfer (loading a checkpoint
  /// replaces it).
  detail::ShardedOptimizer* sharded = nullptr;
  FaultToleranceOptions options;
  World base;  // init()'s: the job's store
  World world; // the current epoch's
  detail::Member me;
  std::shared_ptr<detail::Liveness> liveness;
  // The main thread's connection, and the liveness thread's.
  std::unique_ptr<detail::Membership> membership;
  std::unique_ptr<detail::Membership> notices;
  std::unique_ptr<detail::Agreement> agreement;
  std::shared_ptr<detail::Watch> watch;
  int64_t epoch = -1;
  std::vector<detail::Member> members;
  int64_t committed = 0;
  bool holds_state = true;
  bool need_reform = false;
  /// Re-form only where a commit decided it (a dropped step, a rank asking
  /// to join), never on a failure this rank alone has seen so far: where
  /// the ranks are not in step between two steps (DiLoCo's inner steps, a
  /// replica group's collectives),
  /// one that had not seen it yet would begin the step in the old world
  /// while another waits for it in the new one, an interval away. Begun in
  /// the old world, the step fails there on every rank and is dropped.
  bool reform_only_when_decided = false;
  bool in_step = false;
  int64_t synchronisations_at_begin = 0;
  std::vector<at::Tensor> buffers;
  std::vector<at::Tensor> buffers_at_begin;
  struct UserState {
    std::string name;
    std::function<void(torch::serialize::OutputArchive&)> save;
    std::function<void(torch::serialize::InputArchive&)> load;
  };
  std::vector<UserState> user_states;
  /// `optimizer` known to GradScaler::step as guarded, with the scalers
  /// that travel with the state.
  std::unique_ptr<detail::GuardedOptimizer> guarded_optimizer;
  FaultToleranceStats stats;

  /// Over replica groups: the ranks per group (1: a rank is the unit),
  /// and this rank's group's world.
  int group_size = 1;
  std::optional<World> group;
  /// Across hosts: what the other ranks connect to when a world did not
  /// form, to tell a cut between hosts from a failure (reachability.h).
  std::unique_ptr<detail::ProbeListener> probe;

  Impl(std::shared_ptr<detail::Guarded> guarded_in,
       torch::optim::Optimizer& optimizer_in,
       FaultToleranceOptions options_in, World base_in)
      : guarded(std::move(guarded_in)),
        optimizer(optimizer_in),
        options(options_in),
        base(std::move(base_in)),
        world(guarded->world()) {}
  // Here, not in ~FaultTolerance: a constructor that throws after the
  // callback is set must not leave the liveness thread calling into freed
  // members.
  ~Impl() {
    if (watch) {
      liveness->on_change(nullptr);
      std::lock_guard<std::mutex> lock(watch->mutex);
      watch->alive = false;
    }
    // A loop that ended without an error is a clean end of this process,
    // even where its first world was given up (which the world's own close
    // takes for a failure): the goodbye, with the final progress, tells a
    // rank that dropped a step this one committed to leave, not train on.
    if (liveness && std::uncaught_exceptions() == 0) {
      liveness->goodbye();
    }
  }

  void say(const std::string& line) const {
    if (options.verbose()) {
      std::cerr << "lockstep: rank " << me.replica << ": " << line << std::endl;
    }
  }

  void progress(detail::Phase phase) {
    liveness->set_progress(detail::progress_of(committed, phase));
  }
  /// Decides the step (commit() and commit(sums)); `sums`, when given, is
  /// summed over the step's world in place before the verdict.
  bool commit(at::Tensor* sums);
  /// Why the current world was given up, or "".
  std::string verdict();
  /// Whether a rank asked to join since the current world formed.
  bool join_asked();
  /// From now on the liveness thread watches `next` and the epoch's
  /// members (`decided`); `ranked` are next's ranks, in its order.
  void watch_world(int64_t epoch, const std::vector<detail::Member>& decided,
                   const std::vector<detail::Member>& ranked, World next);
  /// The members of `decided` that form this rank's world: all of them,
  /// or over replica groups those of its place, in their groups' order.
  std::vector<detail::Member> at_my_place(const std::vector<detail::Member>& decided) const;
  /// The scope of the world of `epoch` at `place`.
  std::string world_scope(int64_t epoch, int place) const;
  /// Raises FaultToleranceError where this rank's replica group lost a rank.
  void check_group() const;
  /// Raises FaultToleranceError where this rank was restarted since (this
  /// process is stale).
  void check_not_replaced() const;
  /// Whether every rank of the replica group holds `holds` (true without
  /// groups: `holds` itself); `what` names it where the group lost a rank.
  bool agree_in_group(bool holds, const std::string& what);
  void reduce_in_group(at::Tensor& tensor, ReduceOp op, const std::string& what);
  /// Agrees inside the replica group on the step: whether every rank of
  /// it kept it (`kept` here), whether one saw a rank ask to join, and how
  /// each sums. Raises where the group lost a rank.
  void agree_on_step_in_group(bool& kept, bool& join, int64_t summing, at::Tensor* sums);
  /// Called on the liveness thread when the job's view changes.
  static void on_liveness(const std::shared_ptr<detail::Watch>& watch,
                          detail::Liveness& liveness, detail::Membership& notices,
                          const std::vector<std::string>& notes);
  void reform();
  /// Forms a world of epoch `target` among `ranked` under `scope`, given
  /// up where a member of `decided` fails meanwhile, or (`within_epoch`: a
  /// world formed inside the epoch's) where the epoch is given up.
  World form(int64_t target, const std::vector<detail::Member>& decided,
             const std::vector<detail::Member>& ranked, const std::string& scope,
             bool within_epoch = false);
  /// The live state from the member of `ranked` (next's ranks) that holds
  /// it to those behind it, who check it against its announcement.
  void bring_up_to_date(World& next, const std::vector<detail::Member>& ranked,
                        const std::vector<detail::Member>& decided, int64_t target);
  /// What `sender` announced it sent in `target` (Membership::state_claim);
  /// CollectiveError where the epoch is given up meanwhile, the store moved
  /// since `moves` (StoreClient::moves), or `deadline` passes.
  std::string await_announcement(int64_t target, const detail::Member& sender,
                                 const std::string& what, int moves,
                                 std::optional<Clock::time_point> deadline);
  /// The world that carries the live state now (none: nullopt), given up
  /// at once where the epoch already is.
  void set_transfer(std::optional<World> carrier);
  /// Where this rank is not a member of the latest epoch (left out by a
  /// cut, or restarted behind one), until it reaches every member of it:
  /// asking sooner would have them re-form a world that cannot form.
  /// Raises at `deadline`.
  void await_link(Clock::time_point deadline);
};
} // namespace lockstep
