#pragma once

#include <chrono>
#include <optional>
#include <string>

#include <torch/arg.h>

#include <lockstep/debug_level.h>

namespace lockstep {

/// What carries a world's collectives of CPU tensors.
enum class TransportKind {
  /// Shared memory when every rank runs on one host, else Gloo.
  Auto,
  /// Gloo over TCP (loopback on one host).
  Gloo,
  /// Shared memory; an error from init() when it cannot be had.
  SharedMemory,
};

/// How `lockstep::init()` forms the world. Every field left unset is read
/// from the environment (see docs/world.md for the order), so a program
/// normally passes no options at all.
struct WorldOptions {
  /// This process's rank, 0 <= rank < size.
  TORCH_ARG(std::optional<int>, rank);
  /// The number of processes in the job.
  TORCH_ARG(std::optional<int>, size);
  /// This process's rank among the processes on its machine.
  TORCH_ARG(std::optional<int>, local_rank);
  /// The number of processes on this machine.
  TORCH_ARG(std::optional<int>, local_size);
  /// Address of the machine that hosts the store (rank 0's, or the agent's).
  TORCH_ARG(std::optional<std::string>, master_addr);
  /// TCP port of the store.
  TORCH_ARG(std::optional<int>, master_port);
  /// Limit on every wait: rendezvous and each collective. Default 5 minutes,
  /// or LOCKSTEP_TIMEOUT (seconds).
  TORCH_ARG(std::optional<std::chrono::milliseconds>, timeout);
  /// Scopes the store keys, so that two jobs sharing one store never mix,
  /// and tells a job's ranks from another job's that was given the same
  /// address and port. Default: LOCKSTEP_JOB_ID, else TORCHELASTIC_RUN_ID,
  /// else "default".
  TORCH_ARG(std::optional<std::string>, job_id);
  /// A secret that every rank of a job across hosts proves it holds when it
  /// joins (an HMAC over the job id and a nonce; the secret never travels):
  /// a process without it is refused. Default: LOCKSTEP_JOB_SECRET, else
  /// none. See docs/world.md#security.
  TORCH_ARG(std::optional<std::string>, secret);
  /// Unset: LOCKSTEP_DEBUG (OFF, INFO or DETAIL), else Off. At Detail, the
  /// ranks compare every collective before running it.
  TORCH_ARG(std::optional<DebugLevel>, debug);
  /// Unset: LOCKSTEP_TRANSPORT (auto, gloo or shm), else Auto. See
  /// docs/world.md#transports.
  TORCH_ARG(std::optional<TransportKind>, transport);
};

} // namespace lockstep
