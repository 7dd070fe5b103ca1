#pragma once

// Typed exceptions for everything lockstep reports to its user, and the
// enforce macro that raises them at the boundary where bad input enters.

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace lockstep {

/// Base of every error lockstep raises. The message says what happened,
/// where (rank, variable, address) and how to fix it.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The configuration (options or environment variables) is invalid.
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// The ranks could not form a world: store unreachable, port taken, a rank
/// that never joined.
class RendezvousError : public Error {
 public:
  using Error::Error;
};

/// A wait exceeded its timeout.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

/// The model or its use breaks a rule of DistributedDataParallel: models
/// that differ across ranks, a static-graph violation, a bypassed wrapper
/// under Bypass::Error.
class UsageError : public Error {
 public:
  using Error::Error;
};

/// A checkpoint cannot be written or read: missing, truncated, corrupted,
/// or made for another model.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

/// A collective operation failed (a peer closed its connection, a bad
/// argument rejected by the backend).
class CollectiveError : public Error {
 public:
  using Error::Error;
};

/// A fault-tolerant job cannot go on (fault_tolerance.h): fewer ranks than
/// its min_world_size came back within the timeout, or this process is a
/// stale incarnation of a rank that a newer one replaced.
class FaultToleranceError : public Error {
 public:
  using Error::Error;
};

namespace detail {

template <typename... Args>
std::string str(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

} // namespace detail
} // namespace lockstep

/// Raises `error_type` with the concatenation of the remaining arguments,
/// prefixed with "lockstep: ", unless `cond` holds.
#define LOCKSTEP_ENFORCE(cond, error_type, ...)                       \
  do {                                                                \
    if (!(cond)) {                                                    \
      throw error_type(::lockstep::detail::str("lockstep: ", __VA_ARGS__)); \
    }                                                                 \
  } while (false)

/// Raises `error_type` unconditionally, with the same message format.
#define LOCKSTEP_FAIL(error_type, ...) \
  throw error_type(::lockstep::detail::str("lockstep: ", __VA_ARGS__))
