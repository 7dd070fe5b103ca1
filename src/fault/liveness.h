#pragma once

// Which processes of a fault-tolerant job still take part. Each sends a
// heartbeat through the store, and a thread of each reads the others'
// (both every eighth of the heartbeat timeout) and watches them: a
// member whose process is gone (seen at once on its own host), whose
// heartbeat stopped for the heartbeat timeout (stopped, hung, cut off), or
// whose rank beats with a newer incarnation (restarted) has failed. When a
// member of the current world fails, the thread marks the epoch abandoned
// in the store and gives the world up, so that every wait in it ends
// within a slice instead of at the collective's timeout.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <lockstep/world.h>

#include "fault/membership.h"

namespace lockstep::detail {

class Liveness {
 public:
  /// `connect` gives a connection of the thread's own, scoped to "ft" (again
  /// after one failed: a client whose answer timed out is out of step).
  Liveness(std::function<c10::intrusive_ptr<c10d::Store>()> connect,
           const Member& me,
           int slots,
           std::chrono::milliseconds heartbeat_timeout);
  ~Liveness();

  /// From now on, a failed member of `members` abandons `world` and
  /// `epoch` (its own failures, or one that another rank reported).
  void watch(int64_t epoch, std::vector<Member> members, World world);
  /// Why the watched world was given up, or "".
  std::string verdict();
  /// Why `member` has failed, or nullopt while it lives.
  std::optional<std::string> failed(const Member& member);
  /// The newest incarnation heard beating for `replica`, or -1.
  int incarnation_of(int replica);

 private:
  void run();
  void listen();
  void judge();

  std::function<c10::intrusive_ptr<c10d::Store>()> connect_;
  std::unique_ptr<Membership> membership_;
  Member me_;
  int slots_;
  std::chrono::milliseconds timeout_;
  using Clock = std::chrono::steady_clock;
  Clock::time_point started_;

  std::mutex mutex_;
  struct Beat {
    int incarnation = -1;
    int64_t count = -1;
    Clock::time_point changed{};
  };
  std::vector<Beat> beats_;
  int64_t sent_ = 0; // this rank's heartbeats (the thread's alone)
  Clock::time_point next_listen_{};
  int64_t watched_epoch_ = -1;
  std::vector<Member> watched_;
  std::optional<World> world_;
  std::string verdict_;

  std::atomic<bool> stop_{false};
  std::condition_variable wake_;
  std::thread thread_;
};

} // namespace lockstep::detail
