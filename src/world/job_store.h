#pragma once

// The store of one job (store/server.h): where its ranks meet, gather short
// strings, agree under fault tolerance and beat (the one liveness system),
// and, across hosts, keep the ledger. lockstep-run hosts it on node 0 and
// hands the ranks its endpoint (LOCKSTEP_STORE_ENDPOINT), so that it
// outlives any rank; a job started otherwise has rank 0 host it, on a Unix
// socket in a folder only its user can enter (one host: no socket another
// machine could reach) or at MASTER_ADDR:MASTER_PORT (across hosts; under
// torchrun, at a port published in torchrun's agent store). A world of one
// keeps an in-memory store.
//
// Bounded: what a world formed later leaves behind (its keys, its mapped
// ledger) is retired with it (retire()); nothing else grows with steps.

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include <c10/util/intrusive_ptr.h>

#include "store/endpoint.h"
#include "world/ledger_board.h"
#include "world/resolve.h"

namespace c10d {
class Store;
} // namespace c10d

namespace lockstep::store {
class StoreClient;
class StoreServer;
} // namespace lockstep::store

namespace lockstep::detail {

class JobStore {
 public:
  virtual ~JobStore();
  /// The store, scoped to this job's keys.
  const c10::intrusive_ptr<c10d::Store>& store() const {
    return store_;
  }
  /// A connection of its own to the same store, scoped alike: a store
  /// client is not for two threads at once.
  virtual c10::intrusive_ptr<c10d::Store> another_connection();
  /// Where the ledger of a world keeps its records: the world that init()
  /// forms (`scope` empty) or one formed later under `scope` (`store` is
  /// that world's own connection, under its keys).
  virtual std::unique_ptr<LedgerBoard> ledger_board(const std::string& scope,
                                                    c10::intrusive_ptr<c10d::Store> store,
                                                    int rank,
                                                    int size);
  /// Deletes what a world formed under `scope` left: its keys and its
  /// mapped ledger. Its members must have given it up.
  virtual void retire(const std::string& scope);
  /// A client of the store's own protocol (liveness, fault tolerance), on a
  /// connection of its own; keys are then written with key_prefix() + "/".
  /// Raises RendezvousError for a world of one, which has no such store.
  std::unique_ptr<store::StoreClient> client() const;
  const std::string& key_prefix() const {
    return key_prefix_;
  }
  /// Where the store listens; none for a world of one.
  const std::optional<store::Endpoint>& endpoint() const {
    return endpoint_;
  }
  /// Whether the store lives in this process and ends with it: the others
  /// lose it then.
  bool hosted_here() const;
  /// Called once by every rank as it closes its world.
  virtual void close();
  /// The job's nonce that proofs of its secret are bound to; empty where
  /// no secret is proved.
  const std::string& nonce() const {
    return nonce_;
  }

 protected:
  /// Connects to the store at `endpoint`, checks that it is a job store,
  /// and records or checks the job it belongs to (its id and, with a
  /// secret, its proof); sets store_ and nonce_.
  void attach(const WorldConfig& config, store::Endpoint endpoint);

  c10::intrusive_ptr<c10d::Store> store_;
  std::string nonce_;
  std::string key_prefix_;
  std::chrono::milliseconds timeout_{0};
  std::optional<store::Endpoint> endpoint_;
  std::unique_ptr<store::StoreServer> server_;
};

/// Connects to the job's store as `config` says (WorldConfig::store).
/// Raises RendezvousError when it cannot.
std::unique_ptr<JobStore> connect_job_store(const WorldConfig& config);

/// The store of a job on this host, in its private folder (host_store.cpp).
std::unique_ptr<JobStore> connect_host_store(const WorldConfig& config);

/// Rank 0's error for a MASTER_PORT that another process holds.
[[noreturn]] void fail_port_in_use(const WorldConfig& config, const std::string& cause);

} // namespace lockstep::detail
