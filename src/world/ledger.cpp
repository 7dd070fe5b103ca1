#include "world/ledger.h"

#include <map>
#include <thread>
#include <vector>

#include <lockstep/error.h>

#include "compat/c10d.h"
#include "world/rendezvous.h"

namespace lockstep::detail {
namespace {

using Clock = std::chrono::steady_clock;

// How often a wait looks at its peers: often enough that a closed or dead
// peer is an error within a fraction of a second, rarely enough that a wait
// costs nothing.
constexpr auto kPeerCheckInterval = std::chrono::milliseconds(100);

} // namespace

Ledger::Ledger(std::unique_ptr<LedgerBoard> board,
               int rank,
               std::vector<ProcessIdentity> peers,
               std::chrono::milliseconds timeout,
               bool compare,
               std::shared_ptr<Liveness> liveness)
    : board_(std::move(board)),
      rank_(rank),
      size_(static_cast<int>(peers.size())),
      peers_(std::move(peers)),
      timeout_(timeout),
      compare_(compare),
      liveness_(std::move(liveness)) {}

void Ledger::arrive(uint64_t seq, const std::string& what) {
  try {
    if (compare_) {
      board_->post(seq, what);
    } else {
      board_->post_soon(seq, what);
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
  auto deadline = Clock::now() + timeout_;
  for (int rank = 0; rank < size_; ++rank) {
    if (rank == rank_) {
      continue;
    }
    std::optional<std::string> theirs;
    bool came = wait_until(
        [&] { return (theirs = board_->posted(rank, seq)).has_value(); }, deadline, seq, what);
    LOCKSTEP_ENFORCE(
        came, TimeoutError, "rank ", rank_, ": collective #", seq, " (", what,
        ") never started: ", attendance(seq), " within ", seconds(timeout_),
        ". A rank that skips a forward or a backward the others run leaves "
        "them waiting.");
    LOCKSTEP_ENFORCE(
        *theirs == what, CollectiveError, "the ranks are out of step at "
        "collective #", seq, ": rank ", rank, " is doing ", *theirs,
        " while rank ", rank_, " is doing ", what, ". Every rank must run "
        "the same forwards, backwards and collectives in the same order: look "
        "for one under a condition on the rank, or for ranks given different "
        "numbers of batches.");
  }
}

void Ledger::check_peers(uint64_t seq, const std::string& what) {
  std::string closed_early;
  std::string failed;
  std::string gone;
  std::map<int, Closed> closed;
  try {
    closed = board_->closed();
  } catch (const std::exception&) {
    return; // the store's host is gone: the collective itself says so
  }
  for (int rank = 0; rank < size_; ++rank) {
    if (rank == rank_) {
      continue;
    }
    auto found = closed.find(rank);
    if (found != closed.end() && found->second.completed < seq) {
      auto& list = found->second.failed ? failed : closed_early;
      list += str(list.empty() ? "" : "; ", "rank ", rank,
                  found->second.failed ? " stopped with an error" : " closed its world",
                  " having completed ", found->second.completed, " collective(s)",
                  found->second.cause.empty() ? "" : " because " + found->second.cause);
    } else if (found == closed.end() && process_gone(peers_[rank])) {
      gone += str(gone.empty() ? "" : "; ", "rank ", rank, " (pid ", peers_[rank].pid, " on ",
                  peers_[rank].host, ")");
    }
  }
  if (closed_early.empty() && failed.empty() && gone.empty()) {
    auto silent = silent_peers(closed);
    if (silent.empty()) {
      return;
    }
    close(seq - 1, /*failed=*/true, silent);
    LOCKSTEP_FAIL(
        CollectiveError, "rank ", rank_, ": ", what, " #", seq, " cannot complete: ", silent,
        ". Either this host can no longer reach theirs (a network cut, or their host is "
        "down), or their processes are stopped or gone; if they still run, they name this "
        "rank in turn.");
  }
  // Whoever waits on this rank from now on learns at once that it will not
  // come, and the store's host need not wait for it.
  close(seq - 1, /*failed=*/true,
        gone.empty() ? "" : gone + " exited without closing its world");
  // A rank that left the loop early, or whose process is gone, is the
  // cause; ranks that failed since (this one among them, for the others)
  // are what followed.
  if (closed_early.empty() && gone.empty()) {
    LOCKSTEP_FAIL(
        CollectiveError, "rank ", rank_, ": ", what, " #", seq, " cannot complete: ", failed,
        ", so it will never complete this one; its own output says why.");
  }
  if (!closed_early.empty()) {
    LOCKSTEP_FAIL(
        CollectiveError, "rank ", rank_, ": ", what, " #", seq, " cannot complete: ",
        closed_early, ", so it will never complete this one. The ranks ran different "
        "numbers of iterations or collectives, most likely because one had fewer "
        "batches than the others: give every rank the same number of batches, or, under "
        "DistributedDataParallel, let the ranks that run out shadow the others with a join "
        "guard (ddp.join(), docs/ddp.md).");
  }
  LOCKSTEP_FAIL(
      CollectiveError, "rank ", rank_, ": ", what, " #", seq, " cannot complete: ", gone,
      " exited without closing its world (a crash, a kill, or an exit before the end); "
      "its own output says why.");
}

std::string Ledger::silent_peers(const std::map<int, Closed>& closed) {
  if (!liveness_) {
    return "";
  }
  std::string silent;
  for (int rank = 0; rank < size_; ++rank) {
    // A peer on this machine is judged by its process, which is exact.
    if (rank == rank_ || peers_[rank].machine == peers_[rank_].machine ||
        closed.count(rank) != 0) {
      continue;
    }
    if (auto why = liveness_->failed(peers_[rank].to_record())) {
      silent += str(silent.empty() ? "" : "; ", "rank ", rank, " (pid ", peers_[rank].pid,
                    " on ", peers_[rank].host, "): ", *why);
    }
  }
  return silent;
}

bool Ledger::wait_until(const std::function<bool()>& ready,
                        Clock::time_point deadline,
                        uint64_t seq,
                        const std::string& what) {
  auto pause = std::chrono::microseconds(0);
  auto next_check = Clock::now() + kPeerCheckInterval;
  while (!ready()) {
    auto now = Clock::now();
    if (now >= next_check) {
      check_peers(seq, what);
      next_check = now + kPeerCheckInterval;
    }
    if (now >= deadline) {
      return false;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(std::max(pause * 2, std::chrono::microseconds(50)),
                     std::chrono::microseconds(10000));
  }
  return true;
}

std::string Ledger::attendance(uint64_t seq, bool failed) const {
  std::vector<int> came;
  std::vector<int> missing;
  for (int rank = 0; rank < size_; ++rank) {
    try {
      (board_->reached(rank, seq) ? came : missing).push_back(rank);
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

std::vector<int> Ledger::missing(uint64_t seq) const {
  std::vector<int> ranks;
  try {
    for (int rank = 0; rank < size_; ++rank) {
      if (rank != rank_ && !board_->reached(rank, seq)) {
        ranks.push_back(rank);
      }
    }
  } catch (const std::exception&) {
    return {};
  }
  return ranks;
}

void Ledger::close(uint64_t count, bool failed, const std::string& cause) {
  try {
    board_->close(count, failed, cause);
  } catch (const std::exception&) {
    // The store's host has gone already: nobody is left to tell.
  }
}

bool Ledger::others_finished() const {
  std::map<int, Closed> closed;
  try {
    closed = board_->closed();
  } catch (const std::exception&) {
    return true;
  }
  for (int rank = 0; rank < size_; ++rank) {
    if (rank != rank_ && closed.count(rank) == 0 && !process_gone(peers_[rank])) {
      return false;
    }
  }
  return true;
}

} // namespace lockstep::detail
