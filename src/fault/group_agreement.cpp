// Replica groups under fault tolerance (FaultTolerance over
// replica_groups): how a rank learns that its group lost a rank, how the
// ranks of a group agree on a step and on a re-forming (all-reduces in the
// group's world, no store operation), and which epoch world each joins
// (its place's).

#include <algorithm>
#include <chrono>
#include <iterator>
#include <thread>

#include <ATen/ATen.h>

#include "common/wording.h"
#include "fault/loop_state.h"
#include "world/epoch_world.h"

namespace lockstep {

using detail::Member;

namespace detail {

std::string group_failure(const Watch& watch, Liveness& liveness) {
  for (const auto& [slot, incarnation] : watch.group_ranks) {
    auto failure = liveness.failed(slot, incarnation);
    if (failure && !liveness.ended(slot, incarnation)) {
      const int size = static_cast<int>(watch.group_ranks.size());
      return str("rank ", slot, " of its replica group (launcher ranks ",
                 watch.group_ranks.front().first, " to ", watch.group_ranks.front().first + size - 1,
                 ") failed: ", *failure, ". A replica group fails as a unit: this rank ends "
                 "too, and once lockstep-run has restarted the group's ranks (--restart rank), "
                 "the group rejoins");
    }
  }
  return "";
}

} // namespace detail

// An all-reduce of `tensor` in the replica group's world; where the group
// lost a rank, FaultToleranceError saying so (this rank ends with it).
void FaultTolerance::Impl::reduce_in_group(at::Tensor& tensor, ReduceOp op,
                                           const std::string& what) {
  try {
    group->all_reduce(tensor, op);
  } catch (const CollectiveError& e) {
    // The reason, where the liveness has it: a peer that exited closed its
    // world's connections at once, and its store connection as it went, so
    // the store's verdict follows within moments; a hung one is named only
    // after its heartbeat timeout, which is not waited for.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    do {
      check_group();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } while (std::chrono::steady_clock::now() < deadline);
    LOCKSTEP_FAIL(FaultToleranceError, "rank ", me.replica, ": its replica group could not "
                  "agree whether it ", what, ": ", detail::first_line(e.what()));
  } catch (const TimeoutError& e) {
    LOCKSTEP_FAIL(FaultToleranceError, "rank ", me.replica, ": its replica group could not "
                  "agree whether it ", what, ": ", detail::first_line(e.what()));
  }
}

bool FaultTolerance::Impl::agree_in_group(bool holds, const std::string& what) {
  if (!group) {
    return holds;
  }
  auto flag = at::tensor({int64_t{holds ? 1 : 0}}, at::kLong);
  reduce_in_group(flag, ReduceOp::Min, what);
  return flag.item<int64_t>() == 1;
}

void FaultTolerance::Impl::agree_on_step_in_group(bool& kept, bool& join, int64_t summing,
                                                  at::Tensor* sums) {
  const std::string what = detail::str("keeps step ", committed);
  auto verdict = at::tensor({int64_t{kept ? 0 : 1}, int64_t{join ? 1 : 0}, summing, -summing},
                            at::kLong);
  reduce_in_group(verdict, ReduceOp::Max, what);
  const int64_t* agreed = verdict.data_ptr<int64_t>();
  LOCKSTEP_ENFORCE(agreed[2] == -agreed[3], UsageError, "ft.commit(sums) on some ranks of a "
                   "replica group at step ", committed, " and ft.commit() on others, or sums of "
                   "another shape or type: every rank of a step calls the same one, with sums "
                   "of the same shape and type.");
  kept = agreed[0] == 0;
  join = agreed[1] > 0;
  if (kept && sums != nullptr) {
    reduce_in_group(*sums, ReduceOp::Sum, what);
  }
}

void FaultTolerance::Impl::check_group() const {
  if (!group || !watch) {
    return;
  }
  std::string why;
  {
    std::lock_guard<std::mutex> lock(watch->mutex);
    why = watch->group_lost;
  }
  if (why.empty()) {
    why = detail::group_failure(*watch, *liveness);
  }
  LOCKSTEP_ENFORCE(why.empty(), FaultToleranceError, "rank ", me.replica, ": ", why, ".");
}

std::vector<Member> FaultTolerance::Impl::at_my_place(const std::vector<Member>& decided) const {
  if (group_size == 1) {
    return decided;
  }
  std::vector<Member> ranked;
  std::copy_if(decided.begin(), decided.end(), std::back_inserter(ranked),
               [&](const Member& m) { return m.replica % group_size == me.replica % group_size; });
  std::sort(ranked.begin(), ranked.end(),
            [](const Member& a, const Member& b) { return a.replica < b.replica; });
  return ranked;
}

std::string FaultTolerance::Impl::world_scope(int64_t number, int place) const {
  auto scope = detail::epoch_key(number, "world");
  return group_size == 1 ? scope : detail::str(scope, ".p", place);
}

} // namespace lockstep
