#pragma once

// Which rank reached which collective, kept beside the process group (on a
// LedgerBoard): when a collective hangs, the board (not the stuck group)
// tells who never came; when a rank closed its world or its process is
// gone, every wait learns it within a fraction of a second instead of at
// the timeout; with LOCKSTEP_DEBUG=DETAIL, ranks also compare what each is
// about to do before doing it, so that mismatched collectives become an
// error naming both sides instead of a hang or silent garbage.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "world/ledger_board.h"
#include "world/liveness.h"
#include "world/process_identity.h"

namespace lockstep::detail {

class Ledger {
 public:
  /// `liveness`, where the world spans hosts, judges its peers there (a
  /// peer on this host is judged by its process); null on one host.
  Ledger(std::unique_ptr<LedgerBoard> board,
         int rank,
         std::vector<ProcessIdentity> peers,
         std::chrono::milliseconds timeout,
         bool compare,
         std::shared_ptr<Liveness> liveness);

  /// Records that this rank reached collective `seq` to do `what`. When
  /// comparing, waits for every rank's record and raises CollectiveError if
  /// one differs, or TimeoutError naming the ranks that never came.
  void arrive(uint64_t seq, const std::string& what);

  /// Whether arrive() compares every rank's record (LOCKSTEP_DEBUG=DETAIL).
  void set_compare(bool compare) {
    compare_ = compare;
  }

  /// Raises CollectiveError when some peer will never reach collective
  /// `seq`: it closed its world having completed fewer, or its process is
  /// gone. `what` names the collective this rank waits in.
  void check_peers(uint64_t seq, const std::string& what);

  /// Polls `ready` (backing off from microseconds to 10 ms) until it holds,
  /// checking the peers as check_peers() does every 100 ms or so. Returns
  /// false at `deadline`.
  bool wait_until(const std::function<bool()>& ready,
                  std::chrono::steady_clock::time_point deadline,
                  uint64_t seq,
                  const std::string& what);

  /// For the error of a collective `seq` that timed out (`failed` false)
  /// or broke (true): which ranks reached it and which did not, as the
  /// board knows it, and what that suggests.
  std::string attendance(uint64_t seq, bool failed = false) const;

  /// The ranks that have not reached collective `seq` (none when the board
  /// cannot be read).
  std::vector<int> missing(uint64_t seq) const;

  /// Records that this rank closed its world having completed the first
  /// `count` collectives; `failed` when an error closes it.
  void close(uint64_t count, bool failed, const std::string& cause = "");

  /// Whether every other rank has closed or is gone: the store's host may
  /// then leave.
  bool others_finished() const;

 private:
  std::unique_ptr<LedgerBoard> board_;
  int rank_;
  int size_;
  std::vector<ProcessIdentity> peers_;
  std::chrono::milliseconds timeout_;
  std::atomic<bool> compare_;
  uint64_t count_at_failure_ = 0;

  // The peers of other machines that the job's liveness finds failed
  // (fallen silent, or gone), as one phrase ("" for none).
  std::string silent_peers(const std::map<int, Closed>& closed);
  std::shared_ptr<Liveness> liveness_;
};

} // namespace lockstep::detail
