#include "world/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <lockstep/error.h>

#include "compat/c10d.h"
#include "world/job_secret.h"

namespace lockstep::detail {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<uint8_t> bytes(const std::string& text) {
  return {text.begin(), text.end()};
}

std::string text(const std::vector<uint8_t>& value) {
  return {value.begin(), value.end()};
}


std::string rank_key(int rank) {
  return "rank/" + std::to_string(rank);
}

std::string proof_key(int rank) {
  return "proof/" + std::to_string(rank);
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

std::string master_endpoint(const WorldConfig& config) {
  return str(config.master_addr, ":", config.master_port);
}

std::vector<ProcessIdentity> join(const c10::intrusive_ptr<c10d::Store>& store,
                                  const WorldConfig& config,
                                  const std::string& nonce) {
  bool proving = !config.secret.empty() && !nonce.empty();
  // Bound to the attempt (the key prefix names the job and its restart
  // count): the job's record and nonce outlive a restart in torchrun's
  // store, and a proof copied from an earlier attempt must not pass.
  auto claim = [&](int rank, const std::string& record) {
    return str("rank|", config.key_prefix, "|", nonce, "|", rank, "|", record);
  };
  try {
    for (const auto& problem :
         {disagreement_on_size(*store, config), duplicate_rank(*store, config)}) {
      if (!problem.empty()) {
        publish_and_fail(*store, config, problem);
      }
    }
    std::string record = this_process().to_record();
    if (proving) {
      store->set(proof_key(config.rank), bytes(prove(config.secret, claim(config.rank, record))));
    }
    store->set(rank_key(config.rank), bytes(record));
    wait_for_all(*store, config);
    std::vector<ProcessIdentity> peers;
    for (int rank = 0; rank < config.size; ++rank) {
      std::string theirs = text(store->get(rank_key(rank)));
      LOCKSTEP_ENFORCE(
          !proving || (store->check({proof_key(rank)}) &&
                       proven(config.secret, claim(rank, theirs),
                              text(store->get(proof_key(rank))))),
          RendezvousError, "rank ", config.rank, ": the process that joined as rank ", rank,
          " did not prove that it holds the job secret: a process without it wrote that "
          "rank's record in the store at ", master_endpoint(config), ". Run jobs across "
          "hosts on a network you trust (see docs/world.md#security).");
      peers.push_back(ProcessIdentity::from_record(theirs));
    }
    return peers;
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
