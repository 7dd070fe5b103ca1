#pragma once

// The job's store as lockstep-run sees it. Node 0's launcher hosts it (as
// torchrun's agent hosts its own), so that it outlives any rank: on one
// host on a Unix socket in the job's private folder (no socket another
// machine can reach), across hosts at --master-addr:--master-port. Every
// launcher also reads it: it ends a rank of its node that the others judged
// hung, records that the job's loop ended when a rank exits with 0, and
// tells a rank restarted too late (one that found the loop ended) from a
// crash.

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
  /// Forgets what an earlier attempt left in the store (node 0).
  void begin_attempt(int attempt);
  /// A rank exited with 0: the loop of the job's attempt ended.
  void job_finished(int attempt);
  /// What `incarnation` of `slot` recorded when it found the loop ended
  /// (detail::kLeft or detail::kCrashedAfterLoop, its proof checked);
  /// nullopt if nothing.
  std::optional<std::string> left(int attempt, int slot, int incarnation);

 private:
  /// Where the store is, with the job's secret to prove on connecting.
  store::Endpoint store_endpoint() const;
  void watch();
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
  std::thread thread_;
};

} // namespace lockstep::run
