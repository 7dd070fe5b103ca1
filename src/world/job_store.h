#pragma once

// The store of one job: where its ranks meet, gather short strings and,
// across hosts, keep the ledger. A job on one host meets in a file store in
// a folder only its user can enter, and opens no socket another machine
// could reach; a job across hosts meets in a TCP store that rank 0 (or
// torchrun's agent) hosts; a world of one keeps an in-memory store.

#include <memory>
#include <string>

#include <c10/util/intrusive_ptr.h>

#include "world/ledger_board.h"
#include "world/resolve.h"

namespace c10d {
class Store;
} // namespace c10d

namespace lockstep::detail {

class JobStore {
 public:
  virtual ~JobStore() = default;
  /// The store, scoped to this job's keys.
  const c10::intrusive_ptr<c10d::Store>& store() const {
    return store_;
  }
  /// Where the ledger of this kind of store keeps its records.
  virtual std::unique_ptr<LedgerBoard> ledger_board(int rank, int size) = 0;
  /// The ledger of a world that fault tolerance forms later: in `store`
  /// (that world's own connection, under its keys `scope`), since the ranks
  /// of such a world are known only once it forms.
  virtual std::unique_ptr<LedgerBoard> ledger_board_under(const std::string& scope,
                                                          c10::intrusive_ptr<c10d::Store> store,
                                                          int rank,
                                                          int size);
  /// A connection of its own to the same store, scoped alike: a c10d store
  /// client is not for two threads at once.
  virtual c10::intrusive_ptr<c10d::Store> another_connection() {
    return store_;
  }
  /// Whether the store lives in this process and ends with it: the others
  /// lose it then.
  virtual bool hosted_here() const {
    return false;
  }
  /// Called once by every rank as it closes its world; the last one
  /// removes what the store left behind.
  virtual void close() {}
  /// The job's nonce that proofs of its secret are bound to; empty where
  /// no secret is proved (stores that no other machine can reach).
  const std::string& nonce() const {
    return nonce_;
  }

 protected:
  c10::intrusive_ptr<c10d::Store> store_;
  std::string nonce_;
};

/// Connects to the job's store as `config` says (WorldConfig::store).
/// Raises RendezvousError when it cannot.
std::unique_ptr<JobStore> connect_job_store(const WorldConfig& config);

/// The file store of a job on this host (host_store.cpp).
std::unique_ptr<JobStore> connect_host_store(const WorldConfig& config);

/// Rank 0's error for a MASTER_PORT that another process holds.
[[noreturn]] void fail_port_in_use(const WorldConfig& config, const std::string& cause);

} // namespace lockstep::detail
