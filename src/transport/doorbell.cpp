#include "transport/doorbell.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>

namespace lockstep::detail {
namespace {

using Clock = std::chrono::steady_clock;

// How long a waiter spins before it sleeps: about the time a peer on
// another core takes to see a post and answer it.
constexpr auto kSpin = std::chrono::microseconds(5);

long futex(std::atomic<uint32_t>* word, int operation, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), operation, value, timeout,
                   nullptr, 0);
}

inline void pause_cpu() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

} // namespace

void Doorbell::ring() {
  epoch.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers.load(std::memory_order_seq_cst) > 0) {
    futex(&epoch, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

bool Doorbell::sleep(uint32_t seen, Clock::time_point deadline) {
  auto spin_until = std::min(Clock::now() + kSpin, deadline);
  while (Clock::now() < spin_until) {
    if (now() != seen) {
      return true;
    }
    pause_cpu();
  }
  sleepers.fetch_add(1, std::memory_order_seq_cst);
  while (now() == seen) {
    auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) {
      break;
    }
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec timeout{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    futex(&epoch, FUTEX_WAIT, seen, &timeout);
  }
  sleepers.fetch_sub(1, std::memory_order_seq_cst);
  return now() != seen;
}

} // namespace lockstep::detail
