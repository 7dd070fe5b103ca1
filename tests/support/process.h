#pragma once

// A child process for tests: fork+exec with its own environment and
// process group, output captured in a file, a hard deadline.

#include <sys/types.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace lockstep::testing {

/// Variables to add or override; a value "" unsets the variable.
using Environment = std::map<std::string, std::string>;

struct ProcessExit {
  int exit_code = -1; // when it exited
  int signal = 0; // when a signal ended it
  bool timed_out = false;
  std::string output; // stdout and stderr, interleaved

  bool ok() const {
    return exit_code == 0 && signal == 0 && !timed_out;
  }
  std::string status() const;
};

class Process {
 public:
  /// Starts `argv` with this process's environment, less the variables of
  /// other launchers (OMPI_*, SLURM_*, TORCHELASTIC_*), plus `environment`.
  Process(const std::vector<std::string>& argv, const Environment& environment);
  ~Process();
  Process(Process&& other) noexcept;
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const {
    return pid_;
  }
  /// Whether it has ended (reaps it if so), without waiting.
  bool poll();
  /// Kills it with its whole process group.
  void kill_group(int signo);
  /// Waits until it ends or `deadline` passes; then it is killed and
  /// reported as timed out.
  /// With `stacks`, a process still running at the deadline is stopped and
  /// every thread's stack goes into its output (where gdb is installed)
  /// before it is killed.
  ProcessExit wait_until(std::chrono::steady_clock::time_point deadline, bool stacks = false);
  /// What it printed so far.
  std::string output() const;

 private:
  pid_t pid_ = -1;
  std::string log_path_;
  bool running_ = false;
  ProcessExit exit_;
};

/// Runs `argv` to completion (at most `timeout`) and returns how it ended.
ProcessExit run_process(
    const std::vector<std::string>& argv,
    const Environment& environment = {},
    std::chrono::milliseconds timeout = std::chrono::seconds(120));

} // namespace lockstep::testing
