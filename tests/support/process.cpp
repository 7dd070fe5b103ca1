#include "support/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace lockstep::testing {
namespace {

constexpr const char* kForeignPrefixes[] = {
    "OMPI_", "PMIX_", "SLURM_", "TORCHELASTIC_", "GROUP_", "ROLE_"};

bool foreign(const std::string& entry) {
  for (const char* prefix : kForeignPrefixes) {
    if (entry.rfind(prefix, 0) == 0) {
      return true;
    }
  }
  return false;
}

// Where a debugger is installed, every thread's stack of a process that
// ran past its limit goes into its log before it is killed: a hang that
// shows once in CI says where it waited. Bounded, and skipped without gdb.
void append_stacks(pid_t pid, const std::string& log_path) {
  if (::access("/usr/bin/gdb", X_OK) != 0) {
    return;
  }
  // Everything is prepared before fork (the parent has threads).
  const std::string target = std::to_string(pid);
  int log_fd = ::open(log_path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  pid_t debugger = ::fork();
  if (debugger == 0) {
    if (log_fd >= 0) {
      ::dup2(log_fd, STDOUT_FILENO);
      ::dup2(log_fd, STDERR_FILENO);
    }
    ::execl("/usr/bin/timeout", "timeout", "-s", "KILL", "20", "/usr/bin/gdb", "-batch", "-nx",
            "-p", target.c_str(), "-ex", "thread apply all bt", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  if (log_fd >= 0) {
    ::close(log_fd);
  }
  if (debugger > 0) {
    while (::waitpid(debugger, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
}

} // namespace

std::string ProcessExit::status() const {
  std::ostringstream out;
  if (timed_out) {
    out << "timed out (still running at the limit), killed";
  } else if (signal != 0) {
    out << "killed by signal " << signal << " (" << ::strsignal(signal) << ")";
  } else if (exit_code == 0) {
    out << "ok";
  } else {
    out << "exited with code " << exit_code;
  }
  return out.str();
}

Process::Process(const std::vector<std::string>& argv, const Environment& environment) {
  std::map<std::string, std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    std::string text = *entry;
    auto eq = text.find('=');
    if (eq != std::string::npos && !foreign(text)) {
      env[text.substr(0, eq)] = text.substr(eq + 1);
    }
  }
  for (const auto& [name, value] : environment) {
    if (value.empty()) {
      env.erase(name);
    } else {
      env[name] = value;
    }
  }
  // Everything is prepared before fork: between fork and exec only
  // async-signal-safe calls are allowed.
  std::vector<std::string> env_strings;
  for (const auto& [name, value] : env) {
    env_strings.push_back(name + "=" + value);
  }
  std::vector<char*> envp;
  for (auto& entry : env_strings) {
    envp.push_back(entry.data());
  }
  envp.push_back(nullptr);
  std::vector<std::string> args = argv;
  std::vector<char*> arg_pointers;
  for (auto& arg : args) {
    arg_pointers.push_back(arg.data());
  }
  arg_pointers.push_back(nullptr);

  char log_template[] = "/tmp/lockstep-process-XXXXXX";
  int log_fd = ::mkstemp(log_template);
  if (log_fd < 0) {
    throw std::runtime_error("cannot create a log file for a process");
  }
  log_path_ = log_template;
  pid_ = ::fork();
  if (pid_ < 0) {
    ::close(log_fd);
    throw std::runtime_error("fork failed");
  }
  if (pid_ == 0) {
    ::setpgid(0, 0);
    ::dup2(log_fd, STDOUT_FILENO);
    ::dup2(log_fd, STDERR_FILENO);
    int null_fd = ::open("/dev/null", O_RDONLY);
    if (null_fd >= 0) {
      ::dup2(null_fd, STDIN_FILENO);
    }
    ::execvpe(arg_pointers[0], arg_pointers.data(), envp.data());
    ::_exit(127);
  }
  ::setpgid(pid_, pid_); // also here: no race with a kill of the group
  ::close(log_fd);
  running_ = true;
}

Process::Process(Process&& other) noexcept
    : pid_(other.pid_),
      log_path_(std::move(other.log_path_)),
      running_(other.running_),
      exit_(std::move(other.exit_)) {
  other.running_ = false;
  other.log_path_.clear();
}

Process::~Process() {
  if (running_) {
    kill_group(SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  if (!log_path_.empty()) {
    ::unlink(log_path_.c_str());
  }
}

bool Process::poll() {
  if (!running_) {
    return true;
  }
  int status = 0;
  if (::waitpid(pid_, &status, WNOHANG) != pid_) {
    return false;
  }
  running_ = false;
  if (WIFEXITED(status)) {
    exit_.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    exit_.signal = WTERMSIG(status);
  }
  return true;
}

void Process::kill_group(int signo) {
  if (running_) {
    ::kill(-pid_, signo);
    ::kill(pid_, signo);
  }
}

ProcessExit Process::wait_until(std::chrono::steady_clock::time_point deadline, bool stacks) {
  while (!poll()) {
    if (std::chrono::steady_clock::now() >= deadline) {
      if (stacks) {
        kill_group(SIGSTOP); // what it started, too, stays where it is
        append_stacks(pid_, log_path_);
      }
      kill_group(SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      running_ = false;
      exit_.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  exit_.output = output();
  return exit_;
}

std::string Process::output() const {
  std::ifstream in(log_path_);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

ProcessExit run_process(
    const std::vector<std::string>& argv,
    const Environment& environment,
    std::chrono::milliseconds timeout) {
  Process process(argv, environment);
  return process.wait_until(std::chrono::steady_clock::now() + timeout);
}

} // namespace lockstep::testing
