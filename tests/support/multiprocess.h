#pragma once

// Runs a test body as N real processes: the test binary re-executes itself
// (fork+exec, never a bare fork after LibTorch started its threads) with
// --gtest_filter set to the current test and the rank in its environment.
// Every rank's output and failures come back into the parent's result, and a
// hard timeout kills all ranks so that a hang fails the test instead of CI.

#include <chrono>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "support/process.h"

namespace lockstep::testing {

using RankEnvironment = Environment;

struct LaunchOptions {
  int world_size = 2;
  /// Hard limit for the whole launch; every rank still running then is
  /// killed (with its process group) and reported as timed out.
  std::chrono::milliseconds timeout{60000};
  /// Adds or overrides variables for one rank. By default each rank gets
  /// RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1,
  /// MASTER_PORT (free) and OMP_NUM_THREADS=1; set a value to "" to unset it.
  std::function<void(int rank, RankEnvironment&)> environment;
  /// A rank killed at the limit leaves every thread's stack in its output
  /// (where gdb is installed; it takes seconds).
  bool stacks_on_timeout = true;
};

struct RankResult : ProcessExit {
  int rank = 0;
  /// "rank R: " and how it ended.
  std::string status() const;
};

struct LaunchResult {
  std::vector<RankResult> ranks;
  int master_port = 0;
  std::chrono::milliseconds elapsed{0};

  bool ok() const;
  bool timed_out() const;
  /// The status of every rank, with the output of those that did not
  /// succeed.
  std::string report() const;
};

/// Runs `body(rank)` in `options.world_size` processes and returns how each
/// ended. A rank re-runs the test from its start up to this call, then runs
/// the body and exits: the code after the call runs only in the parent, and
/// what the test computed before the call is computed again in each rank
/// (pass a value that must be the same, like a path, through `environment`).
/// In a test with several launches, a rank of a later one passes the earlier
/// ones, which return an empty result there: guard code that reads that
/// result with `if (!in_rank_process())`.
LaunchResult launch_ranks(
    const LaunchOptions& options,
    const std::function<void(int rank)>& body);

/// launch_ranks, then a gtest failure carrying report() unless every rank
/// succeeded.
void run_ranks(
    int world_size,
    const std::function<void(int rank)>& body,
    std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));

/// A world size and the transport its collectives go through
/// (LOCKSTEP_TRANSPORT), for tests parameterised over both.
struct WorldSetup {
  int size = 2;
  std::string transport = "auto";
  /// "world1", "world2_shm", "world2_gloo", ...
  std::string name() const;
};
void PrintTo(const WorldSetup& setup, std::ostream* out);

/// World sizes 1 to 4; from 2 on, once over shared memory and once over Gloo.
std::vector<WorldSetup> every_world_setup();
/// World sizes 2 and 3, each over shared memory and over Gloo: where the
/// number of ranks matters, without the time of 1 and 4.
std::vector<WorldSetup> two_and_three_rank_setups();

/// run_ranks with `setup`'s size and transport.
void run_ranks(
    const WorldSetup& setup,
    const std::function<void(int rank)>& body,
    std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));

/// A TCP port on 127.0.0.1 that was free a moment ago.
int free_port();

/// Whether this process is a rank started by launch_ranks.
bool in_rank_process();

} // namespace lockstep::testing
