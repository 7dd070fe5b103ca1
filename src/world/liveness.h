#pragma once

// This process's part in the job's one liveness system (store/
// liveness_table.h): a thread beats for its slot on a connection of its
// own, carrying the main thread's progress, and keeps the job's view
// fresh (each beat is a watch, answered at once when the view changes).
// The store judges; this class only reads the verdicts: the ledger (peers
// of other hosts fallen silent) and fault tolerance (a member failed, an
// epoch given up) ask it, and fault tolerance is called back on every
// change.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "store/endpoint.h"
#include "store/liveness_table.h"

namespace lockstep::store {
class StoreClient;
} // namespace lockstep::store

namespace lockstep::detail {

class Liveness {
 public:
  struct Process {
    /// The launcher rank: the slot a restart refills.
    int slot = 0;
    int incarnation = 0;
    /// ProcessIdentity::to_record() of this process.
    std::string identity;
  };

  /// Says hello for `me` (beating every `heartbeat_timeout` / 8) and starts
  /// the thread. Store operations are bounded by `store_timeout`.
  Liveness(store::Endpoint endpoint, std::chrono::milliseconds store_timeout, Process me,
           std::chrono::milliseconds heartbeat_timeout);
  /// stop().
  ~Liveness();
  Liveness(const Liveness&) = delete;
  Liveness& operator=(const Liveness&) = delete;

  /// A new heartbeat timeout for this process (fault tolerance's), declared
  /// with the next beat.
  void set_heartbeat_timeout(std::chrono::milliseconds timeout);
  std::chrono::milliseconds heartbeat_timeout() const;
  /// The main thread's progress, sent with each beat (store::Op::Progress
  /// shows it to a judge of hangs).
  void set_progress(int64_t progress) {
    progress_ = progress;
  }

  /// Why `incarnation` of `slot` has failed, or nullopt while it lives.
  std::optional<std::string> failed(int slot, int incarnation) const;
  /// The same for a process known by its identity (the ledger's peers);
  /// nullopt also for one that never said hello.
  std::optional<std::string> failed(const std::string& identity) const;
  /// Whether `incarnation` of `slot` ended cleanly (said goodbye).
  bool ended(int slot, int incarnation) const;
  /// The newest incarnation that said hello for `slot` (-1 if none).
  int incarnation_of(int slot) const;
  /// The incarnation that took this process's slot, once one has.
  std::optional<int> replaced_by() const;

  /// Called on the liveness thread after each change of the view, with the
  /// notes posted since the last call. One callback at a time; once
  /// on_change() returns, the one it replaced is neither running nor held.
  void on_change(std::function<void(const std::vector<std::string>& notes)> callback);
  /// Posts a note to every watcher (store::Op::Note).
  void note(const std::string& text);
  /// Tells the store that `incarnation` of `slot` failed (a hang).
  void report(int slot, int incarnation, const std::string& why);
  std::vector<store::SlotProgress> progress();
  /// This process ends cleanly: its end is not a failure.
  void goodbye();
  /// Says goodbye (if goodbye() was called) and stops the thread: before
  /// the store goes, where this process hosts it.
  void stop();

 private:
  void run();
  // Connects the beating connection and says hello; false if the store
  // does not answer within a short try.
  bool connect();
  /// Says hello for this process on `client`'s connection, noting a newer
  /// incarnation that holds its slot.
  void say_hello(store::StoreClient& client);
  void apply(const store::ViewChange& change);
  /// Whether `client` reached another store than the one before (one took
  /// over): the view is then to be confirmed by the new store.
  bool note_serving(const store::StoreClient& client);

  store::Endpoint endpoint_;
  std::chrono::milliseconds store_timeout_;
  Process me_;
  std::atomic<int64_t> heartbeat_ms_;
  std::atomic<int64_t> progress_{0};
  std::atomic<bool> goodbye_{false};
  std::atomic<bool> stop_{false};
  std::mutex stop_mutex_; // with stop_: no connection is made after stop()
  // The beating connection, the thread's alone; and one for the others'
  // calls.
  std::unique_ptr<store::StoreClient> beating_;
  std::unique_ptr<store::StoreClient> calls_;
  std::mutex calls_mutex_;
  std::mutex callback_mutex_; // apply()'s call of the callback; on_change()

  mutable std::mutex mutex_;
  std::map<int, store::SlotView> view_;
  /// The slot each process (its identity) said hello for, last.
  std::unordered_map<std::string, int> slot_of_identity_;
  uint64_t version_ = 0;
  std::string serving_; // where the store answered last
  /// Since when the view is that of a store that took over, and where.
  struct Moved {
    std::chrono::steady_clock::time_point when;
    std::string to;
  };
  std::optional<Moved> moved_;
  /// The slots alive in the view before the move that the store which took
  /// over has not shown since.
  std::set<int> unconfirmed_;
  std::optional<int> replaced_by_;
  std::function<void(const std::vector<std::string>&)> callback_;
  std::thread thread_;
};

} // namespace lockstep::detail
