#pragma once

// Who a rank is, as the other ranks can check it: its host name for
// messages, and the machine, pid and start time that tell whether the
// process still runs (answerable only on the same machine).

#include <cstdint>
#include <string>

namespace lockstep::detail {

struct ProcessIdentity {
  std::string host;
  /// The kernel (boot id) and the pid and network namespaces: processes
  /// with the same machine see each other's pids and share memory.
  std::string machine;
  int pid = 0;
  /// Clock ticks since boot at which the process started: with the pid, a
  /// process that a reused pid cannot impersonate.
  uint64_t start_time = 0;

  /// One line, for the store.
  std::string to_record() const;
  /// Parses to_record()'s line; an unreadable one gives an identity on no
  /// machine, which is never judged gone.
  static ProcessIdentity from_record(const std::string& record);
};

ProcessIdentity this_process();

/// Whether `process` has ended (or is a zombie). False for a process of
/// another machine, which cannot be checked from here.
bool process_gone(const ProcessIdentity& process);

/// The state letter of /proc/PID/stat ('R', 'S', 'T' when stopped by a
/// signal, ...), or 0 when there is no such process here.
char process_state(int pid);

} // namespace lockstep::detail
