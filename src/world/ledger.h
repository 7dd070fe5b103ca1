#pragma once

// Which rank reached which collective, kept in the store beside the process
// group: when a collective hangs, the store (not the stuck group) tells who
// never came; with LOCKSTEP_DEBUG=DETAIL, ranks also compare what each is
// about to do before doing it, so that mismatched collectives become an
// error naming both sides instead of a hang or silent garbage.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include <c10/util/intrusive_ptr.h>

namespace c10d {
class Store;
} // namespace c10d

namespace lockstep::detail {

class Ledger {
 public:
  Ledger(c10::intrusive_ptr<c10d::Store> store,
         int rank,
         int size,
         std::chrono::milliseconds timeout,
         bool compare);

  /// Records that this rank reached collective `seq` to do `what`. When
  /// comparing, waits for every rank's record and raises CollectiveError if
  /// one differs, or TimeoutError naming the ranks that never came.
  void arrive(uint64_t seq, const std::string& what);

  /// Whether arrive() compares every rank's record (LOCKSTEP_DEBUG=DETAIL).
  void set_compare(bool compare) {
    compare_ = compare;
  }

  /// For the error of a collective `seq` that timed out (`failed` false)
  /// or broke (true): which ranks reached it and which did not, as the
  /// store knows it, and what that suggests.
  std::string attendance(uint64_t seq, bool failed = false) const;

 private:
  std::string key(uint64_t seq, int rank) const;

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  std::atomic<bool> compare_;
};

} // namespace lockstep::detail
