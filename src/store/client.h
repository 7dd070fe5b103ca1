#pragma once

// A connection to the job's store (server.h). Every call is bounded: by the
// client's timeout, or, for a wait, by the wait plus that timeout. A call
// that fails closes the connection (a late answer must never pass for the
// next one's) and the next call connects afresh, once (a store that was
// reached and refuses now is gone). One call at a time per client: a
// thread that needs its own pace (a heartbeat) has its own.

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "store/endpoint.h"
#include "store/liveness_table.h"
#include "store/server.h"

namespace lockstep::store {

/// The store cannot be reached, did not answer in time, or is no store.
class StoreError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The store has the job's secret, and this client did not prove it (it
/// has none, or another).
class UnprovenError : public StoreError {
 public:
  using StoreError::StoreError;
};

class StoreClient {
 public:
  /// Connects, retrying while nothing listens yet, for at most `timeout`.
  StoreClient(Endpoint endpoint, std::chrono::milliseconds timeout);
  ~StoreClient();
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  const Endpoint& endpoint() const {
    return endpoint_;
  }
  /// The store this client reached last: endpoint(), or one of its
  /// successors once that one was gone.
  const Endpoint& serving() const;
  /// How many times this client found the job's store at another endpoint
  /// than the one before: a store that took over holds only what the
  /// processes wrote to it since (membership.cpp writes back what it holds).
  int moves() const {
    return moves_;
  }
  /// How long a call whose store closed its connection waits for a
  /// successor to answer before it fails (the client's timeout unless set;
  /// lockstep-run's watcher, which may take the store over itself, waits
  /// for none).
  void set_move_wait(std::chrono::milliseconds wait);
  std::chrono::milliseconds timeout() const;
  void set_timeout(std::chrono::milliseconds timeout);

  /// The server's greeting; throws StoreError if the peer is no store.
  std::string ping();
  void set(const std::string& key, const std::string& value);
  std::optional<std::string> get(const std::string& key);
  /// The value once it exists; nullopt if it does not within `wait`.
  std::optional<std::string> wait_get(const std::string& key, std::chrono::milliseconds wait);
  int64_t add(const std::string& key, int64_t delta);
  /// c10d's compareSet: sets `desired` if the key holds `expected` (or is
  /// missing and `expected` is empty); returns the value stored after.
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired);
  /// Every key under `prefix`, with its value, in key order.
  std::vector<std::pair<std::string, std::string>> get_prefix(const std::string& prefix);
  bool erase(const std::string& key);
  int64_t erase_prefix(const std::string& prefix);
  bool check(const std::vector<std::string>& keys);
  /// Whether every key exists within `wait`.
  bool wait(const std::vector<std::string>& keys, std::chrono::milliseconds wait);
  int64_t num_keys();

  /// Beats for `slot` on this connection from now on; returns the newer
  /// incarnation that holds the slot (this one is then refused).
  std::optional<int> hello(int slot, int incarnation, std::chrono::milliseconds heartbeat_timeout,
                           const std::string& identity);
  /// A beat carrying `progress` and the heartbeat timeout this process
  /// declares from now on; answers once the view moved past `since`, or
  /// after `wait` with no change.
  ViewChange watch(int64_t progress, uint64_t since, std::chrono::milliseconds wait,
                   std::chrono::milliseconds heartbeat_timeout);
  void report(int slot, int incarnation, const std::string& why);
  void note(const std::string& text);
  /// `incarnation` of `slot` ends cleanly: its end is no failure; its
  /// progress stays as this last word says (the last beat may be older).
  void goodbye(int slot, int incarnation, int64_t progress);
  /// Wakes a call blocked in another thread (it fails with StoreError);
  /// the next call connects afresh.
  void interrupt();
  std::vector<SlotProgress> progress();
  ServerStats stats();

 private:
  // The answer's body (status first); throws StoreError.
  std::string call(const std::string& request, std::chrono::milliseconds wait);
  /// One request and its answer on the connection there is.
  std::string exchange(const std::string& request, std::chrono::milliseconds wait);
  /// Connects to the store of the job that answers (the endpoint, or a
  /// successor) and, where the endpoint carries the job's secret, proves it.
  void connect(std::chrono::steady_clock::time_point deadline, bool retry = true);
  void connect_to_candidate(size_t index, std::chrono::steady_clock::time_point deadline,
                            bool retry);
  void disconnect();

  Endpoint endpoint_;
  std::vector<Endpoint> candidates_; // endpoint_, then its successors
  size_t serving_ = 0;
  int moves_ = 0;
  std::optional<std::chrono::milliseconds> move_wait_;
  // The last exchange failed because the store closed the connection (not
  // for a late answer, which says nothing of whether it is gone).
  bool closed_by_store_ = false;
  std::mutex mutex_;
  std::chrono::milliseconds timeout_;
  // Changed under fd_mutex_ too, so that interrupt() never shuts a socket
  // that is no longer this client's.
  std::mutex fd_mutex_;
  int fd_ = -1;
  bool interrupted_ = false; // never asked again elsewhere once interrupted
};

} // namespace lockstep::store
