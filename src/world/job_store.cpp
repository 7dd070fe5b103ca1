#include "world/job_store.h"

#include <netdb.h>
#include <sys/socket.h>

#include <sstream>
#include <thread>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <lockstep/error.h>

#include "compat/c10d.h"
#include "store/client.h"
#include "store/server.h"
#include "world/c10d_store.h"
#include "world/job_keys.h"
#include "world/job_secret.h"
#include "world/rendezvous.h"

namespace lockstep::detail {
namespace {

// A name that does not resolve will not resolve later either: say so now
// rather than retry until the timeout.
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

[[noreturn]] void fail_unreachable(const WorldConfig& config, const std::string& where,
                                   const std::string& cause) {
  LOCKSTEP_FAIL(
      RendezvousError, "rank ", config.rank, " could not reach the store at ", where,
      " within ", seconds(config.timeout), ". Is ",
      config.store_endpoint.empty() ? "rank 0 " : "lockstep-run on node 0 ",
      config.agent_store ? "(under torchrun's agent) " : "", "running, and do all ranks use "
      "the same MASTER_ADDR and MASTER_PORT? Raise the limit with LOCKSTEP_TIMEOUT "
      "(seconds).\n  cause: ", cause);
}

// How the refusals name the job whose store a rank reached.
std::string job_named(const WorldConfig& config, const std::string& where, bool one_host) {
  return one_host ? str("the job on this host at MASTER_PORT=", config.master_port)
                  : str("the job at ", where);
}

// A rank whose secret is not the job's: it has none, or another.
[[noreturn]] void refuse_secret(const WorldConfig& config, const std::string& the_job) {
  if (config.secret.empty()) {
    LOCKSTEP_FAIL(RendezvousError, "rank ", config.rank, " was refused: ", the_job, " requires "
                  "a job secret, and this rank has none. Start every rank with the same "
                  "LOCKSTEP_JOB_SECRET (or WorldOptions::secret).");
  }
  LOCKSTEP_FAIL(RendezvousError, "rank ", config.rank, " was refused: ", the_job, " holds "
                "another job secret than this rank's. Start every rank with the same "
                "LOCKSTEP_JOB_SECRET.");
}

// The first rank to record itself (rank 0, or a restarted one that finds
// the record) records which job owns the store and, with a secret, a nonce
// and its proof of the secret; every other rank checks that record before
// it writes a key of its own, so that a rank of another job (told the same
// address and port) or one without this job's secret refuses itself and
// this job goes on. Returns the nonce that the ranks' own proofs are bound
// to. `one_host` words the refusal for a job on this host.
std::string claim_or_check(store::StoreClient& client, const WorldConfig& config,
                           const std::string& where, bool one_host) {
  // (A store that has the secret refuses a rank without it, or with
  // another, on connecting: see attach(). One started without it, by a
  // launcher that was not given it, leaves the check to this record.)
  std::string nonce = random_nonce();
  std::string proof = config.secret.empty()
      ? "-"
      : prove(config.secret, "job|" + config.job_id + "|" + nonce);
  std::string record;
  if (config.rank == 0) {
    record = client.compare_set(kJobRecordKey, "", config.job_id + " " + nonce + " " + proof);
  } else {
    auto found = client.wait_get(kJobRecordKey, config.timeout);
    LOCKSTEP_ENFORCE(found.has_value(), RendezvousError, "rank ", config.rank, " reached the "
                     "store at ", where, ", but no job recorded itself there within ",
                     seconds(config.timeout), ". Is rank 0 running with the same MASTER_ADDR "
                     "and MASTER_PORT?");
    record = *found;
  }
  std::istringstream fields(record);
  std::string job, their_nonce, their_proof;
  fields >> job >> their_nonce >> their_proof;
  auto the_job = job_named(config, where, one_host);
  if (job != config.job_id) {
    if (one_host) {
      LOCKSTEP_FAIL(RendezvousError, "rank ", config.rank, " was refused: ", the_job, " is '",
                    job, "', not this job '", config.job_id, "' (LOCKSTEP_JOB_ID). Two jobs "
                    "were given the same MASTER_PORT: give each its own port. The other job "
                    "goes on.");
    }
    LOCKSTEP_FAIL(RendezvousError, "rank ", config.rank, " was refused: the store at ", where,
                  " belongs to job '", job, "', not to this job '", config.job_id,
                  "' (LOCKSTEP_JOB_ID). Two jobs were given the same MASTER_ADDR and "
                  "MASTER_PORT: give each its own port. The other job goes on.");
  }
  if (config.secret.empty() && their_proof != "-") {
    refuse_secret(config, the_job);
  }
  LOCKSTEP_ENFORCE(
      config.secret.empty() || their_proof != "-", RendezvousError, "rank ", config.rank,
      " was refused: ", the_job, " has no job secret, and this rank has one. Start every "
      "rank with the same LOCKSTEP_JOB_SECRET, or none.");
  if (!config.secret.empty() && their_proof != "-" &&
      !proven(config.secret, "job|" + job + "|" + their_nonce, their_proof)) {
    refuse_secret(config, the_job);
  }
  return their_nonce;
}

c10d::TCPStoreOptions agent_options(const WorldConfig& config) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(config.master_port);
  options.isServer = false;
  options.waitWorkers = false;
  options.timeout = config.timeout;
  choose_tcp_store_server(options);
  return options;
}

// Under torchrun the port is its agent's: rank 0 serves lockstep's store on
// a free port and publishes where in the agent's store, under this job's
// keys; the others read it there.
std::string through_agent(const WorldConfig& config, std::unique_ptr<store::StoreServer>& server) {
  c10::intrusive_ptr<c10d::Store> agent;
  try {
    agent = c10::make_intrusive<c10d::PrefixStore>(
        config.key_prefix,
        c10::make_intrusive<c10d::TCPStore>(config.master_addr, agent_options(config)));
    if (config.rank == 0 && !config.standby) {
      auto endpoint = store::Endpoint::tcp("", 0);
      server = std::make_unique<store::StoreServer>(
          store::ServerOptions{endpoint, {}, config.secret});
      server->start();
      auto address = local_address_towards(config.master_addr);
      store_set(*agent, "store", "tcp:" + address + ":" +
                                     std::to_string(server->endpoint().port));
    }
    auto bytes = agent->get("store");
    return {bytes.begin(), bytes.end()};
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail_unreachable(config, master_endpoint(config) + " (torchrun's agent store)",
                     describe_exception(e));
  }
}

class TcpJobStore : public JobStore {
 public:
  explicit TcpJobStore(const WorldConfig& config) {
    store::Endpoint endpoint;
    if (!config.store_endpoint.empty()) {
      endpoint = store::Endpoint::parse(config.store_endpoint);
    } else if (config.agent_store) {
      expect_resolvable(config);
      endpoint = store::Endpoint::parse(through_agent(config, server_));
    } else {
      expect_resolvable(config);
      endpoint = store::Endpoint::tcp(config.master_addr, config.master_port);
      if (config.rank == 0 && !config.standby) {
        // On every interface, as c10d's TCPStore: the other hosts' ranks
        // connect from wherever they are.
        try {
          server_ = std::make_unique<store::StoreServer>(
              store::ServerOptions{store::Endpoint::tcp("", config.master_port), {},
                                   config.secret});
        } catch (const std::exception& e) {
          std::string cause = e.what();
          if (cause.find("in use") != std::string::npos) {
            fail_port_in_use(config, cause);
          }
          LOCKSTEP_FAIL(RendezvousError, "rank 0 cannot host the store at ",
                        master_endpoint(config), ".\n  cause: ", cause);
        }
        server_->start();
      }
    }
    attach(config, endpoint);
  }

  std::unique_ptr<LedgerBoard> ledger_board(const std::string& /*scope*/,
                                            c10::intrusive_ptr<c10d::Store> store, int rank,
                                            int size) override {
    return make_store_board(c10::make_intrusive<c10d::PrefixStore>("ledger", std::move(store)),
                            rank, size);
  }
};

// A world of one: nothing to meet, no socket.
class LocalJobStore : public JobStore {
 public:
  explicit LocalJobStore(const WorldConfig& config) {
    auto base = c10::make_intrusive<c10d::HashStore>();
    base->setTimeout(config.timeout);
    store_ = c10::make_intrusive<c10d::PrefixStore>(config.key_prefix, base);
    key_prefix_ = config.key_prefix;
    timeout_ = config.timeout;
  }
  c10::intrusive_ptr<c10d::Store> another_connection() override {
    return store_;
  }
  std::unique_ptr<LedgerBoard> ledger_board(const std::string& /*scope*/,
                                            c10::intrusive_ptr<c10d::Store> store, int rank,
                                            int size) override {
    return make_store_board(std::move(store), rank, size);
  }
  void retire(const std::string& /*scope*/) override {}
};

} // namespace

JobStore::~JobStore() = default;

void JobStore::attach(const WorldConfig& config, store::Endpoint endpoint) {
  endpoint.secret = config.secret; // proven on connecting, where the store has one
  bool one_host = endpoint.kind == store::Endpoint::Kind::Unix;
  std::string where = one_host ? endpoint.describe() : master_endpoint(config);
  if (!config.store_endpoint.empty() || config.agent_store) {
    where = endpoint.describe();
  }
  c10::intrusive_ptr<C10dStore> base;
  try {
    base = c10::make_intrusive<C10dStore>(endpoint, config.timeout);
  } catch (const store::UnprovenError&) {
    refuse_secret(config, job_named(config, where, one_host));
  } catch (const std::exception& e) {
    fail_unreachable(config, where, e.what());
  }
  try {
    base->client().ping();
    nonce_ = claim_or_check(base->client(), config, where, one_host);
  } catch (const Error&) {
    throw;
  } catch (const store::UnprovenError&) {
    refuse_secret(config, job_named(config, where, one_host));
  } catch (const std::exception& e) {
    LOCKSTEP_FAIL(RendezvousError, "rank ", config.rank, " reached ", where, " but it does "
                  "not answer as a lockstep job store. Is MASTER_PORT the port of rank 0's "
                  "store (or lockstep-run's), and not of another service?\n  cause: ",
                  e.what());
  }
  store_ = c10::make_intrusive<c10d::PrefixStore>(config.key_prefix, base);
  endpoint_ = endpoint;
  key_prefix_ = config.key_prefix;
  timeout_ = config.timeout;
}

c10::intrusive_ptr<c10d::Store> JobStore::another_connection() {
  return c10::make_intrusive<c10d::PrefixStore>(
      key_prefix_, c10::make_intrusive<C10dStore>(*endpoint_, timeout_));
}

std::unique_ptr<LedgerBoard> JobStore::ledger_board(const std::string& /*scope*/,
                                                    c10::intrusive_ptr<c10d::Store> store,
                                                    int rank, int size) {
  return make_store_board(c10::make_intrusive<c10d::PrefixStore>("ledger", std::move(store)),
                          rank, size);
}

void JobStore::retire(const std::string& scope) {
  client()->erase_prefix(key_prefix_ + "/" + scope + "/");
}

std::unique_ptr<store::StoreClient> JobStore::client() const {
  LOCKSTEP_ENFORCE(endpoint_.has_value(), RendezvousError,
                   "a world of one has no job store to connect to.");
  return std::make_unique<store::StoreClient>(*endpoint_, timeout_);
}

bool JobStore::hosted_here() const {
  return server_ != nullptr;
}

void JobStore::close() {
  if (server_) {
    server_->stop();
    server_.reset();
  }
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
  bool unix_socket = config.store_endpoint.empty()
      ? config.store == WorldConfig::StoreKind::File
      : config.store_endpoint.rfind("unix:", 0) == 0;
  if (unix_socket) {
    return connect_host_store(config);
  }
  return std::make_unique<TcpJobStore>(config);
}

} // namespace lockstep::detail
