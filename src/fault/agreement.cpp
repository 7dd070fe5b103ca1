#include "fault/agreement.h"

#include <algorithm>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include <lockstep/error.h>

#include "common/wording.h"
#include "fault/reachability.h"
#include "fault/store_guarded.h"
#include "world/liveness.h"

namespace lockstep::detail {
namespace {

// How long a wait on the store lasts before this member looks around (its
// world given up, a hang to judge, the limit).
constexpr auto kLook = std::chrono::milliseconds(50);

bool same_process(const Member& a, const Member& b) {
  return a.replica == b.replica && a.incarnation == b.incarnation;
}

} // namespace

std::vector<Member> whole_groups(const std::vector<Member>& candidates, int group_size) {
  if (group_size == 1) {
    return candidates;
  }
  std::map<int, std::vector<Member>> groups;
  for (const auto& member : candidates) {
    groups[member.replica / group_size].push_back(member);
  }
  std::vector<Member> whole;
  for (auto& [group, members] : groups) {
    std::set<int> places;
    for (const auto& member : members) {
      places.insert(member.replica % group_size);
    }
    if (static_cast<int>(places.size()) == group_size &&
        static_cast<int>(members.size()) == group_size) {
      std::sort(members.begin(), members.end(),
                [](const Member& a, const Member& b) { return a.replica < b.replica; });
      whole.insert(whole.end(), members.begin(), members.end());
    }
  }
  return whole;
}

Agreement::Agreement(Membership& membership, Liveness& liveness, AgreementOptions options)
    : membership_(membership), liveness_(liveness), options_(options) {}

Epoch Agreement::latest_before_coming(const Member& me) {
  return membership_.latest([&] {
    if (me.step < 0 && membership_.finished()) {
      leave_ended_job(membership_, me.replica, me.incarnation);
    }
    store_guarded("asked to join", [&] {
      liveness_.note(kWantNote + std::to_string(std::numeric_limits<int64_t>::max()));
    });
  });
}

std::optional<std::pair<int64_t, std::vector<Member>>> Agreement::next_epoch(
    const Member& me, Clock::time_point deadline) {
  auto latest = latest_before_coming(me);
  int64_t target = latest.number + 1;
  membership_.arrive(target, me);
  const auto& expected = latest.members;
  // The members of the last world come at a failure of their own; a rank
  // that is not one of them asks them to (they see it at their next
  // commit), again now and then, as a note may reach a member between two
  // worlds and go unread.
  bool asking = std::none_of(expected.begin(), expected.end(),
                             [&](const Member& m) { return same_process(m, me); });
  auto ask = [&] {
    if (asking) {
      store_guarded("asked to join", [&] { liveness_.note(kWantNote + std::to_string(target)); });
    }
  };
  ask();
  auto start = Clock::now();
  bool judged = false;
  std::optional<Clock::time_point> state_gone_since;
  auto decided = [&](std::vector<Member> members) {
    return std::optional<std::pair<int64_t, std::vector<Member>>>({target, std::move(members)});
  };
  auto failed = [&](const Member& m) { return liveness_.failed(m.replica, m.incarnation); };
  for (int look = 0;; ++look) {
    if (options_.unable) {
      if (auto why = options_.unable(); !why.empty()) {
        // A rank of its group that left an ended loop is no failure: this
        // rank leaves as well.
        if (membership_.finished()) {
          if (me.step < 0) {
            leave_ended_job(membership_, me.replica, me.incarnation);
          }
          membership_.left(me.replica, me.incarnation, kLeft);
        }
        LOCKSTEP_FAIL(FaultToleranceError, "rank ", me.replica, ": ", why);
      }
    }
    // One member decides: the live member of the last world with the
    // lowest rank (where none lives, the lowest that arrived). It waits
    // until every live member of the last world has come (one parked
    // request, answered at the last arrival); the others wait on the
    // epoch's key, and look again now and then.
    std::vector<Member> live;
    std::copy_if(expected.begin(), expected.end(), std::back_inserter(live),
                 [&](const Member& m) { return !failed(m); });
    bool deciding = live.empty() || same_process(live.front(), me);
    if (deciding && !live.empty()) {
      membership_.await_arrivals(target, live, kLook);
    } else if (auto members = membership_.await_members(target, kLook)) {
      return decided(*members);
    }
    if (look % 100 == 99) {
      ask(); // every 5 s: the store keeps the last notes only, for everyone
    }
    bool waited_long = Clock::now() - start >= options_.step_timeout;
    // The epoch's key is a copy that a decider which died at once may not
    // have written: the latest epoch says it too (read now and then only,
    // as a thousand members would read it at every look).
    if (deciding || waited_long || look % 20 == 19) {
      auto now = membership_.latest();
      if (now.number >= target) {
        return now.number == target ? decided(now.members) : std::nullopt;
      }
    }
    if (me.step < 0 && membership_.finished()) {
      leave_ended_job(membership_, me.replica, me.incarnation);
    }
    if (!deciding && !waited_long && Clock::now() < deadline) {
      continue;
    }
    std::vector<Member> candidates;
    for (const auto& arrival : membership_.arrivals(target)) {
      if (!failed(arrival) && arrival.incarnation >= liveness_.incarnation_of(arrival.replica)) {
        candidates.push_back(arrival);
      }
    }
    candidates = whole_groups(candidates, options_.group_size);
    if (live.empty() && !candidates.empty()) {
      deciding = same_process(candidates.front(), me);
    }
    auto arrived = [&](const Member& m) {
      return std::any_of(candidates.begin(), candidates.end(),
                         [&](const Member& c) { return same_process(c, m); });
    };
    std::vector<Member> absent; // alive, but not come: in a step still, or hung
    std::copy_if(live.begin(), live.end(), std::back_inserter(absent),
                 [&](const Member& m) { return !arrived(m); });
    // A member of the last world that committed a step this rank dropped
    // (its verdict completed where this rank's alone failed) holds a later
    // state. Until it has come, this rank never decides a world without
    // it, nor judges it hung: it comes back (this rank then receives its
    // state), or it ends its loop, and then this rank leaves (its state is
    // not the job's); if neither happens within the timeout, this rank
    // ends (a restart then receives the state).
    std::vector<Member> not_come;
    std::copy_if(expected.begin(), expected.end(), std::back_inserter(not_come),
                 [&](const Member& m) { return !arrived(m) && !same_process(m, me); });
    if (me.step >= 0 && !not_come.empty()) {
      if (auto ahead = passed_by(not_come, me)) {
        if (ahead->state == store::SlotState::Ended) {
          membership_.left(me.replica, me.incarnation, kLeft);
          LOCKSTEP_FAIL(FaultToleranceError, "rank ", me.replica, " dropped step ", me.step,
                        " while rank ", ahead->slot, " committed it and ended its loop: the "
                        "job's state is the others', and this rank leaves with nothing to "
                        "rejoin.");
        }
        LOCKSTEP_ENFORCE(Clock::now() < deadline, FaultToleranceError, "rank ", me.replica,
                         " dropped step ", me.step, " while rank ", ahead->slot, " committed "
                         "it, and rank ", ahead->slot, " neither came back nor ended within "
                         "FaultToleranceOptions::timeout (", seconds(options_.timeout), "): "
                         "this rank ends rather than train on from an older state.");
        continue;
      }
    }
    // Hung: alive, but not come this long after others of the same world
    // came. (A rank that asks to join judges no one: the others are
    // training, and come at their next step.)
    if (waited_long && !judged && !absent.empty() && absent.size() < live.size()) {
      judged = true;
      report_laggards(absent, str("come back for epoch ", target));
      continue;
    }
    int64_t lineage = membership_.lineage();
    // A member that received (or sent) the state a world began from holds
    // it, whether or not that world was marked formed before it failed;
    // over replica groups, at every place of a group (each holds a part).
    auto state_lives_in = [&](const std::vector<Member>& among) {
      bool lives = !among.empty();
      for (int place = 0; place < options_.group_size; ++place) {
        lives = lives && std::any_of(among.begin(), among.end(), [&](const Member& c) {
          return c.replica % options_.group_size == place && c.step >= 0 &&
              c.trained >= lineage;
        });
      }
      return lives;
    };
    bool state_lives = state_lives_in(candidates);
    // Where a cut between hosts kept the last world from forming, one side
    // of it (reachability.h): the one that holds the live state, is large
    // enough, is furthest on (a step that only it committed is not lost),
    // is largest, holds the lowest rank. The others, come but cut off,
    // wait until they reach it.
    std::vector<Member> reachable;
    auto score = [&](const std::vector<Member>& side) {
      int64_t furthest = -1;
      for (const auto& m : side) {
        furthest = std::max(furthest, m.step);
      }
      return std::make_tuple(state_lives_in(side),
                             static_cast<int>(side.size()) >= options_.min_world_size, furthest,
                             side.size());
    };
    for (const auto& side : reachable_sides(candidates)) {
      auto whole = whole_groups(side, options_.group_size);
      if (reachable.empty() || score(whole) > score(reachable)) { // ties: the lower ranks'
        reachable = std::move(whole);
      }
    }
    if (!state_lives && absent.empty() && !candidates.empty() && me.step < 0) {
      // The ranks that held the state may have ended their loop: each
      // exits, and its launcher then records the end. A restarted rank
      // that came late waits that long before taking them for failed (the
      // end found, it leaves as above).
      if (!state_gone_since) {
        state_gone_since = Clock::now();
      }
      if (Clock::now() - *state_gone_since < 2 * liveness_.heartbeat_timeout() &&
          Clock::now() < deadline) {
        continue;
      }
    }
    LOCKSTEP_ENFORCE(
        !absent.empty() || state_lives || candidates.empty(), FaultToleranceError, "rank ",
        me.replica, ": every rank that held the trained state has failed (the last world was ",
        describe(expected), "), and the ranks restarted since have none to receive. Resume "
        "the job from its last checkpoint (lockstep-run --restart all).");
    if (deciding && absent.empty() && state_lives_in(reachable) &&
        static_cast<int>(reachable.size()) >= options_.min_world_size) {
      auto after = membership_.decide(latest, reachable);
      return after.number == target ? decided(after.members) : std::nullopt;
    }
    if (Clock::now() >= deadline) {
      LOCKSTEP_ENFORCE(absent.empty(), FaultToleranceError, "rank ", me.replica,
                       ": no world formed within FaultToleranceOptions::timeout (",
                       seconds(options_.timeout), "): ", describe(absent),
                       " of the last world neither came back nor failed.");
      LOCKSTEP_ENFORCE(static_cast<int>(candidates.size()) >= options_.min_world_size,
                       FaultToleranceError, "rank ", me.replica, ": ", candidates.size(),
                       " rank(s) can train, fewer than min_world_size ",
                       options_.min_world_size, ", and no other came back within "
                       "FaultToleranceOptions::timeout (", seconds(options_.timeout), ").");
      LOCKSTEP_ENFORCE(reachable.size() == candidates.size(), FaultToleranceError, "rank ",
                       me.replica, ": no world formed within FaultToleranceOptions::timeout (",
                       seconds(options_.timeout), "): a network cut split ",
                       describe(candidates), ", which came for epoch ", target, ", and no "
                       "side of it can train (the best, ", describe(reachable), ", holds no "
                       "live state or fewer than min_world_size ", options_.min_world_size,
                       " ranks).");
      LOCKSTEP_FAIL(FaultToleranceError, "rank ", me.replica, ": no world formed within "
                    "FaultToleranceOptions::timeout (", seconds(options_.timeout), "): ",
                    describe(candidates), " came for epoch ", target, ", but the rank that "
                    "decides it did not (it failed, or lost the job's store, meanwhile).");
    }
  }
}

std::optional<store::SlotProgress> Agreement::passed_by(const std::vector<Member>& members,
                                                        const Member& me) {
  const int64_t beyond = progress_of(me.step + 1, Phase::Between);
  auto slots = store_guarded("read the others' progress", [&] { return liveness_.progress(); });
  for (const auto& slot : slots) {
    if (slot.progress < beyond ||
        (slot.state != store::SlotState::Alive && slot.state != store::SlotState::Ended)) {
      continue;
    }
    for (const auto& member : members) {
      if (member.replica == slot.slot && member.incarnation == slot.incarnation) {
        return slot;
      }
    }
  }
  return std::nullopt;
}

std::vector<Member> Agreement::report_laggards(const std::vector<Member>& among,
                                               const std::string& what) {
  std::vector<Member> laggards;
  auto seen = liveness_.progress();
  for (const auto& member : among) {
    for (const auto& slot : seen) {
      if (slot.slot == member.replica && slot.incarnation == member.incarnation &&
          slot.state == store::SlotState::Alive) {
        laggards.push_back(member);
        liveness_.report(member.replica, member.incarnation,
                         str("it has not ", what, " for ", seconds(slot.still_for),
                             ", which the others have (FaultToleranceOptions::step_timeout is ",
                             seconds(options_.step_timeout), "): it is hung"));
      }
    }
  }
  return laggards;
}

} // namespace lockstep::detail
