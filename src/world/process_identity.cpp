#include "world/process_identity.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <sstream>

namespace lockstep::detail {
namespace {

std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string namespace_of(const char* kind) {
  char target[128] = {};
  std::string link = std::string("/proc/self/ns/") + kind;
  ssize_t length = ::readlink(link.c_str(), target, sizeof(target) - 1);
  return length > 0 ? std::string(target, static_cast<size_t>(length)) : "";
}

// Field 3 (state) and field 22 (start time) of /proc/PID/stat; the command
// name in field 2 may hold spaces, so parsing starts after its ')'.
bool read_stat(int pid, char& state, uint64_t& start_time) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) {
    return false;
  }
  auto close = stat.rfind(')');
  if (close == std::string::npos) {
    return false;
  }
  std::istringstream fields(stat.substr(close + 1));
  std::string skip;
  fields >> state;
  for (int field = 4; field < 22 && fields >> skip; ++field) {
  }
  return static_cast<bool>(fields >> start_time);
}

} // namespace

char process_state(int pid) {
  char state = 0;
  uint64_t start_time = 0;
  return read_stat(pid, state, start_time) ? state : 0;
}

std::string ProcessIdentity::to_record() const {
  std::ostringstream out;
  out << pid << " " << start_time << " " << machine << " " << host;
  return out.str();
}

ProcessIdentity ProcessIdentity::from_record(const std::string& record) {
  ProcessIdentity identity;
  std::istringstream in(record);
  if (!(in >> identity.pid >> identity.start_time >> identity.machine)) {
    return {};
  }
  in >> std::ws;
  std::getline(in, identity.host);
  return identity;
}

ProcessIdentity this_process() {
  static const std::string machine = first_line("/proc/sys/kernel/random/boot_id") +
      "/" + namespace_of("pid") + "/" + namespace_of("net");
  ProcessIdentity identity;
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  identity.host = name;
  identity.machine = machine;
  identity.pid = static_cast<int>(::getpid());
  char state = 0;
  read_stat(identity.pid, state, identity.start_time);
  return identity;
}

bool process_gone(const ProcessIdentity& process) {
  static const std::string here = this_process().machine;
  if (process.machine.empty() || process.machine != here) {
    return false;
  }
  if (::kill(process.pid, 0) != 0 && errno == ESRCH) {
    return true;
  }
  char state = 0;
  uint64_t start_time = 0;
  if (!read_stat(process.pid, state, start_time)) {
    return true;
  }
  return state == 'Z' || state == 'X' || start_time != process.start_time;
}

} // namespace lockstep::detail
