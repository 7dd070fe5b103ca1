#pragma once

// The job's store as lockstep-run sees it. Node 0's launcher hosts it (as
// torchrun's agent hosts its own), so that it outlives any rank: on one
// host on a Unix socket in the job's private folder (no socket another
// machine can reach), across hosts at --master-addr:--master-port. Across
// hosts, node k of --store-successors takes over at its own address once
// every store before its is known gone (docs/fault-tolerance.md). Every
// launcher also reads it: it ends a rank of its node that the others judged
// hung, records that the job's loop ended when a rank exits with 0, and
// tells a rank restarted too late (one that found the loop ended) from a
// crash.

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "options.h"
#include "store/endpoint.h"

namespace lockstep::store {
class StoreServer;
class StoreClient;
} // namespace lockstep::store

namespace lockstep::run {

/// How long one call to the job's store may take, and one try to reach it
/// (short, so that the launcher's end never waits on one).
inline constexpr auto kStoreTimeout = std::chrono::seconds(10);
inline constexpr auto kConnectTry = std::chrono::milliseconds(500);
/// Set by the launcher that serves the store once its job succeeded: the
/// others read it and take nothing over at the end.
inline constexpr const char* kEndedKey = "lockstep/ended";
/// The newest incarnation of each slot that a store which was gone had
/// seen, as "slot incarnation" lines: written back by a launcher to the
/// store that took over, whose liveness table knows only the processes
/// that said hello to it since (a lost node's ranks never will).
inline constexpr const char* kIncarnationsKey = "lockstep/incarnations";

/// A rank of this node that the job's store shows judged hung.
struct Hung {
  int slot = 0;
  int incarnation = 0;
  std::string why;
};

class LauncherStore {
 public:
  /// Node 0 serves the store from now on; every node watches it (from a
  /// thread that connects once the store answers).
  LauncherStore(const RunOptions& options, int port);
  ~LauncherStore();
  LauncherStore(const LauncherStore&) = delete;
  LauncherStore& operator=(const LauncherStore&) = delete;

  /// LOCKSTEP_STORE_ENDPOINT for the ranks.
  const std::string& endpoint() const {
    return endpoint_;
  }
  /// A file descriptor that becomes readable when a rank is judged hung.
  int hung_fd() const {
    return wake_[0];
  }
  std::vector<Hung> take_hung();
  /// The newest incarnation of each slot that the job's store has seen say
  /// hello (empty where the store does not answer at once: a job that is
  /// starting). A launcher that finds its node's slots there replaces a
  /// node the job lost, and starts its ranks as their next incarnations.
  std::map<int, int> known_incarnations();
  /// Where this launcher serves the job's store (node 0, or a successor
  /// that took it over) and the job succeeded: waits, at most `limit`,
  /// until no process of the job is alive, so that the others' last words
  /// reach it and no successor takes over at the end.
  void linger(std::chrono::seconds limit);
  /// Forgets what an earlier attempt left in the store (node 0).
  void begin_attempt(int attempt);
  /// A rank exited with 0: the loop of the job's attempt ended.
  void job_finished(int attempt);
  /// A rank of this node exited with 0 (any --restart): a store gone from
  /// now on is the job ending, and no launcher takes it over.
  void rank_finished() {
    loop_ended_ = true;
  }
  /// What `incarnation` of `slot` recorded when it found the loop ended
  /// (detail::kLeft or detail::kCrashedAfterLoop, its proof checked);
  /// nullopt if nothing.
  std::optional<std::string> left(int attempt, int slot, int incarnation);

 private:
  /// Where the store is, with the job's secret to prove on connecting.
  store::Endpoint store_endpoint() const;
  void watch();
  /// Node 0 started afresh: whether a successor serves the job's store
  /// (it took over from the node 0 that was lost).
  bool served_by_a_successor();
  /// A node with an address in the job's list (node 0, or one of
  /// --store-successors): serves the job's store there when every other
  /// address of it is known gone (refused, not silent), after k seconds.
  void take_over_if_gone();
  /// What this launcher holds of the job's store, written to a store that
  /// took over: the job's record and the loop's end.
  void write_back(store::StoreClient& client);
  std::string prefix(int attempt) const;
  // Proves a claim as the ranks do (WorldAccess::prove), with the nonce of
  // the job's record; "-" without a secret, "" when there is no record.
  std::string prove(const std::string& claim);
  bool proven(const std::string& claim, const std::string& proof);
  std::string nonce();

  RunOptions options_;
  std::string job_id_;
  std::string secret_;
  std::string endpoint_;
  std::string folder_; // one host: the job's folder, which the launcher removes
  int port_fd_ = -1;
  std::unique_ptr<store::StoreServer> server_;
  std::mutex client_mutex_;
  std::unique_ptr<store::StoreClient> client_;
  int wake_[2] = {-1, -1};
  std::mutex hung_mutex_;
  std::vector<Hung> hung_;
  bool stop_ = false;
  std::unique_ptr<store::StoreClient> watcher_;
  std::string record_; // the job's record (the watcher thread's)
  std::map<int, int> incarnations_; // slot: the newest seen (the watcher thread's)
  // The latest epoch's key and value as last read (the watcher thread's).
  std::pair<std::string, std::string> latest_epoch_;
  std::atomic<int> attempt_{0};
  std::atomic<bool> loop_ended_{false}; // a rank exited with 0, here or anywhere
  std::atomic<bool> serving_{false};    // server_ is set (main thread's view)
  std::mutex finished_mutex_;
  std::string finished_key_;
  std::string finished_value_;
  std::thread thread_;
};

} // namespace lockstep::run
