#include "support/multiprocess.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <thread>

#include <ATen/Context.h>
#include <gtest/gtest.h>

namespace lockstep::testing {
namespace {

// Every test process (ranks and references alike) convolves with ATen's
// own kernels, not oneDNN's. The AVX-512 convolutions of oneDNN in
// LibTorch 2.6 read memory they did not write: where the allocator hands
// back memory that held NaNs, a plain PyTorch 2.6 script of the tests' CNN
// gives NaN parameters in 126 of 200 runs (none with
// ONEDNN_MAX_CPU_ISA=AVX2 or oneDNN off; docs/troubleshooting.md). The
// tests compare lockstep with one process, and must not depend on what
// memory the allocator happens to reuse. (Linked into every test binary
// that launches ranks, through run_ranks; ctest also sets
// ONEDNN_MAX_CPU_ISA=AVX2 for the examples it runs.)
const bool kOneDnnConvolutionsOff = [] {
  at::globalContext().setUserEnabledMkldnn(false);
  return true;
}();

using Clock = std::chrono::steady_clock;

constexpr const char* kLaunchVariable = "LOCKSTEP_TEST_LAUNCH";
constexpr const char* kRankVariable = "LOCKSTEP_TEST_RANK";

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

std::string self_executable() {
  char self[4096] = {};
  ssize_t length = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  return length > 0 ? std::string(self, static_cast<size_t>(length)) : "/proc/self/exe";
}

std::string tail(const std::string& text, size_t limit) {
  if (text.size() <= limit) {
    return text;
  }
  return "[... " + std::to_string(text.size() - limit) + " bytes cut ...]\n" +
      text.substr(text.size() - limit);
}

} // namespace

std::string RankResult::status() const {
  return "rank " + std::to_string(rank) + ": " + ProcessExit::status();
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
          << tail(rank.output, rank.timed_out ? 40000 : 8000) << "\n"; // with its stacks
    }
  }
  return out.str();
}

bool in_rank_process() {
  return std::getenv(kRankVariable) != nullptr;
}

namespace {

int unused_port_from_kernel() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  bool found = fd >= 0 &&
      ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  if (fd >= 0) {
    ::close(fd);
  }
  if (!found) {
    throw std::runtime_error("cannot find a free port");
  }
  return ntohs(address.sin_port);
}

// True when no test process of this user took `port` in the last minutes.
// The kernel may hand a port that one test has just probed and released to
// another test running beside it (ctest -j), before the first one's rank 0
// binds it: the second test's ranks would then meet the first test's store.
// A file per port, created exclusively, records the claim.
bool claim_for_this_test(int port) {
  namespace fs = std::filesystem;
  fs::path folder = fs::temp_directory_path() /
      ("lockstep-test-ports-" + std::to_string(::getuid()));
  std::error_code ignored;
  fs::create_directories(folder, ignored);
  // Claims older than any test are swept once per process.
  static bool swept = false;
  for (fs::directory_iterator it(folder, ignored), end; !swept && !ignored && it != end;
       it.increment(ignored)) {
    auto written = fs::last_write_time(it->path(), ignored);
    if (!ignored && fs::file_time_type::clock::now() - written > std::chrono::minutes(10)) {
      fs::remove(it->path(), ignored);
    }
    ignored.clear();
  }
  swept = true;
  fs::path claim = folder / std::to_string(port);
  int fd = ::open(claim.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW, 0600);
  if (fd < 0) {
    return false;
  }
  ::close(fd);
  return true;
}

} // namespace

int free_port() {
  for (int attempt = 0; attempt < 100; ++attempt) {
    int port = unused_port_from_kernel();
    if (claim_for_this_test(port)) {
      return port;
    }
  }
  throw std::runtime_error("cannot find a port that no other test has just taken");
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
  std::vector<Process> children;
  auto start = Clock::now();
  std::string filter = "--gtest_filter=" + launch_id.substr(0, launch_id.rfind('#'));
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
    env[kLaunchVariable] = launch_id;
    env[kRankVariable] = std::to_string(rank);
    children.emplace_back(std::vector<std::string>{self_executable(), filter}, env);
  }
  auto deadline = start + options.timeout;
  auto running = [&] {
    bool any = false;
    for (auto& child : children) {
      any = !child.poll() || any;
    }
    return any;
  };
  while (running() && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (options.stacks_on_timeout) {
    // Past the limit, every rank still running stops where it is at once,
    // so that the stacks taken one by one below show where each waited.
    for (auto& child : children) {
      if (!child.poll()) {
        child.kill_group(SIGSTOP);
      }
    }
  }
  for (int rank = 0; rank < options.world_size; ++rank) {
    RankResult rank_result;
    static_cast<ProcessExit&>(rank_result) =
        children[rank].wait_until(deadline, options.stacks_on_timeout);
    rank_result.rank = rank;
    result.ranks.push_back(rank_result);
  }
  result.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
      Clock::now() - start);
  return result;
}

namespace {

void run_ranks_with(const LaunchOptions& options, const std::function<void(int rank)>& body) {
  auto result = launch_ranks(options, body);
  if (!result.ok()) {
    ADD_FAILURE() << "not every rank succeeded: " << result.report();
  } else if (std::getenv("LOCKSTEP_TEST_SHOW_RANKS") != nullptr && !in_rank_process()) {
    // By hand, to read what passing ranks printed (the composition table's
    // cells, say).
    for (const auto& rank : result.ranks) {
      std::cout << "---- output of rank " << rank.rank << " ----\n" << rank.output << "\n";
    }
  }
}

} // namespace

void run_ranks(
    int world_size,
    const std::function<void(int rank)>& body,
    std::chrono::milliseconds timeout) {
  LaunchOptions options;
  options.world_size = world_size;
  options.timeout = timeout;
  run_ranks_with(options, body);
}

std::string WorldSetup::name() const {
  return "world" + std::to_string(size) + (size == 1 ? "" : "_" + transport);
}

void PrintTo(const WorldSetup& setup, std::ostream* out) {
  *out << setup.name();
}

std::vector<WorldSetup> every_world_setup() {
  std::vector<WorldSetup> setups{{1, "auto"}};
  for (int size : {2, 3, 4}) {
    setups.push_back({size, "shm"});
    setups.push_back({size, "gloo"});
  }
  return setups;
}

std::vector<WorldSetup> two_and_three_rank_setups() {
  std::vector<WorldSetup> setups;
  for (const auto& setup : every_world_setup()) {
    if (setup.size == 2 || setup.size == 3) {
      setups.push_back(setup);
    }
  }
  return setups;
}

void run_ranks(
    const WorldSetup& setup,
    const std::function<void(int rank)>& body,
    std::chrono::milliseconds timeout) {
  LaunchOptions options;
  options.world_size = setup.size;
  options.timeout = timeout;
  options.environment = [transport = setup.transport](int, RankEnvironment& env) {
    env["LOCKSTEP_TRANSPORT"] = transport;
  };
  run_ranks_with(options, body);
}

} // namespace lockstep::testing
