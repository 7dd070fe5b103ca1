// Every way forming a world can fail, each with the error the user reads and
// a bound on how long it takes: an error within the timeout, never a hang.

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <lockstep/lockstep.h>

#include "support/expect_error.h"
#include "support/multiprocess.h"

namespace lockstep {
namespace {

using testing::expect_error;
using testing::LaunchOptions;
using testing::LaunchResult;
using testing::RankEnvironment;
using testing::launch_ranks;
using Clock = std::chrono::steady_clock;

// A listening TCP socket on every address, held by the test process: some
// other service on the port that the job was told to use.
class ForeignListener {
 public:
  explicit ForeignListener(bool accept_and_stay_silent) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t length = sizeof(address);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&address), length), 0);
    EXPECT_EQ(::listen(fd_, 16), 0);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    if (accept_and_stay_silent) {
      acceptor_ = std::thread([this] {
        while (!stop_) {
          int client = ::accept(fd_, nullptr, nullptr);
          if (client >= 0) {
            accepted_.push_back(client);
          }
        }
      });
    }
  }
  ~ForeignListener() {
    stop_ = true;
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    if (acceptor_.joinable()) {
      acceptor_.join();
    }
    for (int client : accepted_) {
      ::close(client);
    }
  }
  int port() const {
    return port_;
  }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
  std::vector<int> accepted_;
};

// Launches ranks that each expect init() to raise `ErrorType` with
// `fragments`; `rank_env` adapts each rank's variables.
template <typename ErrorType>
LaunchResult expect_init_error(
    int world_size,
    const std::function<void(int, RankEnvironment&)>& rank_env,
    std::vector<std::string> fragments,
    const std::function<bool(int)>& joins = [](int) { return true; }) {
  LaunchOptions options;
  options.world_size = world_size;
  options.timeout = std::chrono::seconds(60);
  options.environment = [&](int rank, RankEnvironment& env) {
    env["LOCKSTEP_TIMEOUT"] = "2";
    rank_env(rank, env);
    for (size_t i = 0; i < fragments.size(); ++i) {
      std::string fragment = fragments[i];
      for (auto at = fragment.find("{port}"); at != std::string::npos;
           at = fragment.find("{port}")) {
        fragment.replace(at, 6, env["MASTER_PORT"]);
      }
      env["LOCKSTEP_EXPECT_" + std::to_string(i)] = fragment;
    }
  };
  auto result = launch_ranks(options, [&](int rank) {
    if (!joins(rank)) {
      return;
    }
    auto start = Clock::now();
    std::string message;
    try {
      init();
      ADD_FAILURE() << "init() succeeded on rank " << rank;
    } catch (const ErrorType& e) {
      message = e.what();
    }
    for (int i = 0; const char* fragment = std::getenv(
                        ("LOCKSTEP_EXPECT_" + std::to_string(i)).c_str());
         ++i) {
      EXPECT_NE(message.find(fragment), std::string::npos)
          << "rank " << rank << ": the message lacks '" << fragment << "':\n"
          << message;
    }
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(10))
        << "the error took longer than the 2 s timeout allows";
    std::cout << "rank " << rank << " got: " << message << std::endl;
  });
  EXPECT_TRUE(result.ok()) << result.report();
  return result;
}

TEST(WorldErrors, PortTakenByAnotherService) {
  ForeignListener listener(/*accept_and_stay_silent=*/false);
  int port = listener.port();
  // The TCP store would listen on the port; the file store of a job on one
  // host holds it on loopback, so that two jobs given one port collide too.
  for (const char* store : {"tcp", "file"}) {
    SCOPED_TRACE(store);
    expect_init_error<RendezvousError>(
        1,
        [port, store](int, RankEnvironment& env) {
          env["RANK"] = "0";
          env["WORLD_SIZE"] = "2";
          env["MASTER_PORT"] = std::to_string(port);
          env["LOCKSTEP_STORE"] = store;
        },
        {"rank 0 cannot host the store on MASTER_PORT={port}",
         "already in use", "Choose a free MASTER_PORT"});
  }
}

TEST(WorldErrors, MasterThatNeverComesUp) {
  expect_init_error<RendezvousError>(
      1,
      [](int, RankEnvironment& env) {
        env["RANK"] = "1";
        env["WORLD_SIZE"] = "2";
        env["LOCKSTEP_STORE"] = "tcp";
      },
      {"rank 1 could not reach the store at 127.0.0.1:{port}",
       "within 2 s", "LOCKSTEP_TIMEOUT"});
}

TEST(WorldErrors, RankZeroThatNeverComesUpOnThisHost) {
  expect_init_error<RendezvousError>(
      1,
      [](int, RankEnvironment& env) {
        env["RANK"] = "1";
        env["WORLD_SIZE"] = "2";
      },
      {"rank 1 found no job on this host at MASTER_PORT={port} within 2 s (its store would "
       "be ", "/port-{port}). Is rank 0 running, on this host, with the same MASTER_PORT and "
       "TMPDIR? Raise the limit with LOCKSTEP_TIMEOUT (seconds)."});
}

TEST(WorldErrors, ServiceThatIsNotAStore) {
  ForeignListener listener(/*accept_and_stay_silent=*/true);
  int port = listener.port();
  expect_init_error<RendezvousError>(
      1,
      [port](int, RankEnvironment& env) {
        env["RANK"] = "1";
        env["WORLD_SIZE"] = "2";
        env["MASTER_PORT"] = std::to_string(port);
        env["LOCKSTEP_STORE"] = "tcp";
      },
      {"127.0.0.1:{port}", "does not answer as a lockstep job store"});
}

TEST(WorldErrors, MasterAddressThatDoesNotResolveFailsAtOnce) {
  // Across hosts (a local size of 1), so that the address matters.
  expect_init_error<RendezvousError>(
      2,
      [](int, RankEnvironment& env) {
        env["LOCKSTEP_TIMEOUT"] = "60";
        env["LOCAL_WORLD_SIZE"] = "1";
        env["LOCAL_RANK"] = "0";
        env["MASTER_ADDR"] = "nonexistent.invalid";
      },
      {"MASTER_ADDR='nonexistent.invalid' does not resolve to an address (",
       "). Set it to rank 0's host name or address, as every rank can resolve it (127.0.0.1 "
       "on one machine)."});
}

TEST(WorldErrors, ManyMissingRanksAreARange) {
  expect_init_error<RendezvousError>(
      1, [](int, RankEnvironment& env) { env["WORLD_SIZE"] = "3000"; },
      {"rank(s) 1–2999 of 3000 never joined (joined: 0)"});
}

TEST(WorldErrors, RankThatNeverJoins) {
  auto result = expect_init_error<RendezvousError>(
      3, [](int, RankEnvironment&) {},
      {"rendezvous at 127.0.0.1:{port} timed out after 2 s",
       "rank(s) 2 of 3 never joined (joined: 0, 1)"},
      [](int rank) { return rank != 2; });
  EXPECT_NE(result.ranks[1].output.find("never joined"), std::string::npos);
}

TEST(WorldErrors, RanksThatDisagreeOnTheWorldSize) {
  expect_init_error<RendezvousError>(
      2,
      [](int rank, RankEnvironment& env) {
        env["WORLD_SIZE"] = rank == 0 ? "2" : "3";
      },
      {"was started with world size", "but another rank with world size",
       "Start every rank with the same WORLD_SIZE"});
}

TEST(WorldErrors, BadVariablesRaiseBeforeAnySocket) {
  expect_init_error<ConfigError>(
      1,
      [](int, RankEnvironment& env) {
        env["RANK"] = "2";
        env["WORLD_SIZE"] = "2";
      },
      {"RANK=2 is out of range for WORLD_SIZE=2"});
}

// Rank 1 stays alive but never joins rank 0's all-reduce; rank 0 must
// raise within the 2 s limit with `expected`.
void expect_missing_peer_error(const std::string& debug, const std::string& expected) {
  LaunchOptions options;
  options.environment = [debug](int, RankEnvironment& env) {
    env["LOCKSTEP_TIMEOUT"] = "2";
    env["LOCKSTEP_DEBUG"] = debug;
  };
  auto result = launch_ranks(options, [expected](int rank) {
    World world = init();
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(6));
      return;
    }
    auto tensor = at::ones({16});
    auto start = Clock::now();
    expect_error<TimeoutError>([&] { world.all_reduce(tensor); }, {expected});
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST(WorldErrors, CollectiveWithAMissingPeerTimesOut) {
  expect_missing_peer_error(
      "OFF",
      "rank 0: all_reduce of Float [16] #1 did not complete within 2 s: rank(s) 1 never "
      "reached it (reached: 0). A rank that stopped, or runs a different collective, leaves "
      "the others waiting; raise the limit with LOCKSTEP_TIMEOUT (seconds) if it is only slow.");
}

TEST(WorldErrors, UnderDetailAMissingPeerIsNamedBeforeTheCollectiveStarts) {
  expect_missing_peer_error(
      "DETAIL",
      "rank 0: collective #1 (all_reduce of Float [16]) never started: rank(s) 1 never "
      "reached it (reached: 0) within 2 s. A rank that skips a forward or a backward the "
      "others run leaves them waiting.");
}

TEST(WorldErrors, CollectiveWithAPeerThatExited) {
  LaunchOptions options;
  options.world_size = 2;
  auto result = launch_ranks(options, [](int rank) {
    World world = init();
    world.barrier();
    if (rank == 1) {
      std::_Exit(0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto tensor = at::ones({16});
    expect_error<CollectiveError>(
        [&] { world.all_reduce(tensor); },
        {"rank 0: all_reduce of Float [16] #2 cannot complete: rank 1 (pid ",
         ") exited without closing its world (a crash, a kill, or an exit before the end); its "
         "own output says why."});
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

} // namespace
} // namespace lockstep
