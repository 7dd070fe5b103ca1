#pragma once

// lockstep-run's command line.

#include <stdexcept>
#include <string>
#include <vector>

namespace lockstep::run {

struct RunOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0; // 0: pick a free one (single node only)
  /// --store-successors: where node 1, 2, ... serve the job's store once
  /// node 0's (and each before theirs) is gone, as "HOST:PORT".
  std::vector<std::string> store_successors;
  std::string job_id; // empty: LOCKSTEP_JOB_ID as it is
  std::string log_dir; // empty: prefix lines on this terminal
  std::vector<int> shown_ranks; // --ranks-filter; empty: every rank's lines
  int max_restarts = 0;
  bool restart_rank = false; // --restart rank: only the failed rank restarts
  double grace_seconds = 3.0; // SIGTERM to SIGKILL when stopping ranks
  std::vector<std::string> command;
  bool help = false;
};

/// A command line that cannot be run; main() prints it with the usage and
/// exits with code 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

RunOptions parse_options(int argc, char** argv);

extern const char* const kUsage;

} // namespace lockstep::run
