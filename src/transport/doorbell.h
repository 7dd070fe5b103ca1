#pragma once

// Waiting on the ranks of a host without burning a core that the model's
// compute needs: a waiter spins for a few microseconds (a peer that is about
// to post usually does so within them), then sleeps in the kernel on a word
// of shared memory (a futex) until a peer rings or its slice of time runs
// out. A ring is one atomic increment, plus a system call only when someone
// sleeps.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>

namespace lockstep::detail {

struct alignas(64) Doorbell {
  std::atomic<uint32_t> epoch;
  std::atomic<uint32_t> sleepers;

  /// Tells every waiter that something it may wait for has changed.
  void ring();

  /// The current epoch: read before checking a condition, and pass it to
  /// sleep() so that a ring in between is not missed.
  uint32_t now() const {
    return epoch.load(std::memory_order_seq_cst);
  }

  /// Returns once the epoch differs from `seen` or `deadline` passed,
  /// spinning for a few microseconds before sleeping. True when rung.
  bool sleep(uint32_t seen, std::chrono::steady_clock::time_point deadline);
};

static_assert(std::atomic<uint32_t>::is_always_lock_free, "the doorbell needs lock-free atomics");

} // namespace lockstep::detail
