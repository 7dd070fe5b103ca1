#pragma once

// The decisions of a fault-tolerant loop, through the job's store
// (membership.h) and its liveness (world/liveness.h): who trains in the
// next world. (Whether a step counts is decided in the step's own world,
// fault_tolerance.cpp, off the store.) FaultTolerance runs them for
// its process; bench/ft_scale runs them for a thousand simulated members,
// with no model and no world, to measure what they cost at scale.

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fault/membership.h"
#include "store/liveness_table.h"

namespace lockstep::detail {

class Liveness;

/// Where a member is in the loop, sent with its heartbeat: 4 per
/// committed step, plus the phase within the next one. A judge of hangs
/// compares members by it.
enum class Phase : int64_t { Between = 0, InStep = 1, Voted = 2, Dropped = 3 };

inline int64_t progress_of(int64_t committed, Phase phase) {
  return committed * 4 + static_cast<int64_t>(phase);
}

/// The note by which a rank that asks to join tells every watcher at once
/// ("ft want <epoch>"); the members re-form after the step in which any of
/// them saw it (agreed inside the step's commit, no store operation).
constexpr const char* kWantNote = "ft want ";

struct AgreementOptions {
  int min_world_size = 1;
  std::chrono::milliseconds step_timeout{0};
  std::chrono::milliseconds timeout{0};
  /// Over replica groups: the ranks per group (consecutive launcher
  /// ranks), which train only together.
  int group_size = 1;
  /// Why this member can no longer take part (its replica group lost a
  /// rank), or "": asked at every look while it waits.
  std::function<std::string()> unable;
};

/// Of `candidates`, those whose replica group (`group_size` consecutive
/// launcher ranks) came whole, in the order of their launcher ranks. (A
/// group's ranks may hold unlike states, where one place received the
/// live state and another failed to: each place's world then brings its
/// own up to date. A restarted rank never comes beside a survivor of its
/// group's failure: it comes only once its group formed again, of ranks
/// all restarted since.)
std::vector<Member> whole_groups(const std::vector<Member>& candidates, int group_size);

class Agreement {
 public:
  using Clock = std::chrono::steady_clock;

  Agreement(Membership& membership, Liveness& liveness, AgreementOptions options);

  /// Announces `me` for the epoch after the latest and waits until that
  /// epoch is decided: returns its number and members (which may leave
  /// `me` out), or nullopt when the job moved past it (announce again).
  /// One member decides: the live member of the last world with the
  /// lowest rank, once every member of that world has come or failed. A
  /// rank that is no member of the last world (restarted, or dropped)
  /// asks the members to come by a note (kWantNote), again now and then.
  std::optional<std::pair<int64_t, std::vector<Member>>> next_epoch(const Member& me,
                                                                   Clock::time_point deadline);

  /// The latest epoch, as `me` reads it before it comes (Membership::latest):
  /// where the store holds one it must ignore and it has read none, it asks
  /// the members to come (for any later epoch: the first that reads the
  /// latest writes the genuine one back), or, where the loop ended meanwhile
  /// and it holds no state, leaves (leave_ended_job).
  Epoch latest_before_coming(const Member& me);

  /// Reports the members of `among` that the store shows alive as hung,
  /// saying that they have not done `what`; returns them.
  std::vector<Member> report_laggards(const std::vector<Member>& among, const std::string& what);

 private:
  /// The progress of a member of `members` (alive, or ended cleanly) that
  /// committed more steps than `me`, if one did (one store read).
  std::optional<store::SlotProgress> passed_by(const std::vector<Member>& members,
                                               const Member& me);

  Membership& membership_;
  Liveness& liveness_;
  AgreementOptions options_;
};

} // namespace lockstep::detail
