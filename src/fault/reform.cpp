// Re-forming the world: after a failure, or to take in a rank that asks.
// The ranks that want to train announce themselves for the epoch after the
// latest; one of them (the live member of the last world with the lowest
// rank) decides who is in once every member of the last world has come or
// is seen failed, by a compare-and-set over the latest epoch; the members
// form a world of their own from the job's store; and a rank that is
// behind receives the live state from the member that holds it (those up
// to date take no part), streamed in pieces of bounded size, and checks it
// against its sender's proof before it trains on any of it.

#include <algorithm>
#include <future>
#include <thread>

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/utils.h>

#include <lockstep/zero_redundancy_optimizer.h>

#include "common/splitmix.h"
#include "common/wording.h"
#include "fault/loop_state.h"
#include "fault/state_stream.h"
#include "world/epoch_world.h"
#include "compat/c10d.h"

namespace lockstep {

using detail::Member;
using detail::WorldAccess;

namespace {

bool same_process(const Member& a, const Member& b) {
  return a.replica == b.replica && a.incarnation == b.incarnation;
}

// A connection that takes longer is taken for a cut.
constexpr auto kProbeTimeout = std::chrono::seconds(2);
// How often a rank left out by a cut looks whether it reaches the others.
constexpr auto kProbeEvery = std::chrono::seconds(1);

std::vector<Member> ranks_of(const std::vector<Member>& members, const std::vector<int>& replicas) {
  std::vector<Member> found;
  for (const auto& member : members) {
    if (std::find(replicas.begin(), replicas.end(), member.replica) != replicas.end()) {
      found.push_back(member);
    }
  }
  return found;
}

} // namespace

void FaultTolerance::Impl::reform() {
  auto start = Clock::now();
  auto deadline = start + options.timeout();
  while (true) {
    check_group();
    check_not_replaced();
    me.step = holds_state ? committed : -1;
    progress(detail::Phase::Dropped);
    await_link(deadline);
    auto next_epoch = agreement->next_epoch(me, deadline);
    if (!next_epoch ||
        std::none_of(next_epoch->second.begin(), next_epoch->second.end(),
                     [&](const Member& m) { return same_process(m, me); })) {
      continue; // a world formed without this rank: the next one takes it in
    }
    auto [target, decided] = *next_epoch;
    me.cut_off.clear(); // what it found before this attempt
    // Over replica groups, this rank's world is its place's.
    auto ranked = at_my_place(decided);
    // Whatever fails (lockstep's errors, Gloo's or c10d's while the world
    // forms), the world of this epoch is given up on every rank.
    std::string failure;
    std::optional<World> next;
    try {
      next = form(target, decided, ranked, world_scope(target, me.replica % group_size));
      watch_world(target, decided, ranked, *next);
      // Given up before the watch was on it, the epoch's note came to the
      // watch of the last one: its reason is in the store.
      if (auto given_up = membership->abandoned(target)) {
        LOCKSTEP_FAIL(CollectiveError, "epoch ", target, " was given up: ", *given_up);
      }
      bring_up_to_date(*next, ranked, decided, target);
    } catch (const FaultToleranceError&) {
      throw;
    } catch (const std::exception& e) {
      failure = detail::first_line(detail::describe_exception(e));
    }
    // Over replica groups, every place of the group formed and holds the
    // state, or none goes on: a group whose ranks left this in different
    // states would wait in its own collectives for one another.
    if (agree_in_group(failure.empty(), "formed its world of epoch " + std::to_string(target))) {
      // It holds the state this epoch begins from, even if the epoch is
      // given up below (no step of it commits without this rank).
      me.trained = target;
      // Before any step of this epoch: from here on its members hold the
      // live state, whichever of them dies next.
      bool marked = membership->mark_formed(target);
      if (!agree_in_group(marked, "marked epoch " + std::to_string(target) + " formed")) {
        failure = detail::str("epoch ", target, " was given up by the others while its world "
                              "formed");
      } else {
        try {
          // The old world goes before the wrapper lays its buckets out in
          // the new one: its memory is let go of first.
          world = *next;
          guarded->adopt_world(*next); // the wrapper's buckets, laid out in it
        } catch (const FaultToleranceError&) {
          throw;
        } catch (const std::exception& e) {
          failure = detail::first_line(detail::describe_exception(e));
        }
      }
    } else if (failure.empty()) {
      failure = "another rank of its replica group could not form its world";
    }
    if (!failure.empty()) {
      auto why = detail::give_up(*membership, *liveness, target, failure);
      say(detail::str("the world of epoch ", target, " did not form: ", why));
      if (probe) {
        // A cut between hosts, with the store still in reach, fails every
        // attempt with the same members: who cannot be reached (found while
        // the world formed, or now) comes with this rank for the next
        // epoch, which its decider leaves out.
        if (me.cut_off.empty()) {
          me.cut_off = detail::unreachable_members(decided, me, kProbeTimeout);
        }
        if (!me.cut_off.empty()) {
          say(detail::str("cannot reach ", detail::describe(ranks_of(decided, me.cut_off)),
                          " (no connection within ", detail::seconds(kProbeTimeout), ")"));
        }
      }
      guarded->take_failure();
      LOCKSTEP_ENFORCE(Clock::now() < deadline, FaultToleranceError, "rank ", me.replica,
                       ": no world formed within FaultToleranceOptions::timeout (",
                       detail::seconds(options.timeout()), "); the last attempt failed: ",
                       why);
      continue;
    }
    epoch = target;
    members = decided;
    need_reform = false;
    if (world.rank() == 0 && me.replica % group_size == 0) {
      // The epochs before last are no one's any more: their keys, their
      // worlds' keys and ledgers go.
      for (auto old : membership->retire_through(target - 2)) {
        for (int place = 0; place < group_size; ++place) {
          WorldAccess::retire(base, world_scope(old, place));
          WorldAccess::retire(base, world_scope(old, place) + "/state"); // its ledger
        }
      }
    }
    break;
  }
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  ++stats.worlds_formed;
  stats.reform_seconds += seconds;
  stats.last_reform_seconds = seconds;
  say(detail::str("trains on in epoch ", epoch, " as ", group ? "group " : "rank ", world.rank(),
                  " of ", world.size(),
                  " (launcher ", detail::describe(members), ") from step ", committed,
                  "; formed in ", static_cast<int>(seconds * 1000), " ms"));
}

World FaultTolerance::Impl::form(int64_t target, const std::vector<Member>& decided,
                                 const std::vector<Member>& ranked, const std::string& scope,
                                 bool within_epoch) {
  int rank = 0;
  while (!same_process(ranked[rank], me)) {
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
  std::thread([forming, base = base, rank, size = static_cast<int>(ranked.size()), scope] {
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
  // Across hosts, a world slow to form may be one that a cut keeps from
  // forming: its transport would wait out its own timeout for that.
  auto probe_at = Clock::now() + kProbeTimeout;
  while (result.wait_for(std::chrono::milliseconds(5)) != std::future_status::ready) {
    std::string why;
    for (const auto& member : decided) {
      if (auto failure = liveness->failed(member.replica, member.incarnation)) {
        why = member.describe() + " failed: " + *failure;
        break;
      }
    }
    if (why.empty() && probe && Clock::now() >= probe_at) {
      me.cut_off = detail::unreachable_members(ranked, me, kProbeTimeout);
      if (!me.cut_off.empty()) {
        why = detail::str("cannot reach ", detail::describe(ranks_of(ranked, me.cut_off)),
                          " (no connection within ", detail::seconds(kProbeTimeout),
                          "): a network cut");
      }
      probe_at = Clock::now() + kProbeTimeout;
    }
    if (why.empty() && within_epoch) {
      // A world formed inside the epoch (the transfer's) is given up with
      // it: a member that gave the epoch up never comes to its rendezvous.
      why = verdict();
    }
    if (!why.empty()) {
      forming->given_up = true;
      LOCKSTEP_FAIL(CollectiveError, "forming the world of epoch ", target, ": ", why);
    }
  }
  return result.get();
}

void FaultTolerance::Impl::bring_up_to_date(World& next, const std::vector<Member>& ranked,
                                            const std::vector<Member>& decided, int64_t target) {
  int source = detail::live_state_source(ranked);
  TORCH_INTERNAL_ASSERT(source >= 0, "a world is decided only with a rank that holds state");
  const auto sender = ranked[static_cast<size_t>(source)];
  // Before anything is sent: what the sender announces after its stream
  // goes to the store that serves now.
  const int moves = membership->store_moves();
  // The state travels from the sender to the ranks behind it and to no
  // other: in a world of their own where some of the epoch's are up to
  // date (their order is next's).
  std::vector<Member> taking;
  int root = -1;
  int my_part = -1;
  for (size_t rank = 0; rank < ranked.size(); ++rank) {
    if (static_cast<int>(rank) != source && !detail::behind(ranked[rank], sender)) {
      continue;
    }
    if (static_cast<int>(rank) == source) {
      root = static_cast<int>(taking.size());
    }
    if (same_process(ranked[rank], me)) {
      my_part = static_cast<int>(taking.size());
    }
    taking.push_back(ranked[rank]);
  }
  if (taking.size() == 1) {
    return;
  }
  std::string what = detail::str("the live state of rank ", sender.replica, " at step ",
                                 sender.step);
  if (my_part < 0) {
    // Up to date, this rank waits (in the store, as every re-forming does)
    // until the sender has sent: the epoch's first collective would
    // otherwise wait for the ranks in the transfer, and take them for hung
    // after FaultToleranceOptions::step_timeout.
    // (However long the transfer takes: no deadline of its own.)
    await_announcement(target, sender, what, moves, std::nullopt);
    return;
  }
  bool behind = my_part != root;
  if (behind) {
    holds_state = false; // until all of it has arrived, and checked out
  }
  World carrier = taking.size() == ranked.size()
      ? next
      : form(target, decided, taking, world_scope(target, me.replica % group_size) + "/state",
             /*within_epoch=*/true);
  set_transfer(carrier);
  std::optional<torch::serialize::InputArchive> program_state;
  std::string digest;
  uint64_t travelled = 0;
  try {
    detail::StateStream stream(carrier, root, options.state_piece_bytes(), what);
    detail::stream_tensors(stream, guarded->replica_tensors(/*buffers_only=*/false));
    if (sharded != nullptr) {
      // The shard's state, and the options a scheduler set on the whole
      // optimizer (step() gives them to the shard's).
      detail::stream_optimizer(stream, sharded->local_optimizer());
      detail::stream_group_options(stream, optimizer);
    } else {
      detail::stream_optimizer(stream, optimizer);
    }
    // The program's own state is loaded only once all of it is checked.
    detail::stream_archive(
        stream,
        [&](torch::serialize::OutputArchive& archive) {
          for (const auto& state : user_states) {
            torch::serialize::OutputArchive part;
            state.save(part);
            archive.write(state.name, part);
          }
        },
        [&](torch::serialize::InputArchive& archive) { program_state.emplace(std::move(archive)); });
    digest = stream.finish();
    travelled = stream.bytes();
  } catch (...) {
    set_transfer(std::nullopt);
    throw;
  }
  set_transfer(std::nullopt);
  if (!behind) {
    stats.state_bytes_sent += static_cast<int64_t>(travelled);
    membership->announce_state(target, sender.replica, sender.step, digest);
    return;
  }
  stats.state_bytes_received += static_cast<int64_t>(travelled);
  // Its model and optimizer already hold what arrived: a rank that cannot
  // check it ends here, and trains on none of it.
  LOCKSTEP_ENFORCE(
      await_announcement(target, sender, what, moves, Clock::now() + options.timeout()) ==
          detail::Membership::state_claim(sender.replica, sender.step, digest),
      FaultToleranceError, "rank ", me.replica, ": ", what, " does not match what its "
      "sender announced in the job's store (a corrupted transfer): this rank refuses to "
      "train on it and ends.");
  for (const auto& state : user_states) {
    torch::serialize::InputArchive part;
    LOCKSTEP_ENFORCE(program_state->try_read(state.name, part), FaultToleranceError, "rank ",
                     me.replica, ": the state registered as '", state.name, "' did not "
                     "come with ", what, ": register the same names on every rank.");
    state.load(part);
  }
  // Its own stream: from the job's seed, its launcher rank and the step.
  uint64_t seed = options.seed();
  seed ^= detail::splitmix64(seed) ^ static_cast<uint64_t>(me.replica);
  seed ^= detail::splitmix64(seed) ^ static_cast<uint64_t>(sender.step);
  torch::manual_seed(detail::splitmix64(seed));
  say(detail::str("received ", what, " (model, optimizer state, step",
                  user_states.empty() ? "" : ", program state", "; ", travelled, " bytes)"));
  committed = sender.step;
  holds_state = true;
}

std::string FaultTolerance::Impl::await_announcement(
    int64_t target, const Member& sender, const std::string& what, int moves,
    std::optional<Clock::time_point> deadline) {
  // In slices: an announcement that will never come must not hold this rank
  // past the moment its group's other ranks give the epoch up. It never
  // comes where the epoch was given up (its sender failed: the watch's
  // verdict), or where the store moved after the transfer began (what the
  // sender announced to the old one went with it).
  constexpr auto kSlice = std::chrono::milliseconds(200);
  while (true) {
    const auto slice_end = Clock::now() + kSlice;
    if (auto claim = membership->announced_state(target, sender.replica, kSlice)) {
      return *claim;
    }
    std::string why = verdict();
    if (why.empty() && membership->store_moves() != moves) {
      why = "the job's store moved, and what the sender announced to the old one went with it";
    }
    if (why.empty() && deadline && Clock::now() >= *deadline) {
      why = detail::str("its sender announced nothing within FaultToleranceOptions::timeout (",
                        detail::seconds(options.timeout()), ") of the stream's end");
    }
    if (!why.empty()) {
      LOCKSTEP_FAIL(CollectiveError, "epoch ", target, " was given up while ", what,
                    " travelled: ", why);
    }
    std::this_thread::sleep_until(slice_end); // a value ignored comes back at once
  }
}

void FaultTolerance::Impl::set_transfer(std::optional<World> carrier) {
  std::lock_guard<std::mutex> lock(watch->mutex);
  watch->transfer = std::move(carrier);
  if (watch->transfer && !watch->verdict.empty()) {
    WorldAccess::abandon(*watch->transfer, watch->verdict);
  }
}

void FaultTolerance::Impl::check_not_replaced() const {
  if (auto newer = liveness->replaced_by()) {
    LOCKSTEP_FAIL(FaultToleranceError, "rank ", me.replica, " (incarnation ", me.incarnation,
                  ", pid ", me.identity.pid, ") is refused: its rank was restarted since, as "
                  "incarnation ", *newer, ", which trains in its place. This process is "
                  "stale (it was stopped or cut off for longer than the heartbeat timeout) "
                  "and ends.");
  }
}

void FaultTolerance::Impl::await_link(Clock::time_point deadline) {
  if (!probe) {
    return;
  }
  bool said = false;
  while (true) {
    auto latest = agreement->latest_before_coming(me);
    if (std::any_of(latest.members.begin(), latest.members.end(),
                    [&](const Member& m) { return same_process(m, me); })) {
      return; // a member of it: it comes, with what it finds in this attempt
    }
    // Its members that live (a failed one, or one replaced since, is no
    // one to reach: its host may be gone).
    std::vector<Member> live;
    std::copy_if(latest.members.begin(), latest.members.end(), std::back_inserter(live),
                 [&](const Member& m) {
                   return !liveness->failed(m.replica, m.incarnation) &&
                       m.incarnation >= liveness->incarnation_of(m.replica);
                 });
    me.cut_off = detail::unreachable_members(live, me, kProbeTimeout);
    if (me.cut_off.empty()) {
      if (said) {
        say(detail::str("reaches the ranks of epoch ", latest.number, " again: it rejoins"));
      }
      return;
    }
    auto cut = detail::describe(ranks_of(live, me.cut_off));
    if (!said) {
      say(detail::str("left out of epoch ", latest.number, ": it cannot reach ", cut,
                      " of that epoch; it asks to rejoin once it reaches them"));
      said = true;
    }
    if (membership->finished()) { // the others ended the loop meanwhile
      if (me.step < 0) {
        detail::leave_ended_job(*membership, me.replica, me.incarnation);
      }
      membership->left(me.replica, me.incarnation, detail::kLeft);
      LOCKSTEP_FAIL(FaultToleranceError, "rank ", me.replica, " was cut off from ", cut,
                    " while they ended the job's loop: the job's state is theirs, and this "
                    "rank leaves with nothing to rejoin.");
    }
    LOCKSTEP_ENFORCE(Clock::now() < deadline, FaultToleranceError, "rank ", me.replica,
                     " could not reach ", cut, " of epoch ", latest.number,
                     " within FaultToleranceOptions::timeout (",
                     detail::seconds(options.timeout()), "), though the job's store answers: "
                     "a network cut between their hosts.");
    std::this_thread::sleep_for(kProbeEvery);
    check_group();
    check_not_replaced();
  }
}

} // namespace lockstep
