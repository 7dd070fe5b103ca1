#pragma once

// The job's store: keys and values, and the liveness of the job's
// processes (liveness_table.h), served by one thread to every process of
// the job. It runs in lockstep-run on node 0, so that it outlives any rank
// (as torchrun's agent store does), or, for a job started otherwise, in
// rank 0's process.
//
// Why a store of our own: c10d's FileStore (a job on one host) only ever
// appends and makes each client keep every key it read, and its file lock
// has no timeout, so a process stopped inside an operation stops everyone;
// c10d's TCPStore lives inside a rank and cannot judge liveness. This one
// keeps its keys in memory and deletes them when asked (whole prefixes at
// once), answers each connection on its own (a stopped client holds nobody
// up), parks waits server-side instead of being polled, and refuses any
// message that does not parse without harm to the others.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include <string>

#include "store/endpoint.h"

namespace lockstep::store {

struct ServerOptions {
  /// Where to listen; a TCP port of 0 picks a free one.
  Endpoint endpoint;
  /// Holds every answer this long: a slow store, for measurements.
  std::chrono::milliseconds added_latency{0};
  /// The job's secret, or "": where set, a connection must prove that it
  /// holds it (Op::Challenge, Op::Prove) before any operation but a ping,
  /// and every other is answered Status::Unproven (and logged): a process
  /// that reaches the store without the secret can neither read, write,
  /// delete, nor say hello, beat, report or goodbye.
  std::string secret;
};

/// What a server holds, for measurements and the soak (Op::Stats).
struct ServerStats {
  int64_t keys = 0;
  int64_t key_bytes = 0;
  int64_t connections = 0;
  int64_t operations = 0;
  int64_t slots = 0;
  /// CPU time the store's thread has used, in microseconds: what serving
  /// costs the host that runs it, apart from the clients sharing its cores.
  int64_t cpu_us = 0;
  /// Of `operations`, those on keys (set, get, add, compare-and-set,
  /// waits, deletes): all but liveness's hello, beats, reports and notes.
  /// Fault tolerance's steady step makes none.
  int64_t key_operations = 0;
};

class StoreServer {
 public:
  /// Listens at once (throws std::runtime_error saying why it cannot);
  /// serves from start() on, on a thread of its own.
  explicit StoreServer(ServerOptions options);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  /// Where it listens (with the port chosen).
  const Endpoint& endpoint() const;
  /// Keys it holds from the start, before start() serves any connection:
  /// what a launcher held of a store that is gone, for the one taking over.
  void preload(std::map<std::string, std::string> keys);
  void start();
  /// Stops serving and closes every connection; also on destruction.
  void stop();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  std::thread thread_;
};

} // namespace lockstep::store
