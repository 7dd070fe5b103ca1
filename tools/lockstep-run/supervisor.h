#pragma once

// Runs one attempt of a job's local ranks: spawns them, carries their
// output, stops them all when one fails or a signal arrives.

#include "launcher_store.h"
#include "options.h"

namespace lockstep::run {

enum class Outcome {
  Succeeded, // every rank exited with code 0
  RankFailed, // a rank exited non-zero or was killed; the others stopped
  Interrupted, // SIGINT or SIGTERM reached lockstep-run; forwarded
};

struct AttemptResult {
  Outcome outcome = Outcome::Succeeded;
  int signal = 0; // for Interrupted: which one
};

/// Installs the handlers that forward SIGINT and SIGTERM to the ranks.
void install_signal_forwarding();

/// One attempt of the job's ranks on this machine, on `port` (MASTER_PORT),
/// with the job's store as `store` says.
AttemptResult run_attempt(const RunOptions& options, int attempt, int port,
                          LauncherStore& store);

/// A free TCP port on this machine.
int pick_free_port();

} // namespace lockstep::run
