#pragma once

// Turns WorldOptions plus environment variables into one validated world
// configuration. Pure: the environment comes in as a lookup function, so that
// every bad input is testable without touching the process environment.

#include <chrono>
#include <functional>
#include <optional>
#include <string>

#include <lockstep/world_options.h>

namespace lockstep::detail {

struct WorldConfig {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  std::string master_addr;
  int master_port = 0;
  std::chrono::milliseconds timeout{0};
  /// torchrun's agent hosts the store; every rank connects as a client.
  bool agent_store = false;
  /// Every rank runs on this host: MASTER_ADDR is a loopback address, or
  /// the launcher said that the local size is the world size.
  bool single_host = false;
  /// Where the ranks meet: a file store in a private folder (one host, no
  /// socket) or a TCP store (rank 0's, or torchrun's agent's).
  enum class StoreKind { File, Tcp } store = StoreKind::Tcp;
  /// Where lockstep-run serves the job's store (LOCKSTEP_STORE_ENDPOINT:
  /// "unix:PATH" or "tcp:HOST:PORT"); empty when rank 0 serves it.
  std::string store_endpoint;
  /// Prefix of every key this job writes to the store (PrefixStore adds "/").
  std::string key_prefix;
  /// The job's id, as in key_prefix.
  std::string job_id;
  /// The job secret; empty for none.
  std::string secret;
  std::string source;
  /// How many times a launcher restarted this rank alone (lockstep-run
  /// --restart rank sets LOCKSTEP_INCARNATION); 0 for its first process.
  int incarnation = 0;
  /// A rank restarted alone while the others go on: init() forms no group
  /// with them (they are mid-training) but gives this process a world of
  /// its own, from which lockstep::FaultTolerance joins the others.
  bool standby = false;
  DebugLevel debug = DebugLevel::Off;
  TransportKind transport = TransportKind::Auto;
};

using EnvLookup =
    std::function<std::optional<std::string>(const std::string& name)>;

/// Reads the real process environment.
EnvLookup process_environment();

constexpr std::chrono::minutes kDefaultTimeout{5};

WorldConfig resolve_world(const WorldOptions& options, const EnvLookup& env);

/// Whether `address` names this host's loopback (127.0.0.0/8, ::1,
/// localhost), judged from its text.
bool is_loopback_name(const std::string& address);

} // namespace lockstep::detail
