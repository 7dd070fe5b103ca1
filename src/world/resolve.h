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
  /// Prefix of every key this job writes to the store (PrefixStore adds "/").
  std::string key_prefix;
  std::string source;
  DebugLevel debug = DebugLevel::Off;
};

using EnvLookup =
    std::function<std::optional<std::string>(const std::string& name)>;

/// Reads the real process environment.
EnvLookup process_environment();

constexpr std::chrono::minutes kDefaultTimeout{5};

WorldConfig resolve_world(const WorldOptions& options, const EnvLookup& env);

} // namespace lockstep::detail
