// Re-forming the world: after a failure, or to take in a rank that asks.
// The ranks that want to train announce themselves for the next epoch; the
// first to see every member of the last one accounted for decides who is
// in; the members form a world of their own from the job's store; and a
// rank that is behind receives the live state from the member that holds
// the most committed steps.

#include <algorithm>
#include <future>
#include <thread>

#include <torch/utils.h>

#include "common/splitmix.h"
#include "common/wording.h"
#include "fault/loop_state.h"
#include "optim/optimizer_bytes.h"
#include "reducer/model_state.h"
#include "world/broadcast_bytes.h"
#include "world/epoch_world.h"

namespace lockstep {

using detail::Member;
using detail::WorldAccess;

void FaultTolerance::Impl::reform() {
  auto start = Clock::now();
  auto deadline = start + options.timeout();
  int64_t target = std::max(epoch + 1, membership->latest_epoch() + 1);
  while (true) {
    int newest = liveness->incarnation_of(me.replica);
    LOCKSTEP_ENFORCE(
        newest <= me.incarnation, FaultToleranceError, "rank ", me.replica, " (incarnation ",
        me.incarnation, ", pid ", me.identity.pid, ") is refused: its rank was restarted "
        "since, as incarnation ", newest, ", which trains in its place. This process is "
        "stale (it was stopped or cut off for longer than the heartbeat timeout) and ends.");
    me.step = holds_state ? committed : -1;
    me.proof = WorldAccess::prove(base, proof_message(target));
    membership->arrive(target, me);
    auto decided = await_members(target, deadline);
    bool in = std::any_of(decided.begin(), decided.end(), [&](const Member& m) {
      return m.replica == me.replica && m.incarnation == me.incarnation;
    });
    if (!in) {
      target = std::max(target + 1, membership->latest_epoch() + 1);
      continue;
    }
    membership->note_latest_epoch(target);
    try {
      auto next = form(target, decided);
      liveness->watch(target, decided, next);
      bring_up_to_date(next, decided);
      reducer->adopt_world(next);
      world = next;
    } catch (const FaultToleranceError&) {
      throw;
    } catch (const Error& e) {
      auto why = membership->abandon(target, detail::first_line(e.what()));
      say(detail::str("the world of epoch ", target, " did not form: ", why));
      reducer->take_failure();
      target = std::max(target + 1, membership->latest_epoch() + 1);
      LOCKSTEP_ENFORCE(Clock::now() < deadline, FaultToleranceError, "rank ", me.replica,
                       ": no world formed within FaultToleranceOptions::timeout (",
                       detail::seconds(options.timeout()), "); the last attempt failed: ",
                       why);
      continue;
    }
    epoch = target;
    members = decided;
    need_reform = false;
    break;
  }
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  ++stats.worlds_formed;
  stats.reform_seconds += seconds;
  stats.last_reform_seconds = seconds;
  say(detail::str("trains on in epoch ", epoch, " as rank ", world.rank(), " of ", world.size(),
                  " (launcher ", detail::describe(members), ") from step ", committed, "; formed in ",
                  static_cast<int>(seconds * 1000), " ms"));
}

std::vector<Member> FaultTolerance::Impl::await_members(int64_t target,
                                                        Clock::time_point deadline) {
  std::vector<Member> expected;
  if (target > 0) {
    if (auto before = membership->members(target - 1)) {
      expected = *before;
    }
  }
  while (true) {
    if (auto decided = membership->members(target)) {
      return *decided;
    }
    if (!holds_state) {
      auto finished = membership->finished();
      LOCKSTEP_ENFORCE(!finished, FaultToleranceError, "rank ", me.replica, " was restarted "
                       "to rejoin, but the job's other ranks finished their loop at step ",
                       finished.value_or(0), ": there is no training left to rejoin.");
    }
    std::vector<Member> candidates;
    for (const auto& arrival : membership->arrivals(target, slots)) {
      bool genuine = WorldAccess::proven(
          base, detail::str("e", target, "|", arrival.replica, "|", arrival.incarnation),
          arrival.proof);
      if (genuine && !liveness->failed(arrival) &&
          arrival.incarnation >= liveness->incarnation_of(arrival.replica)) {
        candidates.push_back(arrival);
      }
    }
    bool all_known = std::all_of(expected.begin(), expected.end(), [&](const Member& m) {
      bool arrived = std::any_of(candidates.begin(), candidates.end(),
                                 [&](const Member& c) { return c.replica == m.replica; });
      return arrived || liveness->failed(m).has_value();
    });
    bool state_lives = std::any_of(candidates.begin(), candidates.end(),
                                   [](const Member& c) { return c.step >= 0; });
    LOCKSTEP_ENFORCE(
        !all_known || state_lives || candidates.empty(), FaultToleranceError, "rank ",
        me.replica, ": every rank that held the trained state has failed (the last world was ",
        detail::describe(expected), "), and the ranks restarted since have none to receive. Resume "
        "the job from its last checkpoint (lockstep-run --restart all).");
    if (all_known && state_lives &&
        static_cast<int>(candidates.size()) >= options.min_world_size()) {
      return membership->decide_members(target, candidates);
    }
    LOCKSTEP_ENFORCE(
        Clock::now() < deadline, FaultToleranceError, "rank ", me.replica, ": ",
        candidates.size(), " rank(s) can train, fewer than min_world_size ",
        options.min_world_size(), ", and no other came back within "
        "FaultToleranceOptions::timeout (", detail::seconds(options.timeout()), ").");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

World FaultTolerance::Impl::form(int64_t target, const std::vector<Member>& decided) {
  int rank = 0;
  while (decided[rank].replica != me.replica) {
    ++rank;
  }
  // On a thread: a member that dies while the others wait for it in the
  // rendezvous would hold them there until the world's timeout. Given up,
  // the thread is left to that timeout, and a world it formed late is
  // abandoned at once.
  struct Forming {
    std::promise<World> formed;
    std::atomic<bool> given_up{false};
  };
  auto forming = std::make_shared<Forming>();
  auto result = forming->formed.get_future();
  std::thread([forming, base = base, rank, size = static_cast<int>(decided.size()),
               scope = detail::epoch_key(target, "world")] {
    try {
      auto formed = WorldAccess::form(base, rank, size, scope);
      if (forming->given_up) {
        WorldAccess::abandon(formed, "given up while it formed");
      }
      forming->formed.set_value(std::move(formed));
    } catch (...) {
      forming->formed.set_exception(std::current_exception());
    }
  }).detach();
  while (result.wait_for(std::chrono::milliseconds(5)) != std::future_status::ready) {
    std::string why;
    for (const auto& member : decided) {
      if (auto failure = liveness->failed(member)) {
        why = *failure;
        break;
      }
    }
    if (why.empty()) {
      why = membership->abandoned(target).value_or("");
    }
    if (!why.empty()) {
      forming->given_up = true;
      LOCKSTEP_FAIL(CollectiveError, "forming the world of epoch ", target, ": ", why);
    }
  }
  return result.get();
}

void FaultTolerance::Impl::bring_up_to_date(World& next, const std::vector<Member>& decided) {
  int source = 0;
  for (int rank = 1; rank < static_cast<int>(decided.size()); ++rank) {
    if (decided[rank].step > decided[source].step) {
      source = rank;
    }
  }
  int64_t live_step = decided[source].step;
  TORCH_INTERNAL_ASSERT(live_step >= 0, "a world is decided only with a rank that holds state");
  bool anyone_behind = std::any_of(decided.begin(), decided.end(),
                                   [&](const Member& m) { return m.step != live_step; });
  if (!anyone_behind) {
    return;
  }
  bool behind = !holds_state || committed != live_step;
  if (behind) {
    holds_state = false; // until all of it has arrived
  }
  std::string what = detail::str("the live state of rank ", decided[source].replica, " at step ",
                                 live_step);
  detail::broadcast_from(next, source, reducer->replica_tensors(), what);
  std::string bytes = next.rank() == source ? detail::optimizer_bytes(optimizer) : "";
  detail::broadcast_bytes(next, source, bytes, "the optimizer's state of " + what);
  if (behind) {
    detail::load_optimizer_bytes(optimizer, bytes);
    // Its own stream: from the job's seed, its launcher rank and the step.
    uint64_t state = options.seed();
    state ^= detail::splitmix64(state) ^ static_cast<uint64_t>(me.replica);
    state ^= detail::splitmix64(state) ^ static_cast<uint64_t>(live_step);
    torch::manual_seed(detail::splitmix64(state));
    say(detail::str("received ", what, " (model, optimizer state, step)"));
  }
  committed = live_step;
  holds_state = true;
}

} // namespace lockstep
