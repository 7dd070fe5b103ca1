// The fault-tolerant loop: begin_step() re-forms the world when it must,
// commit() decides each step once for every rank (membership.h), and a
// rank that is behind receives the live state from the member that holds
// the most committed steps.

#include <lockstep/fault_tolerance.h>

#include <algorithm>
#include <exception>
#include <future>
#include <iostream>
#include <thread>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/utils.h>

#include "common/wording.h"
#include "fault/liveness.h"
#include "fault/membership.h"
#include "optim/optimizer_bytes.h"
#include "reducer/model_state.h"
#include "world/broadcast_bytes.h"
#include "world/epoch_world.h"

namespace lockstep {

using detail::Member;
using detail::WorldAccess;
using Clock = std::chrono::steady_clock;

namespace {

// splitmix64: a joining rank's seed from (seed, rank, step).
uint64_t mix(uint64_t value) {
  value += 0x9e3779b97f4a7c15ULL;
  value = (value ^ (value >> 30)) * 0xbf58476d1ce4e5b9ULL;
  value = (value ^ (value >> 27)) * 0x94d049bb133111ebULL;
  return value ^ (value >> 31);
}

std::string first_line(const std::string& text) {
  return text.substr(0, text.find('\n'));
}

// "ranks 0, 2" (launcher ranks).
std::string describe(const std::vector<Member>& members) {
  std::string ranks;
  for (const auto& member : members) {
    ranks += detail::str(ranks.empty() ? "" : ", ", member.replica);
  }
  return (members.size() == 1 ? "rank " : "ranks ") + ranks;
}

} // namespace

struct FaultTolerance::Impl {
  std::shared_ptr<detail::Reducer> reducer;
  torch::optim::Optimizer& optimizer;
  FaultToleranceOptions options;
  World base;  // init()'s: the job's store
  World world; // the current epoch's
  Member me;
  int slots = 1;
  std::unique_ptr<detail::Membership> membership;
  std::unique_ptr<detail::Liveness> liveness;
  int64_t epoch = -1;
  std::vector<Member> members;
  int64_t committed = 0;
  bool holds_state = true;
  bool need_reform = false;
  bool in_step = false;
  int64_t backwards_at_begin = 0;
  std::vector<at::Tensor> buffers;
  std::vector<at::Tensor> buffers_at_begin;
  FaultToleranceStats stats;

  Impl(std::shared_ptr<detail::Reducer> reducer_in,
       torch::optim::Optimizer& optimizer_in,
       FaultToleranceOptions options_in)
      : reducer(std::move(reducer_in)),
        optimizer(optimizer_in),
        options(options_in),
        base(reducer->world()),
        world(base) {}

  c10::intrusive_ptr<c10d::Store> ft_store() const {
    return c10::make_intrusive<c10d::PrefixStore>("ft", WorldAccess::store_connection(base));
  }

  void say(const std::string& line) const {
    if (options.verbose()) {
      std::cerr << "lockstep: rank " << me.replica << ": " << line << std::endl;
    }
  }

  std::string proof_message(int64_t target) const {
    return detail::str("e", target, "|", me.replica, "|", me.incarnation);
  }

  void reform();
  std::vector<Member> await_members(int64_t target, Clock::time_point deadline);
  World form(int64_t target, const std::vector<Member>& decided);
  void bring_up_to_date(World& next, const std::vector<Member>& decided);
  std::string await_decision();
};

FaultTolerance::FaultTolerance(std::shared_ptr<detail::Reducer> reducer,
                               torch::optim::Optimizer& optimizer,
                               FaultToleranceOptions options)
    : impl_(std::make_unique<Impl>(std::move(reducer), optimizer, options)) {
  auto& impl = *impl_;
  LOCKSTEP_ENFORCE(options.min_world_size() >= 1, ConfigError,
                   "FaultToleranceOptions::min_world_size must be 1 or more, not ",
                   options.min_world_size(), ".");
  LOCKSTEP_ENFORCE(options.heartbeat_timeout().count() > 0, ConfigError,
                   "FaultToleranceOptions::heartbeat_timeout must be positive.");
  impl.reducer->tolerate_failures();
  impl.buffers = impl.reducer->replica_tensors(/*buffers_only=*/true);
  impl.slots = WorldAccess::slots(impl.base);
  impl.me.replica = WorldAccess::replica(impl.base);
  impl.me.incarnation = WorldAccess::incarnation(impl.base);
  impl.me.identity = detail::this_process();
  impl.membership = std::make_unique<detail::Membership>(impl.ft_store());
  impl.liveness = std::make_unique<detail::Liveness>([&impl] { return impl.ft_store(); },
                                                     impl.me, impl.slots,
                                                     options.heartbeat_timeout());
  if (WorldAccess::standby(impl.base)) {
    // Restarted alone: it joins at its first begin_step.
    impl.holds_state = false;
    impl.need_reform = true;
    impl.committed = 0;
    return;
  }
  // The job's first processes: epoch 0 is the wrapper's world.
  impl.me.step = 0;
  impl.me.proof = WorldAccess::prove(impl.base, impl.proof_message(0));
  for (const auto& record : impl.base.all_gather_strings(impl.me.to_record())) {
    impl.members.push_back(Member::from_record(record));
  }
  if (impl.base.rank() == 0) {
    impl.membership->decide_members(0, impl.members);
    impl.membership->note_latest_epoch(0);
  }
  impl.epoch = 0;
  impl.liveness->watch(0, impl.members, impl.world);
}

FaultTolerance::~FaultTolerance() {
  auto& impl = *impl_;
  if (std::uncaught_exceptions() == 0 && impl.holds_state) {
    try {
      impl.membership->finish(impl.committed);
    } catch (const std::exception&) {
      // The store is gone with the job: nobody is left to tell.
    }
  }
}

int64_t FaultTolerance::step() const {
  return impl_->committed;
}

const World& FaultTolerance::world() const {
  return impl_->world;
}

FaultToleranceStats FaultTolerance::stats() const {
  return impl_->stats;
}

void FaultTolerance::begin_step() {
  auto& impl = *impl_;
  LOCKSTEP_ENFORCE(!impl.in_step, UsageError, "begin_step() was called twice without "
                   "commit() between: every step ends with ft.commit().");
  if (impl.need_reform || !impl.liveness->verdict().empty()) {
    impl.reform();
  }
  at::NoGradGuard no_grad;
  impl.buffers_at_begin.clear();
  for (const auto& buffer : impl.buffers) {
    impl.buffers_at_begin.push_back(buffer.clone());
  }
  impl.backwards_at_begin = impl.reducer->synchronised_backwards();
  impl.in_step = true;
}

bool FaultTolerance::commit() {
  auto& impl = *impl_;
  LOCKSTEP_ENFORCE(impl.in_step, UsageError, "commit() was called without begin_step(): "
                   "every step starts with ft.begin_step().");
  impl.in_step = false;
  std::string failure = impl.reducer->take_failure();
  LOCKSTEP_ENFORCE(
      !failure.empty() || impl.reducer->synchronised_backwards() > impl.backwards_at_begin,
      UsageError, "commit() found no synchronised backward through the wrapper since "
      "begin_step(): the step's gradients were not averaged, so there is nothing to commit. "
      "Run the loss's backward() between begin_step() and commit(), outside no_sync().");
  if (failure.empty()) {
    failure = WorldAccess::broken(impl.world);
  }
  std::string decision;
  if (failure.empty()) {
    auto votes = impl.membership->vote(impl.epoch, impl.committed);
    if (votes == static_cast<int64_t>(impl.members.size())) {
      bool joining = impl.membership->wanted(impl.epoch + 1);
      decision = impl.membership->decide_step(impl.epoch, impl.committed,
                                              joining ? "commit reform" : "commit");
    }
  } else {
    decision = impl.membership->decide_step(impl.epoch, impl.committed,
                                            "abort " + first_line(failure));
  }
  if (decision.empty()) {
    decision = impl.await_decision();
  }
  if (decision.rfind("commit", 0) == 0) {
    ++impl.committed;
    if (decision == "commit reform") {
      impl.need_reform = true;
    }
    return true;
  }
  impl.need_reform = true;
  ++impl.stats.aborted_steps;
  impl.say(detail::str("step ", impl.committed, " is dropped on every rank: ",
                       decision.substr(6)));
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < impl.buffers.size(); ++i) {
    impl.buffers[i].copy_(impl.buffers_at_begin[i]);
  }
  return false;
}

std::string FaultTolerance::Impl::await_decision() {
  auto pause = std::chrono::microseconds(20);
  auto deadline = Clock::now() + options.timeout();
  while (true) {
    if (auto decided = membership->decision(epoch, committed)) {
      return *decided;
    }
    auto verdict = liveness->verdict();
    if (verdict.empty() && Clock::now() >= deadline) {
      verdict = "no decision within FaultToleranceOptions::timeout";
    }
    if (!verdict.empty()) {
      return membership->decide_step(epoch, committed, "abort " + first_line(verdict));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

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
    } catch (const Error& e) {
      auto why = membership->abandon(target, first_line(e.what()));
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
                  " (launcher ", describe(members), ") from step ", committed, "; formed in ",
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
        describe(expected), "), and the ranks restarted since have none to receive. Resume "
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
    torch::manual_seed(mix(options.seed() ^ mix(static_cast<uint64_t>(me.replica) ^
                                                  mix(static_cast<uint64_t>(live_step)))));
    say(detail::str("received ", what, " (model, optimizer state, step)"));
  }
  committed = live_step;
  holds_state = true;
}

} // namespace lockstep
