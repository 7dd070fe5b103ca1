#include "world/job_store.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <future>
#include <sstream>
#include <thread>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <lockstep/error.h>

#include "compat/c10d.h"
#include "world/job_secret.h"
#include "world/rendezvous.h"

namespace lockstep::detail {
namespace {

c10::intrusive_ptr<c10d::Store> scoped(const WorldConfig& config,
                                       c10::intrusive_ptr<c10d::Store> base) {
  base->setTimeout(config.timeout);
  return c10::make_intrusive<c10d::PrefixStore>(config.key_prefix, std::move(base));
}

// A name that does not resolve will not resolve later either: say so now
// rather than retry until the timeout. A refused connection, which a rank 0
// still starting gives, is retried by TCPStore itself.
void expect_resolvable(const WorldConfig& config) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int status = ::getaddrinfo(config.master_addr.c_str(), nullptr, &hints, &found);
  if (found != nullptr) {
    ::freeaddrinfo(found);
  }
  LOCKSTEP_ENFORCE(
      status != EAI_NONAME && status != EAI_FAIL && status != EAI_NODATA, RendezvousError,
      "rank ", config.rank, ": MASTER_ADDR='", config.master_addr,
      "' does not resolve to an address (", ::gai_strerror(status), "). Set it to rank 0's "
      "host name or address, as every rank can resolve it (127.0.0.1 on one machine).");
}

// Whether something at MASTER_ADDR:MASTER_PORT accepts a TCP connection
// now: tells "nothing listens there" from "a service that is no store",
// whatever TCPStore's own retries (2.x waits seconds between attempts to
// connect, so its constructor may outlast the limit where nothing listens).
bool accepts_connections(const WorldConfig& config) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(config.master_addr.c_str(), std::to_string(config.master_port).c_str(),
                    &hints, &found) != 0 || found == nullptr) {
    return false;
  }
  bool accepted = false;
  for (addrinfo* address = found; address != nullptr && !accepted; address = address->ai_next) {
    int fd = ::socket(address->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      continue;
    }
    if (::connect(fd, address->ai_addr, address->ai_addrlen) == 0) {
      accepted = true;
    } else if (errno == EINPROGRESS) {
      pollfd writable{fd, POLLOUT, 0};
      int error = 0;
      socklen_t length = sizeof(error);
      accepted = ::poll(&writable, 1, 1000) == 1 &&
          ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 && error == 0;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return accepted;
}

[[noreturn]] void fail_unreachable(const WorldConfig& config, const std::string& cause) {
  LOCKSTEP_FAIL(
      RendezvousError, "rank ", config.rank,
      " could not reach the store at ", master_endpoint(config),
      " (MASTER_ADDR:MASTER_PORT) within ", seconds(config.timeout),
      ". Is rank 0 ", config.agent_store ? "(torchrun's agent) " : "",
      "running, and do all ranks use the same MASTER_ADDR and "
      "MASTER_PORT? Raise the limit with LOCKSTEP_TIMEOUT (seconds).\n"
      "  cause: ", cause);
}

// Connecting, and the first store operation, run on a thread of their own:
// a peer that accepts connections but is not a store never answers, and
// TCPStore's client would wait for that answer forever (from LibTorch 2.x
// on inside its constructor, which pings the server). On timeout the
// thread is left behind, blocked, holding its own reference to the store.
struct Connection {
  std::promise<c10::intrusive_ptr<c10d::Store>> store;
  std::atomic<bool> constructed{false};
};

c10::intrusive_ptr<c10d::Store> connect_and_probe(const WorldConfig& config,
                                                  const c10d::TCPStoreOptions& options,
                                                  bool host_here) {
  auto connection = std::make_shared<Connection>();
  auto connected = connection->store.get_future();
  std::thread([connection, address = config.master_addr, options] {
    try {
      c10::intrusive_ptr<c10d::Store> store =
          c10::make_intrusive<c10d::TCPStore>(address, options);
      connection->constructed = true;
      store->check({"probe"});
      connection->store.set_value(std::move(store));
    } catch (...) {
      connection->store.set_exception(std::current_exception());
    }
  }).detach();
  // TCPStore gives up connecting by itself at the timeout; the margin lets
  // that failure, with its own cause, arrive first.
  if (connected.wait_for(config.timeout + std::chrono::seconds(2)) ==
      std::future_status::ready) {
    try {
      return connected.get();
    } catch (const std::exception& e) {
      std::string cause = describe_exception(e);
      if (connection->constructed) {
        LOCKSTEP_FAIL(
            RendezvousError, "rank ", config.rank, " reached ",
            master_endpoint(config), " but it does not answer as a c10d store. "
            "Is MASTER_PORT the port of rank 0's store (or torchrun's), and not "
            "of another service?\n  cause: ", cause);
      }
      if (host_here && cause.find("already in use") != std::string::npos) {
        fail_port_in_use(config, cause);
      }
      if (host_here) {
        LOCKSTEP_FAIL(RendezvousError, "rank 0 cannot host the store at ",
                      master_endpoint(config), ".\n  cause: ", cause);
      }
      fail_unreachable(config, cause);
    }
  }
  if (!host_here && !accepts_connections(config)) {
    fail_unreachable(config, "nothing accepts connections there");
  }
  LOCKSTEP_FAIL(
      RendezvousError, "rank ", config.rank, " reached ",
      master_endpoint(config), " but it does not answer as a c10d store "
      "within ", seconds(config.timeout), ". Is MASTER_PORT the port of "
      "rank 0's store (or torchrun's), and not of another service?");
}

std::vector<uint8_t> bytes(const std::string& text) {
  return {text.begin(), text.end()};
}

// Unscoped, so that another job's ranks find it: which job owns this store.
constexpr const char* kJobKey = "lockstep/job";

// The rank that hosts the store (rank 0, also with torchrun's agent)
// records which job owns it and, with a secret, a nonce and its proof of the
// secret; every other rank checks that record before it writes a key of its
// own, so that a rank of another job (told the same address and port) or one
// without this job's secret refuses itself and this job goes on. Returns
// the nonce that the ranks' own proofs are bound to.
std::string claim_or_check(c10d::Store& store, const WorldConfig& config) {
  std::string nonce = random_nonce();
  std::string proof = config.secret.empty()
      ? "-"
      : prove(config.secret, "job|" + config.job_id + "|" + nonce);
  std::string record;
  if (config.rank == 0) {
    auto mine = bytes(config.job_id + " " + nonce + " " + proof);
    auto stored = store.compareSet(kJobKey, {}, mine);
    record = std::string(stored.begin(), stored.end());
  } else {
    auto deadline = std::chrono::steady_clock::now() + config.timeout;
    while (!store.check({kJobKey})) {
      LOCKSTEP_ENFORCE(
          std::chrono::steady_clock::now() < deadline, RendezvousError, "rank ", config.rank,
          " reached the store at ", master_endpoint(config), ", but no job recorded itself "
          "there within ", seconds(config.timeout), ". Is rank 0 running with the same "
          "MASTER_ADDR and MASTER_PORT?");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    auto stored = store.get(kJobKey);
    record = std::string(stored.begin(), stored.end());
  }
  std::istringstream fields(record);
  std::string job, their_nonce, their_proof;
  fields >> job >> their_nonce >> their_proof;
  std::string where = str("the job at ", master_endpoint(config));
  LOCKSTEP_ENFORCE(
      job == config.job_id, RendezvousError, "rank ", config.rank, " was refused: the store "
      "at ", master_endpoint(config), " belongs to job '", job, "', not to this job '",
      config.job_id, "' (LOCKSTEP_JOB_ID). Two jobs were given the same MASTER_ADDR and "
      "MASTER_PORT: give each its own port. The other job goes on.");
  LOCKSTEP_ENFORCE(
      !config.secret.empty() || their_proof == "-", RendezvousError, "rank ", config.rank,
      " was refused: ", where, " requires a job secret, and this rank has none. Start "
      "every rank with the same LOCKSTEP_JOB_SECRET (or WorldOptions::secret).");
  LOCKSTEP_ENFORCE(
      config.secret.empty() || their_proof != "-", RendezvousError, "rank ", config.rank,
      " was refused: ", where, " has no job secret, and this rank has one. Start every "
      "rank with the same LOCKSTEP_JOB_SECRET, or none.");
  LOCKSTEP_ENFORCE(
      config.secret.empty() ||
          proven(config.secret, "job|" + job + "|" + their_nonce, their_proof),
      RendezvousError, "rank ", config.rank, " was refused: ", where, " holds another "
      "job secret than this rank's. Start every rank with the same LOCKSTEP_JOB_SECRET.");
  return their_nonce;
}

// A client of the job's TCP store, or (`server`) the store itself.
c10d::TCPStoreOptions tcp_store_options(const WorldConfig& config, bool server) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(config.master_port);
  options.isServer = server;
  options.waitWorkers = false;
  options.timeout = config.timeout;
  choose_tcp_store_server(options);
  return options;
}

class TcpJobStore : public JobStore {
 public:
  explicit TcpJobStore(const WorldConfig& config)
      : config_(config),
        host_here_(config.rank == 0 && !config.agent_store && !config.standby) {
    expect_resolvable(config);
    auto base = connect_and_probe(config, tcp_store_options(config, host_here_), host_here_);
    try {
      nonce_ = claim_or_check(*base, config);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      LOCKSTEP_FAIL(RendezvousError, "rank ", config.rank, " lost the store at ",
                    master_endpoint(config), " while joining.\n  cause: ",
                    describe_exception(e));
    }
    store_ = scoped(config, base);
  }

  std::unique_ptr<LedgerBoard> ledger_board(int rank, int size) override {
    return make_store_board(c10::make_intrusive<c10d::PrefixStore>("ledger", store_), rank, size,
                            c10::make_intrusive<c10d::PrefixStore>("ledger", another_connection()));
  }

  std::unique_ptr<LedgerBoard> ledger_board_under(const std::string& scope,
                                                  c10::intrusive_ptr<c10d::Store> store,
                                                  int rank,
                                                  int size) override {
    // The heartbeat has a connection of its own.
    auto heartbeat = c10::make_intrusive<c10d::PrefixStore>(
        "ledger", c10::make_intrusive<c10d::PrefixStore>(scope, another_connection()));
    return make_store_board(c10::make_intrusive<c10d::PrefixStore>("ledger", std::move(store)),
                            rank, size, heartbeat);
  }

  c10::intrusive_ptr<c10d::Store> another_connection() override {
    return scoped(config_, c10::make_intrusive<c10d::TCPStore>(
                               config_.master_addr, tcp_store_options(config_, /*server=*/false)));
  }

  bool hosted_here() const override {
    return host_here_;
  }

 private:
  WorldConfig config_;
  bool host_here_;
};

// A world of one: nothing to meet, no socket.
class LocalJobStore : public JobStore {
 public:
  explicit LocalJobStore(const WorldConfig& config) {
    store_ = scoped(config, c10::make_intrusive<c10d::HashStore>());
  }
  std::unique_ptr<LedgerBoard> ledger_board(int rank, int size) override {
    return make_store_board(store_, rank, size);
  }
};

} // namespace

std::unique_ptr<LedgerBoard> JobStore::ledger_board_under(const std::string& /*scope*/,
                                                          c10::intrusive_ptr<c10d::Store> store,
                                                          int rank,
                                                          int size) {
  return make_store_board(c10::make_intrusive<c10d::PrefixStore>("ledger", std::move(store)),
                          rank, size);
}

void fail_port_in_use(const WorldConfig& config, const std::string& cause) {
  LOCKSTEP_FAIL(
      RendezvousError, "rank 0 cannot host the store on MASTER_PORT=",
      config.master_port, ": the port is already in use by another "
      "process. Choose a free MASTER_PORT (lockstep-run picks one "
      "itself) or stop the process that holds it.\n  cause: ", cause);
}

std::unique_ptr<JobStore> connect_job_store(const WorldConfig& config) {
  if (config.size == 1) {
    return std::make_unique<LocalJobStore>(config);
  }
  if (config.store == WorldConfig::StoreKind::File) {
    return connect_host_store(config);
  }
  return std::make_unique<TcpJobStore>(config);
}

} // namespace lockstep::detail
