// The fault-tolerant loop: begin_step() re-forms the world when it must
// (reform.cpp), and commit() decides each step once for every rank
// (membership.h).

#include <exception>
#include <thread>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "fault/loop_state.h"
#include "world/epoch_world.h"

namespace lockstep {

using detail::Member;
using detail::WorldAccess;

namespace detail {

std::string first_line(const std::string& text) {
  return text.substr(0, text.find('\n'));
}

std::string describe(const std::vector<Member>& members) {
  std::string ranks;
  for (const auto& member : members) {
    ranks += str(ranks.empty() ? "" : ", ", member.replica);
  }
  return (members.size() == 1 ? "rank " : "ranks ") + ranks;
}

} // namespace detail

c10::intrusive_ptr<c10d::Store> FaultTolerance::Impl::ft_store() const {
  return c10::make_intrusive<c10d::PrefixStore>("ft", WorldAccess::store_connection(base));
}

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
                                            "abort " + detail::first_line(failure));
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
      return membership->decide_step(epoch, committed, "abort " + detail::first_line(verdict));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

} // namespace lockstep
