#include "world/ledger.h"

#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <lockstep/error.h>

#include "world/rendezvous.h"
#include "world/torch_compat.h"

namespace lockstep::detail {
namespace {

// Records older than this many collectives are removed: enough for every
// bucket of an iteration to be in flight at once.
constexpr uint64_t kKept = 64;


} // namespace

Ledger::Ledger(c10::intrusive_ptr<c10d::Store> store,
               int rank,
               int size,
               std::chrono::milliseconds timeout,
               bool compare)
    : store_(std::move(store)),
      rank_(rank),
      size_(size),
      timeout_(timeout),
      compare_(compare) {}

std::string Ledger::key(uint64_t seq, int rank) const {
  return "arrived/" + std::to_string(seq) + "/" + std::to_string(rank);
}

void Ledger::arrive(uint64_t seq, const std::string& what) {
  if (size_ == 1) {
    return;
  }
  try {
    store_->set(key(seq, rank_), {what.begin(), what.end()});
    if (seq > kKept) {
      store_->deleteKey(key(seq - kKept, rank_));
    }
  } catch (const std::exception& e) {
    LOCKSTEP_FAIL(
        CollectiveError, "rank ", rank_, ": collective #", seq, " (", what,
        ") cannot start: the store is unreachable, so the rank that hosts it "
        "(rank 0, or torchrun's agent) has most likely exited; its own output "
        "says why.\n  cause: ", describe_exception(e));
  }
  if (!compare_) {
    return;
  }
  for (int rank = 0; rank < size_; ++rank) {
    if (rank == rank_) {
      continue;
    }
    try {
      store_->wait({key(seq, rank)}, timeout_);
    } catch (const std::exception& e) {
      LOCKSTEP_FAIL(
          TimeoutError, "rank ", rank_, ": collective #", seq, " (", what,
          ") never started: ", attendance(seq), " within ",
          seconds(timeout_), ". A rank that skips a forward or a "
          "backward the others run leaves them waiting.");
    }
    auto bytes = store_->get(key(seq, rank));
    std::string theirs(bytes.begin(), bytes.end());
    LOCKSTEP_ENFORCE(
        theirs == what, CollectiveError, "the ranks are out of step at "
        "collective #", seq, ": rank ", rank, " is doing ", theirs,
        " while rank ", rank_, " is doing ", what, ". Every rank must run "
        "the same forwards, backwards and collectives in the same order: look "
        "for one under a condition on the rank, or for ranks given different "
        "numbers of batches.");
  }
}

std::string Ledger::attendance(uint64_t seq, bool failed) const {
  std::vector<int> came;
  std::vector<int> missing;
  for (int rank = 0; rank < size_; ++rank) {
    try {
      (store_->check({key(seq, rank)}) ? came : missing).push_back(rank);
    } catch (const std::exception&) {
      return "the store is unreachable too, so the rank that hosts it (rank 0, "
             "or torchrun's agent) has most likely exited; its own output says why";
    }
  }
  if (missing.empty()) {
    return failed ? "every rank reached it, so one failed during it; its own output says why"
                  : "every rank reached it (the transport itself is stuck or slow)";
  }
  std::string text = "rank(s) " + rank_list(missing) + " never reached it (reached: " +
      rank_list(came) + ")";
  return failed ? text + ", most likely because it exited; its own output says why" : text;
}

} // namespace lockstep::detail
