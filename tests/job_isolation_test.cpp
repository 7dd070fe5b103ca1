// Who can reach a job, and what it leaves behind. A job on one host opens no
// socket another machine could reach and leaves nothing in the file system;
// across hosts, the TCP store tells a job from another one given the same
// address and port, and a job secret keeps out processes that lack it; the
// store survives garbage sent to it while the job trains.

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/torch.h>

#include <lockstep/lockstep.h>

#include "compat/c10d.h"
#include "store/client.h"
#include "support/expect_error.h"
#include "support/models.h"
#include "support/multiprocess.h"
#include "support/scratch_folder.h"
#include "support/training.h"
#include "world/rendezvous.h"
#include "world/resolve.h"

namespace lockstep::testing {
namespace {

using Clock = std::chrono::steady_clock;

struct Listener {
  std::string address; // as in /proc/net/tcp: hex, network order per word
  bool loopback = false;
};

// The listening TCP sockets of this process, from /proc/net/tcp{,6} and
// the socket inodes among its file descriptors.
std::vector<Listener> own_listeners() {
  std::set<std::string> inodes;
  DIR* dir = ::opendir("/proc/self/fd");
  while (dirent* entry = ::readdir(dir)) {
    char target[256] = {};
    std::string path = std::string("/proc/self/fd/") + entry->d_name;
    std::string link(target, std::max<ssize_t>(0, ::readlink(path.c_str(), target, 255)));
    if (link.rfind("socket:[", 0) == 0) {
      inodes.insert(link.substr(8, link.size() - 9));
    }
  }
  ::closedir(dir);
  std::vector<Listener> listeners;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line); // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
          timeout >> inode;
      if (state != "0A" || inodes.count(inode) == 0) {
        continue; // not listening, or not ours
      }
      std::string address = local.substr(0, local.find(':'));
      // 127.0.0.0/8 (its first byte is the last pair in /proc's order),
      // ::1, and ::ffff:127.x.
      bool loopback = (address.size() == 8 && address.substr(6) == "7F") ||
          address == "00000000000000000000000001000000" ||
          (address.size() == 32 && address.substr(16, 8) == "FFFF0000" &&
           address.substr(30) == "7F");
      listeners.push_back({address, loopback});
    }
  }
  return listeners;
}

TEST(JobIsolation, AJobOnOneHostListensOnLoopbackOnly) {
  auto result = launch_ranks({}, [](int rank) {
    World world = init();
    auto tensor = torch::ones({8});
    world.all_reduce(tensor);
    auto listeners = own_listeners();
    if (rank == 0) {
      EXPECT_FALSE(listeners.empty()) << "rank 0 holds MASTER_PORT on loopback; found no socket";
    }
    for (const auto& listener : listeners) {
      EXPECT_TRUE(listener.loopback) << "listening on " << listener.address;
    }
    world.barrier();
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST(JobIsolation, TheTcpStoreListensOnEveryInterface) {
  // What LOCKSTEP_STORE=tcp (and any job across hosts) exposes: rank 0's
  // store on every interface, as docs/world.md#security says.
  LaunchOptions options;
  options.environment = [](int, RankEnvironment& env) { env["LOCKSTEP_STORE"] = "tcp"; };
  auto result = launch_ranks(options, [](int rank) {
    World world = init();
    bool exposed = false;
    for (const auto& listener : own_listeners()) {
      exposed |= !listener.loopback;
    }
    EXPECT_EQ(exposed, rank == 0);
    world.barrier();
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST(JobIsolation, AJobOnOneHostLeavesNothingBehind) {
  ScratchFolder tmp("isolation");
  LaunchOptions options;
  options.world_size = 3;
  options.environment = [&](int, RankEnvironment& env) { env["TMPDIR"] = tmp.path(); };
  auto result = launch_ranks(options, [](int) {
    World world = init();
    world.barrier();
  });
  ASSERT_TRUE(result.ok()) << result.report();
  std::string folder = tmp / ("lockstep-" + std::to_string(::getuid()));
  DIR* dir = ::opendir(folder.c_str());
  ASSERT_NE(dir, nullptr) << folder << " was never created";
  std::vector<std::string> left;
  while (dirent* entry = ::readdir(dir)) {
    std::string name = entry->d_name;
    if (name != "." && name != "..") {
      left.push_back(name);
    }
  }
  ::closedir(dir);
  EXPECT_TRUE(left.empty()) << "left in " << folder << ": " << left.front();
}

// A job of two (harness ranks 0 and 1) on the TCP store, and one stranger
// (harness rank 2) that claims rank 1 of the same address and port with
// `stranger_env`. The stranger must be refused with `refusal`; the job
// must go on and finish.
void expect_stranger_refused(
    const std::function<void(RankEnvironment&)>& job_env,
    const std::function<void(RankEnvironment&)>& stranger_env,
    const std::string& refusal,
    const std::string& store = "tcp") {
  ScratchFolder folder("stranger");
  LaunchOptions options;
  options.world_size = 3;
  options.environment = [&](int rank, RankEnvironment& env) {
    env["LOCKSTEP_STORE"] = store;
    env["LOCKSTEP_TIMEOUT"] = "20";
    env["WORLD_SIZE"] = "2";
    env["LOCAL_WORLD_SIZE"] = "2";
    env["LOCKSTEP_JOB_ID"] = "job-a";
    env["LOCKSTEP_TEST_FOLDER"] = folder.path();
    env["LOCKSTEP_REFUSAL"] = refusal;
    if (rank == 2) {
      env["RANK"] = "1";
      env["LOCAL_RANK"] = "1";
      stranger_env(env);
    } else {
      job_env(env);
    }
  };
  auto result = launch_ranks(options, [](int rank) {
    std::string marker = std::string(std::getenv("LOCKSTEP_TEST_FOLDER")) + "/refused";
    if (rank == 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300)); // the job forms first
      expect_error<RendezvousError>([] { init(); }, {std::getenv("LOCKSTEP_REFUSAL")});
      std::ofstream(marker) << "done";
      return;
    }
    World world = init();
    // The job outlives the stranger's attempt, and still works after it.
    auto deadline = Clock::now() + std::chrono::seconds(15);
    while (!std::ifstream(marker) && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    auto tensor = torch::full({4}, rank + 1.0);
    world.all_reduce(tensor);
    EXPECT_TRUE(tensor.eq(3).all().item<bool>());
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST(JobIsolation, AnotherJobOnTheSamePortIsRefused) {
  expect_stranger_refused(
      [](RankEnvironment&) {}, [](RankEnvironment& env) { env["LOCKSTEP_JOB_ID"] = "job-b"; },
      "rank 1 was refused: the store at 127.0.0.1:");
  expect_stranger_refused(
      [](RankEnvironment&) {}, [](RankEnvironment& env) { env["LOCKSTEP_JOB_ID"] = "job-b"; },
      "belongs to job 'job-a', not to this job 'job-b' (LOCKSTEP_JOB_ID). Two jobs were given "
      "the same MASTER_ADDR and MASTER_PORT: give each its own port. The other job goes on.");
}

TEST(JobIsolation, AnotherJobOnTheSamePortIsRefusedOnOneHostToo) {
  // The file store of a job on one host: a stranger that joined would, on
  // closing, mark the live job's folder closed.
  expect_stranger_refused(
      [](RankEnvironment&) {}, [](RankEnvironment& env) { env["LOCKSTEP_JOB_ID"] = "job-b"; },
      "is 'job-a', not this job 'job-b' (LOCKSTEP_JOB_ID). Two jobs were given the same "
      "MASTER_PORT: give each its own port. The other job goes on.",
      "file");
}

// A proof names the keys of the world it was made for: whoever can write
// to the store cannot copy a rank's proven record into another world's
// rendezvous, whether another attempt's (torchrun's store outlives a
// restart, and with it the job's nonce) or another epoch's of a
// fault-tolerant job (whose worlds meet in one store under keys of their
// own).
TEST(JobIsolation, AProofFromAnotherWorldIsRefused) {
  const std::string nonce = "the-job-nonce";
  for (auto [earlier, later] : {std::pair<std::string, std::string>{"lockstep/job/0",
                                                                     "lockstep/job/1"},
                                {"lockstep/job/0/e1/world", "lockstep/job/0/e2/world"}}) {
    SCOPED_TRACE(earlier + " -> " + later);
    auto store = c10::make_intrusive<c10d::HashStore>();
    auto config_for = [](int rank, const std::string& prefix) {
      detail::WorldConfig config;
      config.rank = rank;
      config.size = 2;
      config.job_id = "job";
      config.secret = "s3cret";
      config.key_prefix = prefix;
      config.timeout = std::chrono::seconds(2);
      config.master_addr = "127.0.0.1";
      config.master_port = 29999;
      return config;
    };
    auto scoped = [&](const std::string& prefix) {
      return c10::make_intrusive<c10d::PrefixStore>(prefix, store);
    };
    std::thread rank_one([&] { detail::join(scoped(earlier), config_for(1, earlier), nonce); });
    detail::join(scoped(earlier), config_for(0, earlier), nonce);
    rank_one.join();
    for (const char* key : {"rank/1", "proof/1"}) {
      store->set(later + "/" + key, store->get(earlier + "/" + key));
    }
    expect_error<RendezvousError>([&] { detail::join(scoped(later), config_for(0, later), nonce); },
                                  {"the process that joined as rank 1 did not prove that it "
                                   "holds the job secret"});
  }
}

TEST(JobIsolation, AProcessWithoutTheSecretIsRefused) {
  auto with_secret = [](RankEnvironment& env) { env["LOCKSTEP_JOB_SECRET"] = "s3cret"; };
  expect_stranger_refused(with_secret, [](RankEnvironment&) {},
                          "rank 1 was refused: the job at 127.0.0.1:");
  expect_stranger_refused(with_secret, [](RankEnvironment&) {},
                          " requires a job secret, and this rank has none. Start every rank "
                          "with the same LOCKSTEP_JOB_SECRET (or WorldOptions::secret).");
}

TEST(JobIsolation, AProcessWithAnotherSecretIsRefused) {
  expect_stranger_refused(
      [](RankEnvironment& env) { env["LOCKSTEP_JOB_SECRET"] = "s3cret"; },
      [](RankEnvironment& env) { env["LOCKSTEP_JOB_SECRET"] = "guess"; },
      " holds another job secret than this rank's. Start every rank with the same "
      "LOCKSTEP_JOB_SECRET.");
}

TEST(JobIsolation, AProcessWithASecretRefusesAJobWithout) {
  expect_stranger_refused(
      [](RankEnvironment&) {},
      [](RankEnvironment& env) { env["LOCKSTEP_JOB_SECRET"] = "s3cret"; },
      " has no job secret, and this rank has one. Start every rank with the same "
      "LOCKSTEP_JOB_SECRET, or none.");
}

// A client of the job's TCP store, as any process on the network could be,
// proving `secret` ("" for none) on connecting.
std::unique_ptr<store::StoreClient> store_client(int port, const std::string& secret = "") {
  auto endpoint = store::Endpoint::tcp("127.0.0.1", port);
  endpoint.secret = secret;
  return std::make_unique<store::StoreClient>(endpoint, std::chrono::seconds(10));
}

TEST(JobIsolation, RanksWithTheSecretTrainAndTheSecretStaysOffTheWire) {
  LaunchOptions options;
  options.world_size = 3;
  options.environment = [](int, RankEnvironment& env) {
    env["LOCKSTEP_STORE"] = "tcp";
    env["LOCKSTEP_JOB_SECRET"] = "s3cret-never-sent";
  };
  auto result = launch_ranks(options, [](int) {
    World world = init();
    train_side_by_side<Mlp>(world, [] { return Mlp(); }, DdpOptions(), SideBySide(), plain_forward);
    int port = std::atoi(std::getenv("MASTER_PORT"));
    std::string record = store_client(port, "s3cret-never-sent")
                             ->wait_get("lockstep/job", std::chrono::seconds(10))
                             .value_or("");
    EXPECT_EQ(record.find("s3cret"), std::string::npos) << record;
    EXPECT_EQ(record.rfind("default ", 0), 0u) << record;
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

// Where the store has the job's secret, a process that reaches it without
// the secret (or with another) is refused every operation but a ping:
// it reads nothing, writes nothing (a forged rank record among them),
// deletes nothing, and can neither say hello for a slot nor report one
// failed; the job is not disturbed. (A store started without the secret,
// by a launcher that was not given it, leaves the ranks' own proofs:
// JobIsolation.AProofFromAnotherWorldIsRefused and the others.)
TEST(JobIsolation, AProcessWithoutTheSecretCanDoNothingAtTheStore) {
  LaunchOptions options;
  options.world_size = 2;
  options.environment = [](int, RankEnvironment& env) {
    env["LOCKSTEP_STORE"] = "tcp";
    env["LOCKSTEP_JOB_SECRET"] = "s3cret";
  };
  auto result = launch_ranks(options, [](int) {
    World world = init();
    int port = std::atoi(std::getenv("MASTER_PORT"));
    if (world.rank() == 1) {
      auto stranger = store_client(port);
      EXPECT_EQ(stranger->ping(), "lockstep-store 1");
      EXPECT_THROW(stranger->get("lockstep/job"), store::UnprovenError);
      EXPECT_THROW(stranger->set("lockstep/default/0/rank/1", "1 1 forged"),
                   store::UnprovenError);
      EXPECT_THROW(stranger->erase_prefix("lockstep/"), store::UnprovenError);
      EXPECT_THROW(stranger->hello(0, 1000000, std::chrono::seconds(1), "forged"),
                   store::UnprovenError);
      EXPECT_THROW(stranger->report(0, 0, "forged"), store::UnprovenError);
      EXPECT_THROW(stranger->goodbye(0, 0, 0), store::UnprovenError);
      EXPECT_THROW(store_client(port, "guess"), store::UnprovenError);
      // The job's record is still there, for a client that proves the secret.
      EXPECT_TRUE(store_client(port, "s3cret")->get("lockstep/job").has_value());
    }
    world.barrier();
    auto sum = torch::ones({4});
    world.all_reduce(sum);
    EXPECT_TRUE(sum.equal(torch::full({4}, 2.0)));
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

// Throws at the store what a port scanner or a confused client might:
// random bytes, a length prefix of 2^62, idle connections, connections
// closed at once. Until `stop`.
void pester(int port, const std::atomic<bool>& stop, int& attempts) {
  std::mt19937 random(7);
  std::vector<int> idle;
  for (int round = 0; !stop; ++round) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(static_cast<uint16_t>(port));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
      ::close(fd);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      continue;
    }
    ++attempts;
    if (round % 4 == 0) {
      char noise[64];
      for (char& c : noise) {
        c = static_cast<char>(random());
      }
      (void)!::send(fd, noise, sizeof(noise), MSG_NOSIGNAL);
    } else if (round % 4 == 1) {
      unsigned char query = 0; // "set", then a key of 2^62 bytes
      uint64_t length = uint64_t{1} << 62;
      (void)!::send(fd, &query, 1, MSG_NOSIGNAL);
      (void)!::send(fd, &length, sizeof(length), MSG_NOSIGNAL);
    } else if (round % 4 == 2 && idle.size() < 200) {
      idle.push_back(fd);
      continue;
    }
    ::close(fd);
  }
  for (int fd : idle) {
    ::close(fd);
  }
}

TEST(JobIsolation, TheTcpStoreSurvivesGarbageDuringRendezvousAndTraining) {
  int port = free_port();
  std::atomic<bool> stop{false};
  int attempts = 0;
  std::thread pest;
  if (!in_rank_process()) {
    pest = std::thread([&] { pester(port, stop, attempts); });
  }
  LaunchOptions options;
  options.world_size = 2;
  options.timeout = std::chrono::seconds(120);
  options.environment = [port](int, RankEnvironment& env) {
    env["LOCKSTEP_STORE"] = "tcp";
    env["MASTER_PORT"] = std::to_string(port);
  };
  auto result = launch_ranks(options, [](int) {
    World world = init();
    SideBySide setup;
    setup.steps = 20;
    train_side_by_side<Mlp>(world, [] { return Mlp(); }, DdpOptions(), setup, plain_forward);
  });
  if (in_rank_process()) {
    return;
  }
  stop = true;
  pest.join();
  EXPECT_TRUE(result.ok()) << result.report();
  EXPECT_GT(attempts, 500) << "the store was hardly pestered";
}

} // namespace
} // namespace lockstep::testing
