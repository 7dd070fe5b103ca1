// The fault-tolerant loop: begin_step() re-forms the world when it must
// (reform.cpp), commit() agrees on each step in the step's own world (no
// store operation), and the job's liveness (world/liveness.h) tells the
// loop, from its own thread, when a member of the current world failed or
// another rank gave the world up.

#include <algorithm>
#include <cstring>
#include <exception>
#include <iterator>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>

#include <lockstep/grad_scaler.h>
#include <lockstep/zero_redundancy_optimizer.h>

#include "common/wording.h"
#include "fault/loop_state.h"
#include "optim/gradient_placement.h"
#include "store/client.h"
#include "world/epoch_world.h"

namespace lockstep {

using detail::Member;
using detail::Phase;
using detail::WorldAccess;

namespace detail {

std::string give_up(Membership& membership, Liveness& liveness, int64_t epoch,
                    const std::string& why) {
  // One note per epoch, by the rank whose reason stands: a note answers
  // every watcher, and a thousand survivors that each saw a failure would
  // otherwise send a thousand (a million answers). Should that rank die
  // before its note goes, its death is what every watcher sees.
  bool first = false;
  auto stands = membership.abandon(epoch, why, &first);
  if (first) {
    liveness.note(kAbandonNote + std::to_string(epoch));
  }
  return stands;
}

Signer signer_of(const World& base) {
  return Signer{[base](const std::string& claim) { return WorldAccess::prove(base, claim); },
                [base](const std::string& claim, const std::string& proof) {
                  return WorldAccess::proven(base, claim, proof);
                },
                WorldAccess::has_secret(base)};
}

} // namespace detail

FaultTolerance::FaultTolerance(std::shared_ptr<detail::Reducer> reducer,
                               torch::optim::Optimizer& optimizer,
                               FaultToleranceOptions options)
    : FaultTolerance(detail::guard(std::move(reducer)), optimizer, options) {}

FaultTolerance::FaultTolerance(const ReplicaGroups& groups, torch::nn::Module& module,
                               torch::optim::Optimizer& optimizer,
                               FaultToleranceOptions options)
    : FaultTolerance(detail::guard_across_groups(groups.across, module, optimizer), optimizer,
                     options, &groups) {}

FaultTolerance::FaultTolerance(std::shared_ptr<detail::Guarded> guarded,
                               torch::optim::Optimizer& optimizer,
                               FaultToleranceOptions options, const ReplicaGroups* groups)
    : impl_(std::make_unique<Impl>(guarded, optimizer, options,
                                   groups ? groups->parent : guarded->world())) {
  auto& impl = *impl_;
  if (groups != nullptr) {
    LOCKSTEP_ENFORCE(WorldAccess::formed_by_init(impl.base), UsageError, "FaultTolerance over replica groups takes groups cut from "
                     "the job's world (replica_groups(lockstep::init(), k)): a group is the "
                     "unit that lockstep-run's ranks fail and return in.");
    impl.group_size = groups->replica.size();
    impl.group = groups->replica;
    // The ranks of a group re-form together, as their group's commit
    // decided, never on what one of them alone has seen: one would wait in
    // the agreement while another waits for it in the group's collectives.
    impl.reform_only_when_decided = true;
  }
  LOCKSTEP_ENFORCE(options.min_world_size() >= 1, ConfigError,
                   "FaultToleranceOptions::min_world_size must be 1 or more, not ",
                   options.min_world_size(), ".");
  LOCKSTEP_ENFORCE(options.heartbeat_timeout().count() > 0, ConfigError,
                   "FaultToleranceOptions::heartbeat_timeout must be positive.");
  LOCKSTEP_ENFORCE(options.step_timeout().count() > 0, ConfigError,
                   "FaultToleranceOptions::step_timeout must be positive.");
  if (auto* sharded = dynamic_cast<detail::ShardedOptimizer*>(&optimizer)) {
    // Over replica groups, a shard lives on in the other groups' rank of
    // the same place, which sends it to a group that rejoins.
    LOCKSTEP_ENFORCE(groups != nullptr, UsageError,
                     "lockstep::FaultTolerance cannot take a ZeroRedundancyOptimizer "
                     "outside replica groups: each rank holds only its shard of the "
                     "optimizer's state, which dies with it. Give FaultTolerance a plain "
                     "torch::optim optimizer, or shard inside replica groups "
                     "(FaultTolerance(replica_groups(world, k), ...), the "
                     "ZeroRedundancyOptimizer over groups.replica).");
    LOCKSTEP_ENFORCE(WorldAccess::same(sharded->world(), groups->replica), UsageError,
                     "lockstep::FaultTolerance over replica groups takes a "
                     "ZeroRedundancyOptimizer over the group's world (groups.replica), which "
                     "a group loses and gets back whole; this one's world has ",
                     sharded->world().size(), " ranks, the group ", groups->replica.size(),
                     ".");
    impl.sharded = sharded;
  }
  if (groups != nullptr) {
    // FSDP's pieces likewise: sharded inside the group, which a group loses
    // and gets back whole (not across groups, as hybrid sharding does).
    auto placement = detail::gradient_placement(optimizer);
    LOCKSTEP_ENFORCE(!placement.sharded_across ||
                         WorldAccess::same(*placement.sharded_across, groups->replica),
                     UsageError, "lockstep::FaultTolerance over replica groups takes an "
                     "optimizer over pieces sharded inside the group (FullyShardedDataParallel "
                     "over groups.replica, without FsdpOptions::shard_group_size: the groups "
                     "are the replicas); these pieces are sharded over a world of ",
                     placement.sharded_across ? placement.sharded_across->size() : 0,
                     " ranks, the group has ", groups->replica.size(), ".");
  }
  LOCKSTEP_ENFORCE(
      !WorldAccess::across_hosts(impl.base) || WorldAccess::has_secret(impl.base) ||
          options.trusted_network(),
      ConfigError, "lockstep::FaultTolerance across hosts needs a job secret "
      "(LOCKSTEP_JOB_SECRET, the same on every rank): without one, any process that reaches "
      "the job's store could forge the decisions the ranks act on (who trains, whose state a "
      "rejoining rank loads, whether the loop ended). Set one, or "
      "FaultToleranceOptions::trusted_network(true) on a network you trust.");
  impl.guarded->tolerate_failures();
  impl.guarded_optimizer = std::make_unique<detail::GuardedOptimizer>(optimizer);
  impl.buffers = impl.guarded->replica_tensors(/*buffers_only=*/true);
  impl.me.replica = WorldAccess::replica(impl.base);
  impl.me.incarnation = WorldAccess::incarnation(impl.base);
  impl.me.identity = detail::this_process();
  if (impl.base.size() == 1 && !WorldAccess::standby(impl.base)) {
    // A job of one process: nothing fails but itself.
    impl.epoch = 0;
    impl.members = {impl.me};
    return;
  }
  if (WorldAccess::across_hosts(impl.base)) {
    impl.probe = std::make_unique<detail::ProbeListener>(WorldAccess::local_address(impl.base));
    impl.me.probe = impl.probe->endpoint();
  }
  impl.liveness = WorldAccess::liveness(impl.base, options.heartbeat_timeout());
  auto signer = detail::signer_of(impl.base);
  const auto& prefix = WorldAccess::key_prefix(impl.base);
  impl.membership = std::make_unique<detail::Membership>(
      WorldAccess::store_client(impl.base), prefix, signer, options.timeout());
  impl.notices = std::make_unique<detail::Membership>(WorldAccess::store_client(impl.base),
                                                      prefix, signer, options.timeout());
  impl.watch = std::make_shared<detail::Watch>();
  if (impl.group) {
    // Who the group's ranks are, as its world formed (a restarted group's
    // incarnations differ).
    impl.watch->group = impl.group;
    const int first = impl.me.replica - impl.group->rank();
    auto incarnations = impl.group->all_gather_strings(std::to_string(impl.me.incarnation));
    for (int place = 0; place < impl.group_size; ++place) {
      impl.watch->group_ranks.emplace_back(first + place,
                                           std::stoi(incarnations[static_cast<size_t>(place)]));
    }
  }
  detail::AgreementOptions agreeing{options.min_world_size(), options.step_timeout(),
                                    options.timeout(), impl.group_size, {}};
  if (impl.group) {
    agreeing.unable = [watch = impl.watch, liveness = impl.liveness] {
      return detail::group_failure(*watch, *liveness);
    };
  }
  impl.agreement =
      std::make_unique<detail::Agreement>(*impl.membership, *impl.liveness, agreeing);
  impl.liveness->on_change([watch = impl.watch, liveness = impl.liveness.get(),
                            notices = impl.notices.get()](const std::vector<std::string>& notes) {
    Impl::on_liveness(watch, *liveness, *notices, notes);
  });
  if (WorldAccess::standby(impl.base)) {
    // Restarted alone: it joins at its first begin_step.
    impl.holds_state = false;
    impl.need_reform = true;
    return;
  }
  // The job's first processes: epoch 0 is the wrapper's world.
  impl.me.step = 0;
  impl.me.trained = 0;
  for (const auto& record : impl.base.all_gather_strings(impl.me.to_record())) {
    impl.members.push_back(Member::from_record(record));
  }
  if (impl.base.rank() == 0) {
    impl.membership->decide(detail::Epoch{}, impl.members);
    impl.membership->mark_formed(0);
  }
  impl.epoch = 0;
  impl.watch_world(0, impl.members, impl.at_my_place(impl.members), impl.world);
  impl.base.barrier(); // epoch 0 is decided before anyone looks for it
  // Every member reads it once: a rank that holds the latest epoch writes
  // it back over one it must ignore (Membership::latest).
  impl.membership->latest();
}

FaultTolerance::~FaultTolerance() = default;

int64_t FaultTolerance::step() const {
  return impl_->committed;
}

const World& FaultTolerance::world() const {
  return impl_->world;
}

FaultToleranceStats FaultTolerance::stats() const {
  return impl_->stats;
}

void FaultTolerance::register_state(const std::string& name,
                                    std::function<void(torch::serialize::OutputArchive&)> save,
                                    std::function<void(torch::serialize::InputArchive&)> load) {
  auto& impl = *impl_;
  LOCKSTEP_ENFORCE(save && load, UsageError, "register_state('", name, "') needs both a save "
                   "and a load function.");
  for (const auto& state : impl.user_states) {
    LOCKSTEP_ENFORCE(state.name != name, UsageError, "register_state('", name, "') was called "
                     "twice: each name holds one piece of state.");
  }
  impl.user_states.push_back({name, std::move(save), std::move(load)});
}

void FaultTolerance::register_state(const std::string& name, amp::GradScaler& scaler) {
  register_state(
      name, [&scaler](torch::serialize::OutputArchive& archive) { scaler.save(archive); },
      [&scaler](torch::serialize::InputArchive& archive) { scaler.load(archive); });
  impl_->guarded_optimizer->add(scaler);
}

void FaultTolerance::begin_step() {
  auto& impl = *impl_;
  LOCKSTEP_ENFORCE(!impl.in_step, UsageError, "begin_step() was called twice without "
                   "commit() between: every step ends with ft.commit().");
  impl.check_group();
  if (impl.watch &&
      (impl.need_reform || (!impl.reform_only_when_decided && !impl.verdict().empty()))) {
    impl.reform();
  }
  at::NoGradGuard no_grad;
  impl.buffers_at_begin.clear();
  for (const auto& buffer : impl.buffers) {
    impl.buffers_at_begin.push_back(buffer.clone());
  }
  impl.synchronisations_at_begin = impl.guarded->synchronisations();
  impl.in_step = true;
  if (impl.watch) {
    impl.progress(Phase::InStep);
  }
}

bool FaultTolerance::commit() {
  return impl_->commit(nullptr);
}

std::optional<at::Tensor> FaultTolerance::commit(const at::Tensor& sums) {
  LOCKSTEP_ENFORCE(sums.defined() && sums.device().is_cpu(), UsageError,
                   "commit(sums) sums a CPU tensor of this rank's figures; got ",
                   sums.defined() ? sums.toString() : std::string("an undefined tensor"), ".");
  LOCKSTEP_ENFORCE(at::isFloatingType(sums.scalar_type()) ||
                       at::isIntegralType(sums.scalar_type(), /*includeBool=*/false),
                   UsageError, "commit(sums) sums real numbers; got a tensor of ",
                   sums.scalar_type(), ".");
  at::Tensor total = sums.detach().contiguous().clone();
  if (!impl_->commit(&total)) {
    return std::nullopt;
  }
  return total;
}

bool FaultTolerance::Impl::commit(at::Tensor* sums) {
  auto& impl = *this;
  LOCKSTEP_ENFORCE(impl.in_step, UsageError, "commit() was called without begin_step(): "
                   "every step starts with ft.begin_step().");
  impl.in_step = false;
  std::string failure = impl.guarded->take_failure();
  detail::FoldedVerdict folded;
  if (impl.watch) {
    folded.join_asked = impl.join_asked();
    folded.summing = sums != nullptr;
  }
  if (failure.empty()) {
    failure = impl.guarded->finish_step(folded); // across replica groups
  }
  LOCKSTEP_ENFORCE(
      !failure.empty() || impl.guarded->synchronisations() > impl.synchronisations_at_begin,
      UsageError, "commit() found no synchronised backward through the wrapper since "
      "begin_step(): the step's gradients were not averaged, so there is nothing to commit. "
      "Run the loss's backward() between begin_step() and commit(), outside no_sync().",
      impl.group ? " Over replica groups, a step inside backward (ddp.step_in_backward) "
                   "leaves no gradient to average across the groups: it cannot be used there; "
                   "call optimizer.step() when ft.commit() returns true."
                 : "");
  if (!impl.watch) {
    ++impl.committed; // a job of one process
    return true;
  }
  impl.check_group();
  if (failure.empty()) {
    failure = WorldAccess::broken(impl.world);
  }
  int64_t summing = sums == nullptr
      ? 0
      : 1 + sums->numel() * 64 + static_cast<int64_t>(sums->scalar_type());
  bool join = false;
  if (failure.empty() && folded.carried) {
    // The verdict came with the reduction across the groups, which
    // completes only where every rank's held (torchft's should_commit):
    // no collective more, unless every rank sums.
    LOCKSTEP_ENFORCE(folded.summing_ranks == 0 || folded.summing_ranks == impl.world.size(),
                     UsageError, "ft.commit(sums) on some ranks of step ", impl.committed,
                     " and ft.commit() on others (", folded.summing_ranks, " of ",
                     impl.world.size(), " sum): every rank of a step calls the same one, with "
                     "sums of the same shape and type.");
    join = folded.joins > 0;
  }
  if (failure.empty() && (!folded.carried || sums != nullptr)) {
    // The step's verdict, with no store operation: a rank whose reduction
    // failed gives its world up instead of coming here, so this small
    // all-reduce completes only where every rank's reduction held (where
    // one fails, the abandonment, or the dead peer's closed connections,
    // end it on the others). Folded in, under MAX: whether any rank saw a
    // rank ask to join, so that every member re-forms after the same
    // step; and what each sums (none, or a shape and type), negated too,
    // so that every rank sees whether all sum alike before the sums'
    // own all-reduce, which a rank without sums would meet with nothing.
    impl.progress(Phase::Voted);
    auto verdict = at::tensor({int64_t{impl.join_asked() ? 1 : 0}, summing, -summing}, at::kLong);
    // A collective that fails fails the step: its reason, or "".
    auto reduce = [&impl](at::Tensor& tensor, ReduceOp op) -> std::string {
      try {
        impl.world.all_reduce(tensor, op);
      } catch (const CollectiveError& e) {
        return e.what();
      } catch (const TimeoutError& e) {
        return e.what();
      }
      return "";
    };
    failure = reduce(verdict, ReduceOp::Max);
    if (failure.empty()) {
      const int64_t* agreed = verdict.data_ptr<int64_t>();
      LOCKSTEP_ENFORCE(agreed[1] == -agreed[2], UsageError, "ft.commit(sums) on some ranks "
                       "of step ", impl.committed, " and ft.commit() on others, or sums of "
                       "another shape or type: every rank of a step calls the same one, with "
                       "sums of the same shape and type.");
      join = agreed[0] > 0;
      if (sums != nullptr) {
        // A rank that fails here fails the step, so that sums are never
        // of a dropped one (the others then commit without it, and it is
        // behind when the world re-forms, as above).
        failure = reduce(*sums, ReduceOp::Sum);
      }
    }
  }
  if (!failure.empty()) {
    // The others may still wait in this world's collectives: give it up for
    // every rank at once. (Where the verdict's all-reduce completed on some
    // ranks and failed here alone, they have committed the step: this rank
    // is then behind, and receives their state when the world re-forms.)
    failure = detail::give_up(*impl.membership, *impl.liveness, impl.epoch,
                              detail::first_line(failure));
  }
  bool kept = failure.empty();
  if (impl.group) {
    // A group commits or drops a step whole (its ranks hold the parts of
    // one replica); one that drops what others committed is behind, and
    // receives their state when the world re-forms.
    impl.agree_on_step_in_group(kept, join, summing, sums);
    if (!kept && failure.empty()) {
      failure = detail::give_up(*impl.membership, *impl.liveness, impl.epoch,
                                "another rank of this rank's replica group dropped it");
    }
  }
  if (kept) {
    ++impl.committed;
    impl.progress(Phase::Between);
    impl.need_reform = join;
    return true;
  }
  impl.need_reform = true;
  impl.guarded->drop_step();
  impl.progress(Phase::Dropped);
  ++impl.stats.aborted_steps;
  impl.say(detail::str("step ", impl.committed, " is dropped on every rank: ", failure));
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < impl.buffers.size(); ++i) {
    impl.buffers[i].copy_(impl.buffers_at_begin[i]);
  }
  return false;
}

bool FaultTolerance::Impl::join_asked() {
  std::lock_guard<std::mutex> lock(watch->mutex);
  return watch->join_asked;
}

std::string FaultTolerance::Impl::verdict() {
  std::lock_guard<std::mutex> lock(watch->mutex);
  return watch->verdict;
}

void FaultTolerance::Impl::watch_world(int64_t number, const std::vector<Member>& decided,
                                       const std::vector<Member>& ranked, World next) {
  // A collective that waits a step's limit names the ranks that never came:
  // they are hung. (The world, which holds this, goes before the liveness.)
  WorldAccess::watch_hangs(next, options.step_timeout(),
                           [live = liveness, ranked, limit = options.step_timeout()](
                               const std::vector<int>& ranks, const std::string& what) {
                             for (int rank : ranks) {
                               const auto& member = ranked[static_cast<size_t>(rank)];
                               live->report(member.replica, member.incarnation,
                                            detail::str("it did not reach ", what, " within ",
                                                        detail::seconds(limit), " of the others "
                                                        "(FaultToleranceOptions::step_timeout): "
                                                        "it is hung"));
                             }
                           });
  std::lock_guard<std::mutex> lock(watch->mutex);
  watch->epoch = number;
  watch->members = decided;
  watch->world = std::move(next);
  watch->verdict.clear();
  watch->join_asked = false;
}

void FaultTolerance::Impl::on_liveness(const std::shared_ptr<detail::Watch>& watch,
                                       detail::Liveness& liveness, detail::Membership& notices,
                                       const std::vector<std::string>& notes) {
  std::lock_guard<std::mutex> lock(watch->mutex);
  if (!watch->alive) {
    return;
  }
  if (watch->group && watch->group_lost.empty()) {
    // The group's collectives (the wrapper's, inside forward and
    // backward) fail at once, saying why, rather than at their timeout.
    watch->group_lost = detail::group_failure(*watch, liveness);
    if (!watch->group_lost.empty()) {
      WorldAccess::abandon(*watch->group, watch->group_lost);
    }
  }
  if (!watch->world || !watch->verdict.empty()) {
    return;
  }
  for (const auto& note : notes) {
    if (note.rfind(detail::kWantNote, 0) == 0) {
      try {
        watch->join_asked |= std::stoll(note.substr(std::strlen(detail::kWantNote))) > watch->epoch;
      } catch (const std::exception&) {
        // not one of ours
      }
    }
  }
  std::string why;
  for (const auto& member : watch->members) {
    if (auto failure = liveness.failed(member.replica, member.incarnation)) {
      why = member.describe() + " failed: " + *failure;
      break;
    }
  }
  std::string mine = detail::kAbandonNote + std::to_string(watch->epoch);
  bool told = std::find(notes.begin(), notes.end(), mine) != notes.end();
  try {
    if (!why.empty()) {
      why = detail::give_up(notices, liveness, watch->epoch, why);
    } else if (told) {
      // Notes are not signed: only a reason with its proof gives the world
      // up (one is always written before its note).
      why = notices.abandoned(watch->epoch).value_or("");
    }
  } catch (const FaultToleranceError&) {
    // The store is out of reach, or a reason without proof: this rank gives
    // its world up all the same, and its main thread's waits say why.
    why = why.empty() ? "the job's store could not be read" : why;
  }
  if (!why.empty()) {
    watch->verdict = why;
    WorldAccess::abandon(*watch->world, why);
    if (watch->transfer) {
      WorldAccess::abandon(*watch->transfer, why);
    }
  }
}

} // namespace lockstep
