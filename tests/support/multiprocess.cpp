#include "support/multiprocess.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

extern char** environ;

namespace lockstep::testing {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kLaunchVariable = "LOCKSTEP_TEST_LAUNCH";
constexpr const char* kRankVariable = "LOCKSTEP_TEST_RANK";

// Variables of other launchers that would change how a rank forms its world.
constexpr const char* kForeignPrefixes[] = {
    "OMPI_", "PMIX_", "SLURM_", "TORCHELASTIC_", "GROUP_", "ROLE_"};

std::string current_test_name() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (info == nullptr) {
    return "";
  }
  return std::string(info->test_suite_name()) + "." + info->name();
}

// Identifies one launch_ranks call: the test and how many calls it made
// before, so that a test may launch several times.
std::string next_launch_id() {
  static std::string test;
  static int calls = 0;
  std::string name = current_test_name();
  if (name != test) {
    test = name;
    calls = 0;
  }
  return name + "#" + std::to_string(calls++);
}

int count_failed_parts() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (info == nullptr) {
    return 0;
  }
  const auto* result = info->result();
  int failed = 0;
  for (int i = 0; i < result->total_part_count(); ++i) {
    failed += result->GetTestPartResult(i).failed() ? 1 : 0;
  }
  return failed;
}

[[noreturn]] void run_as_rank(const std::function<void(int)>& body, int rank) {
  int failed_before = count_failed_parts();
  int status = 0;
  try {
    body(rank);
  } catch (const std::exception& e) {
    std::cerr << "rank " << rank << ": uncaught exception: " << e.what()
              << std::endl;
    status = 1;
  } catch (...) {
    std::cerr << "rank " << rank << ": uncaught non-standard exception"
              << std::endl;
    status = 1;
  }
  if (count_failed_parts() > failed_before) {
    status = 1;
  }
  std::cout.flush();
  std::cerr.flush();
  // Leave at once: the rest of the test body belongs to the parent, and
  // static destructors of LibTorch's thread pools are not needed here.
  std::_Exit(status);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string tail(const std::string& text, size_t limit) {
  if (text.size() <= limit) {
    return text;
  }
  return "[... " + std::to_string(text.size() - limit) + " bytes cut ...]\n" +
      text.substr(text.size() - limit);
}

bool foreign(const std::string& entry) {
  for (const char* prefix : kForeignPrefixes) {
    if (entry.rfind(prefix, 0) == 0) {
      return true;
    }
  }
  return false;
}

struct Child {
  pid_t pid = -1;
  std::string log_path;
  bool running = false;
};

Child spawn_rank(
    const std::string& launch_id,
    int rank,
    const RankEnvironment& overrides) {
  std::map<std::string, std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    std::string text = *entry;
    auto eq = text.find('=');
    if (eq != std::string::npos && !foreign(text)) {
      env[text.substr(0, eq)] = text.substr(eq + 1);
    }
  }
  for (const auto& [name, value] : overrides) {
    if (value.empty()) {
      env.erase(name);
    } else {
      env[name] = value;
    }
  }
  env[kLaunchVariable] = launch_id;
  env[kRankVariable] = std::to_string(rank);

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
  std::string filter = "--gtest_filter=" + launch_id.substr(0, launch_id.rfind('#'));
  std::string exe = "/proc/self/exe";
  char self[4096] = {};
  ssize_t length = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (length > 0) {
    exe.assign(self, static_cast<size_t>(length));
  }
  std::vector<char*> argv{exe.data(), filter.data(), nullptr};

  char log_template[] = "/tmp/lockstep-rank-XXXXXX";
  int log_fd = ::mkstemp(log_template);
  if (log_fd < 0) {
    throw std::runtime_error("cannot create a log file for a rank");
  }
  Child child;
  child.log_path = log_template;
  child.pid = ::fork();
  if (child.pid < 0) {
    ::close(log_fd);
    throw std::runtime_error("fork failed");
  }
  if (child.pid == 0) {
    ::setpgid(0, 0);
    ::dup2(log_fd, STDOUT_FILENO);
    ::dup2(log_fd, STDERR_FILENO);
    int null_fd = ::open("/dev/null", O_RDONLY);
    if (null_fd >= 0) {
      ::dup2(null_fd, STDIN_FILENO);
    }
    ::execve(exe.c_str(), argv.data(), envp.data());
    ::_exit(127);
  }
  ::setpgid(child.pid, child.pid); // also here: no race with the kill below
  ::close(log_fd);
  child.running = true;
  return child;
}

} // namespace

std::string RankResult::status() const {
  std::ostringstream out;
  out << "rank " << rank << ": ";
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

bool LaunchResult::ok() const {
  for (const auto& rank : ranks) {
    if (!rank.ok()) {
      return false;
    }
  }
  return true;
}

bool LaunchResult::timed_out() const {
  for (const auto& rank : ranks) {
    if (rank.timed_out) {
      return true;
    }
  }
  return false;
}

std::string LaunchResult::report() const {
  std::ostringstream out;
  out << ranks.size() << " rank(s), " << elapsed.count() << " ms\n";
  for (const auto& rank : ranks) {
    out << "  " << rank.status() << "\n";
  }
  for (const auto& rank : ranks) {
    if (!rank.ok()) {
      out << "---- output of rank " << rank.rank << " ----\n"
          << tail(rank.output, 8000) << "\n";
    }
  }
  return out.str();
}

bool in_rank_process() {
  return std::getenv(kRankVariable) != nullptr;
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  if (fd < 0 ||
      ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    throw std::runtime_error("cannot find a free port");
  }
  ::close(fd);
  return ntohs(address.sin_port);
}

LaunchResult launch_ranks(
    const LaunchOptions& options,
    const std::function<void(int rank)>& body) {
  std::string launch_id = next_launch_id();
  if (const char* active = std::getenv(kLaunchVariable)) {
    if (launch_id == active) {
      run_as_rank(body, std::atoi(std::getenv(kRankVariable)));
    }
    // Another launch of the same test: not this rank's part.
    return LaunchResult{};
  }

  LaunchResult result;
  result.master_port = free_port();
  std::vector<Child> children;
  auto start = Clock::now();
  for (int rank = 0; rank < options.world_size; ++rank) {
    RankEnvironment env{
        {"RANK", std::to_string(rank)},
        {"WORLD_SIZE", std::to_string(options.world_size)},
        {"LOCAL_RANK", std::to_string(rank)},
        {"LOCAL_WORLD_SIZE", std::to_string(options.world_size)},
        {"MASTER_ADDR", "127.0.0.1"},
        {"MASTER_PORT", std::to_string(result.master_port)},
        {"OMP_NUM_THREADS", "1"},
    };
    if (options.environment) {
      options.environment(rank, env);
    }
    children.push_back(spawn_rank(launch_id, rank, env));
    RankResult rank_result;
    rank_result.rank = rank;
    result.ranks.push_back(rank_result);
  }

  auto deadline = start + options.timeout;
  int running = options.world_size;
  while (running > 0) {
    for (int rank = 0; rank < options.world_size; ++rank) {
      auto& child = children[rank];
      if (!child.running) {
        continue;
      }
      int status = 0;
      if (::waitpid(child.pid, &status, WNOHANG) == child.pid) {
        child.running = false;
        --running;
        if (WIFEXITED(status)) {
          result.ranks[rank].exit_code = WEXITSTATUS(status);
        } else if (WIFSIGNALED(status)) {
          result.ranks[rank].signal = WTERMSIG(status);
        }
      }
    }
    if (running > 0 && Clock::now() >= deadline) {
      for (int rank = 0; rank < options.world_size; ++rank) {
        auto& child = children[rank];
        if (child.running) {
          ::kill(-child.pid, SIGKILL);
          ::kill(child.pid, SIGKILL);
          ::waitpid(child.pid, nullptr, 0);
          child.running = false;
          result.ranks[rank].timed_out = true;
        }
      }
      running = 0;
    }
    if (running > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  result.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
      Clock::now() - start);
  for (int rank = 0; rank < options.world_size; ++rank) {
    result.ranks[rank].output = read_file(children[rank].log_path);
    ::unlink(children[rank].log_path.c_str());
  }
  return result;
}

void run_ranks(
    int world_size,
    const std::function<void(int rank)>& body,
    std::chrono::milliseconds timeout) {
  LaunchOptions options;
  options.world_size = world_size;
  options.timeout = timeout;
  auto result = launch_ranks(options, body);
  if (!result.ok()) {
    ADD_FAILURE() << "not every rank succeeded: " << result.report();
  }
}

} // namespace lockstep::testing
