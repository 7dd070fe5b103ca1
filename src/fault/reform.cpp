// Re-forming the world: after a failure, or to take in a rank that asks.
// The ranks that want to train announce themselves for the epoch after the
// latest; one of them (the live member of the last world with the lowest
// rank) decides who is in once every member of the last world has come or
// is seen failed, by a compare-and-set over the latest epoch; the members
// form a world of their own from the job's store; and a rank that is
// behind receives the live state from the member that holds it, and checks
// it against its sender's proof before it loads any of it.

#include <algorithm>
#include <future>
#include <limits>
#include <sstream>
#include <thread>

#include <torch/serialize.h>
#include <torch/utils.h>

#include "common/splitmix.h"
#include "common/wording.h"
#include "fault/loop_state.h"
#include "optim/optimizer_bytes.h"
#include "reducer/model_state.h"
#include "world/broadcast_bytes.h"
#include "world/epoch_world.h"
#include "compat/c10d.h"
#include "world/job_secret.h"

namespace lockstep {

using detail::Member;
using detail::WorldAccess;

namespace {

bool same_process(const Member& a, const Member& b) {
  return a.replica == b.replica && a.incarnation == b.incarnation;
}

} // namespace

void FaultTolerance::Impl::reform() {
  auto start = Clock::now();
  auto deadline = start + options.timeout();
  while (true) {
    check_group();
    if (auto newer = liveness->replaced_by()) {
      LOCKSTEP_FAIL(FaultToleranceError, "rank ", me.replica, " (incarnation ", me.incarnation,
                    ", pid ", me.identity.pid, ") is refused: its rank was restarted since, as "
                    "incarnation ", *newer, ", which trains in its place. This process is "
                    "stale (it was stopped or cut off for longer than the heartbeat timeout) "
                    "and ends.");
    }
    me.step = holds_state ? committed : -1;
    progress(detail::Phase::Dropped);
    auto next_epoch = agreement->next_epoch(me, deadline);
    if (!next_epoch ||
        std::none_of(next_epoch->second.begin(), next_epoch->second.end(),
                     [&](const Member& m) { return same_process(m, me); })) {
      continue; // a world formed without this rank: the next one takes it in
    }
    auto [target, decided] = *next_epoch;
    // Over replica groups, this rank's world is its place's.
    auto ranked = at_my_place(decided);
    // Whatever fails (lockstep's errors, Gloo's or c10d's while the world
    // forms), the world of this epoch is given up on every rank.
    std::string failure;
    std::optional<World> next;
    try {
      next = form(target, decided, ranked);
      watch_world(target, decided, ranked, *next);
      // Given up before the watch was on it, the epoch's note came to the
      // watch of the last one: its reason is in the store.
      if (auto given_up = membership->abandoned(target)) {
        LOCKSTEP_FAIL(CollectiveError, "epoch ", target, " was given up: ", *given_up);
      }
      bring_up_to_date(*next, ranked, target);
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
      guarded->take_failure();
      LOCKSTEP_ENFORCE(Clock::now() < deadline, FaultToleranceError, "rank ", me.replica,
                       ": no world formed within FaultToleranceOptions::timeout (",
                       detail::seconds(options.timeout()), "); the last attempt failed: ",
                       why);
      continue;
    }
    world = *next;
    epoch = target;
    members = decided;
    need_reform = false;
    if (world.rank() == 0 && me.replica % group_size == 0) {
      // The epochs before last are no one's any more: their keys, their
      // worlds' keys and ledgers go.
      for (auto old : membership->retire_through(target - 2)) {
        for (int place = 0; place < group_size; ++place) {
          WorldAccess::retire(base, world_scope(old, place));
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
                                 const std::vector<Member>& ranked) {
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
  std::thread([forming, base = base, rank, size = static_cast<int>(ranked.size()),
               scope = world_scope(target, me.replica % group_size)] {
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
      if (auto failure = liveness->failed(member.replica, member.incarnation)) {
        why = member.describe() + " failed: " + *failure;
        break;
      }
    }
    if (!why.empty()) {
      forming->given_up = true;
      LOCKSTEP_FAIL(CollectiveError, "forming the world of epoch ", target, ": ", why);
    }
  }
  return result.get();
}

namespace {

// The bytes of `tensor` (as sent), into `digest`.
void add_tensor(detail::Digest& digest, const at::Tensor& tensor) {
  auto bytes = tensor.contiguous().to(at::kCPU);
  digest.add(bytes.data_ptr(), static_cast<size_t>(bytes.nbytes()));
}

} // namespace

void FaultTolerance::Impl::bring_up_to_date(World& next, const std::vector<Member>& ranked,
                                            int64_t target) {
  int source = detail::live_state_source(ranked);
  TORCH_INTERNAL_ASSERT(source >= 0, "a world is decided only with a rank that holds state");
  const auto& sender = ranked[static_cast<size_t>(source)];
  if (std::none_of(ranked.begin(), ranked.end(),
                   [&](const Member& m) { return detail::behind(m, sender); })) {
    return;
  }
  bool behind = !holds_state || detail::behind(me, sender);
  if (behind) {
    holds_state = false; // until all of it has arrived, and checked out
  }
  std::string what = detail::str("the live state of rank ", sender.replica, " at step ",
                                 sender.step);
  auto tensors = guarded->replica_tensors(/*buffers_only=*/false);
  auto flats = detail::broadcast_flat(next, source, tensors, what);
  std::string optimizer_state = next.rank() == source ? detail::optimizer_bytes(optimizer) : "";
  detail::broadcast_bytes(next, source, optimizer_state, "the optimizer's state of " + what);
  std::string program_state;
  if (next.rank() == source) {
    torch::serialize::OutputArchive archive;
    for (const auto& state : user_states) {
      torch::serialize::OutputArchive part;
      state.save(part);
      archive.write(state.name, part);
    }
    std::ostringstream out;
    archive.save_to(out);
    program_state = out.str();
  }
  detail::broadcast_bytes(next, source, program_state, "the program's state of " + what);
  if (next.rank() != source && !behind) {
    return; // up to date: nothing to announce or check
  }
  detail::Digest digest;
  digest.add(&sender.step, sizeof(sender.step));
  for (const auto& flat : flats) {
    add_tensor(digest, flat);
  }
  digest.add(optimizer_state.data(), optimizer_state.size());
  digest.add(program_state.data(), program_state.size());
  auto digest_text = digest.finish();
  if (next.rank() == source) {
    membership->announce_state(target, sender.replica, sender.step, digest_text);
  }
  if (behind) {
    LOCKSTEP_ENFORCE(
        membership->state_matches(target, sender.replica, sender.step, digest_text,
                                  options.timeout()),
        FaultToleranceError, "rank ", me.replica, ": ", what, " does not match what its "
        "sender announced in the job's store (a process without the job secret, or a "
        "corrupted transfer): this rank refuses to load it and ends.");
    detail::unflatten_into(tensors, flats);
    detail::load_optimizer_bytes(optimizer, optimizer_state);
    if (!user_states.empty()) {
      torch::serialize::InputArchive archive;
      std::istringstream in(program_state);
      archive.load_from(in);
      for (const auto& state : user_states) {
        torch::serialize::InputArchive part;
        LOCKSTEP_ENFORCE(archive.try_read(state.name, part), FaultToleranceError, "rank ",
                         me.replica, ": the state registered as '", state.name, "' did not "
                         "come with ", what, ": register the same names on every rank.");
        state.load(part);
      }
    }
    // Its own stream: from the job's seed, its launcher rank and the step.
    uint64_t state = options.seed();
    state ^= detail::splitmix64(state) ^ static_cast<uint64_t>(me.replica);
    state ^= detail::splitmix64(state) ^ static_cast<uint64_t>(sender.step);
    torch::manual_seed(detail::splitmix64(state));
    say(detail::str("received ", what, " (model, optimizer state, step",
                    user_states.empty() ? "" : ", program state", ")"));
  }
  committed = sender.step;
  holds_state = true;
}

} // namespace lockstep
