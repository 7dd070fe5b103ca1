#include "world/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <lockstep/error.h>

#include "world/torch_compat.h"

namespace lockstep::detail {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<uint8_t> bytes(const std::string& text) {
  return {text.begin(), text.end()};
}

std::string text(const std::vector<uint8_t>& value) {
  return {value.begin(), value.end()};
}


std::string hostname() {
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  return name;
}


c10::intrusive_ptr<c10d::Store> connect_tcp_store(const WorldConfig& config) {
  bool host_here = config.rank == 0 && !config.agent_store;
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(config.master_port);
  options.isServer = host_here;
  options.waitWorkers = false;
  options.timeout = config.timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(config.master_addr, options);
  } catch (const std::exception& e) {
    std::string cause = describe_exception(e);
    if (host_here && cause.find("already in use") != std::string::npos) {
      LOCKSTEP_FAIL(
          RendezvousError, "rank 0 cannot host the store on MASTER_PORT=",
          config.master_port, ": the port is already in use by another "
          "process. Choose a free MASTER_PORT (lockstep-run picks one "
          "itself) or stop the process that holds it.\n  cause: ", cause);
    }
    if (host_here) {
      LOCKSTEP_FAIL(
          RendezvousError, "rank 0 cannot host the store at ",
          master_endpoint(config), ".\n  cause: ", cause);
    }
    LOCKSTEP_FAIL(
        RendezvousError, "rank ", config.rank,
        " could not reach the store at ", master_endpoint(config),
        " (MASTER_ADDR:MASTER_PORT) within ", seconds(config.timeout),
        ". Is rank 0 ", config.agent_store ? "(torchrun's agent) " : "",
        "running, and do all ranks use the same MASTER_ADDR and "
        "MASTER_PORT? Raise the limit with LOCKSTEP_TIMEOUT (seconds).\n"
        "  cause: ", cause);
  }
}

std::string rank_key(int rank) {
  return "rank/" + std::to_string(rank);
}

// Every rank writes the size it believes in; the first writer wins and a
// rank that disagrees learns whose value differs. Returns the problem, if any.
std::string disagreement_on_size(c10d::Store& store, const WorldConfig& config) {
  std::string mine = str(config.size, " (rank ", config.rank, ")");
  std::string first = text(store.compareSet("size", {}, bytes(mine)));
  if (first.empty() || first == mine || std::stoi(first) == config.size) {
    return "";
  }
  return str("lockstep: rank ", config.rank, " was started with world size ",
             config.size, " but another rank with world size ", first,
             ". Start every rank with the same WORLD_SIZE.");
}

std::string duplicate_rank(c10d::Store& store, const WorldConfig& config) {
  if (store.add("claims/" + rank_key(config.rank), 1) == 1) {
    return "";
  }
  return str("lockstep: rank ", config.rank,
             " joined the job twice: two processes were started with RANK=",
             config.rank, ". Give every process its own rank.");
}

// The first store operation runs on a thread of its own: a peer that
// accepts connections but is not a store never answers, and TCPStore's
// client would wait for that answer forever. On timeout the thread is left
// behind, blocked, holding its own reference to the store.
void expect_store_answers(
    const c10::intrusive_ptr<c10d::Store>& store,
    const WorldConfig& config) {
  auto answered = std::make_shared<std::promise<void>>();
  auto answer = answered->get_future();
  std::thread([store, answered] {
    try {
      store->check({"probe"});
      answered->set_value();
    } catch (...) {
      answered->set_exception(std::current_exception());
    }
  }).detach();
  try {
    if (answer.wait_for(config.timeout) == std::future_status::ready) {
      answer.get();
      return;
    }
  } catch (const std::exception& e) {
    LOCKSTEP_FAIL(
        RendezvousError, "rank ", config.rank, " reached ",
        master_endpoint(config), " but it does not answer as a c10d store. "
        "Is MASTER_PORT the port of rank 0's store (or torchrun's), and not "
        "of another service?\n  cause: ", describe_exception(e));
  }
  LOCKSTEP_FAIL(
      RendezvousError, "rank ", config.rank, " reached ",
      master_endpoint(config), " but it does not answer as a c10d store "
      "within ", seconds(config.timeout), ". Is MASTER_PORT the port of "
      "rank 0's store (or torchrun's), and not of another service?");
}

// The first rank to find a problem (a timeout, a disagreement) publishes its
// verdict; the others adopt it, so that every rank reports the same thing.
// The host then lingers until the others have read it (2 s at most),
// because its exit closes the store.
constexpr const char* kFailureKey = "rendezvous_failed";
constexpr const char* kFailureSeenKey = "rendezvous_failure_seen";

[[noreturn]] void fail_with_verdict(
    c10d::Store& store,
    const WorldConfig& config,
    const std::string& verdict) {
  if (config.rank == 0 && !config.agent_store) {
    auto linger = Clock::now() + std::chrono::seconds(2);
    while (store.add(kFailureSeenKey, 0) < config.size - 1 &&
           Clock::now() < linger) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } else {
    store.add(kFailureSeenKey, 1);
  }
  throw RendezvousError(verdict);
}

[[noreturn]] void publish_and_fail(
    c10d::Store& store,
    const WorldConfig& config,
    const std::string& verdict) {
  fail_with_verdict(
      store, config, text(store.compareSet(kFailureKey, {}, bytes(verdict))));
}

void wait_for_all(c10d::Store& store, const WorldConfig& config) {
  std::vector<std::string> keys;
  for (int rank = 0; rank < config.size; ++rank) {
    keys.push_back(rank_key(rank));
  }
  auto deadline = Clock::now() + config.timeout;
  auto pause = std::chrono::milliseconds(5);
  while (!store.check(keys)) {
    if (store.check({kFailureKey})) {
      fail_with_verdict(store, config, text(store.get(kFailureKey)));
    }
    if (Clock::now() >= deadline) {
      std::vector<int> joined;
      std::vector<int> missing;
      for (int rank = 0; rank < config.size; ++rank) {
        (store.check({keys[rank]}) ? joined : missing).push_back(rank);
      }
      std::string verdict = str(
          "lockstep: rendezvous at ", master_endpoint(config),
          " timed out after ", seconds(config.timeout), ": rank(s) ",
          rank_list(missing), " of ", config.size,
          " never joined (joined: ", rank_list(joined),
          "). Check that every rank was started with the same WORLD_SIZE, "
          "MASTER_ADDR and MASTER_PORT, or raise the limit with "
          "LOCKSTEP_TIMEOUT (seconds).");
      publish_and_fail(store, config, verdict);
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(100));
  }
}

} // namespace

std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    out += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  }
  return out.empty() ? "none" : out;
}

std::string seconds(std::chrono::milliseconds duration) {
  return str(static_cast<double>(duration.count()) / 1000.0, " s");
}

std::string master_endpoint(const WorldConfig& config) {
  return str(config.master_addr, ":", config.master_port);
}

c10::intrusive_ptr<c10d::Store> connect_store(const WorldConfig& config) {
  c10::intrusive_ptr<c10d::Store> base;
  if (config.size == 1) {
    base = c10::make_intrusive<c10d::HashStore>();
  } else {
    base = connect_tcp_store(config);
  }
  base->setTimeout(config.timeout);
  return c10::make_intrusive<c10d::PrefixStore>(config.key_prefix, base);
}

void join(const c10::intrusive_ptr<c10d::Store>& store,
          const WorldConfig& config) {
  expect_store_answers(store, config);
  try {
    for (const auto& problem :
         {disagreement_on_size(*store, config), duplicate_rank(*store, config)}) {
      if (!problem.empty()) {
        publish_and_fail(*store, config, problem);
      }
    }
    store->set(rank_key(config.rank),
               bytes(str(hostname(), " pid ", ::getpid())));
    wait_for_all(*store, config);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    LOCKSTEP_FAIL(
        RendezvousError, "rank ", config.rank, " lost the store at ",
        master_endpoint(config), " during rendezvous (its host may have "
        "exited).\n  cause: ", describe_exception(e));
  }
}

std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || !found) {
    return "127.0.0.1";
  }
  std::string address = "127.0.0.1";
  int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  // Connecting a datagram socket sends nothing: it only asks the kernel
  // which local address the route to `host` leaves from.
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t length = sizeof(local);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0) {
      char buffer[INET_ADDRSTRLEN] = {};
      ::inet_ntop(AF_INET, &local.sin_addr, buffer, sizeof(buffer));
      address = buffer;
    }
  }
  if (fd >= 0) {
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return address;
}

} // namespace lockstep::detail
