#include "launcher_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

#include "store/client.h"
#include "store/host_folder.h"
#include "store/server.h"
#include "world/job_keys.h"
#include "world/job_secret.h"
#include "world/process_identity.h"

namespace lockstep::run {
namespace {

namespace fs = std::filesystem;

constexpr auto kWatchWait = std::chrono::seconds(1);
constexpr const char* kProof = "\nproof ";

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : fallback;
}

// The port on loopback, held so that no other job's store can take it
// while this one runs (as a rank 0 that hosts the store does).
int hold_port(int port) {
  std::string error;
  int fd = store::hold_loopback_port(port, error);
  if (fd < 0) {
    throw std::runtime_error("cannot host the job's store: " + error + " (another job holds it?)");
  }
  return fd;
}

} // namespace

LauncherStore::LauncherStore(const RunOptions& options, int port)
    : options_(options),
      job_id_(options.job_id.empty() ? env_or("LOCKSTEP_JOB_ID", "default") : options.job_id),
      secret_(env_or("LOCKSTEP_JOB_SECRET", "")) {
  bool one_host = options.nnodes == 1 && env_or("LOCKSTEP_STORE", "auto") != "tcp";
  store::Endpoint endpoint = store::Endpoint::tcp(options.master_addr, port);
  for (const auto& address : options.store_successors) {
    endpoint.successors.push_back(store::Endpoint::parse("tcp:" + address));
  }
  endpoint_ = endpoint.to_string();
  // A fresh launcher for a node 0 that was lost serves nothing where a
  // successor took the store over: the job goes on there, and this
  // node's ranks rejoin it.
  if (options.node_rank == 0 && (one_host || !served_by_a_successor())) {
    store::Endpoint listen = store::Endpoint::tcp("", port);
    if (one_host) {
      port_fd_ = hold_port(port);
      std::string error;
      auto base = store::private_base(error);
      if (base.empty()) {
        throw std::runtime_error(error);
      }
      folder_ = store::job_folder(base, port);
      error = store::create_job_folder(folder_, detail::this_process().to_record());
      if (!error.empty()) {
        throw std::runtime_error(error);
      }
      listen = endpoint = store::Endpoint::unix_socket(store::socket_path(folder_));
    }
    server_ = std::make_unique<store::StoreServer>(store::ServerOptions{listen, {}, secret_});
    server_->start();
    serving_ = true;
    endpoint_ = endpoint.to_string();
  }
  if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw std::runtime_error("pipe failed");
  }
  thread_ = std::thread([this] { watch(); });
}

LauncherStore::~LauncherStore() {
  {
    std::lock_guard<std::mutex> lock(hung_mutex_);
    stop_ = true;
    if (watcher_) {
      watcher_->interrupt();
    }
  }
  thread_.join();
  client_.reset();
  if (server_) {
    server_->stop();
  }
  if (!folder_.empty()) {
    store::remove_folder(folder_);
  }
  if (port_fd_ >= 0) {
    ::close(port_fd_);
  }
  ::close(wake_[0]);
  ::close(wake_[1]);
}

void LauncherStore::watch() {
  auto endpoint = store_endpoint();
  int first = options_.node_rank * options_.nproc_per_node;
  uint64_t since = 0;
  store::StoreClient* watcher = nullptr;
  std::string served_at; // where the store answered last ("": never yet)
  while (true) {
    try {
      if (watcher == nullptr) {
        // In short tries, so that the launcher's end never waits on one.
        auto client = std::make_unique<store::StoreClient>(endpoint, kConnectTry);
        client->set_timeout(kStoreTimeout);
        // Its store gone, the watcher looks for it again itself (and may
        // take it over), rather than wait inside a call.
        client->set_move_wait(std::chrono::milliseconds(0));
        std::lock_guard<std::mutex> lock(hung_mutex_);
        if (stop_) {
          return;
        }
        watcher_ = std::move(client);
        watcher = watcher_.get();
      }
      if (watcher->serving().to_string() != served_at) {
        if (!served_at.empty()) {
          write_back(*watcher); // another store serves the job now
          since = 0;
        }
        served_at = watcher->serving().to_string();
      }
      if (record_.empty()) {
        // The job's record, as its rank 0 wrote it: a store that takes
        // over gets it back (write_back), so that the nonce the ranks'
        // proofs are bound to stays the job's.
        record_ = watcher->get(detail::kJobRecordKey).value_or("");
      }
      if (!options_.store_successors.empty()) {
        // What a store taking over starts with (take_over_if_gone).
        auto ft = prefix(attempt_) + "/ft/";
        if (auto epoch = watcher->get(ft + "epoch")) {
          latest_epoch_ = {ft + "epoch", *epoch};
        }
        if (!loop_ended_ && (watcher->get(ft + "finished") || watcher->get(kEndedKey))) {
          loop_ended_ = true;
        }
      }
      auto change = watcher->watch(0, since, kWatchWait, {});
      since = change.version;
      for (const auto& slot : change.slots) {
        auto& newest = incarnations_[slot.slot];
        newest = std::max(newest, slot.incarnation);
        if (slot.state == store::SlotState::Reported && slot.slot >= first &&
            slot.slot < first + options_.nproc_per_node) {
          std::lock_guard<std::mutex> lock(hung_mutex_);
          hung_.push_back({slot.slot, slot.incarnation, slot.why});
          char byte = 1;
          [[maybe_unused]] auto written = ::write(wake_[1], &byte, 1);
        }
      }
    } catch (const std::exception&) {
      // Not up yet (another node's launcher), or gone: try again.
      {
        std::lock_guard<std::mutex> lock(hung_mutex_);
        if (stop_) {
          return;
        }
        watcher_.reset();
        watcher = nullptr;
        since = 0;
      }
      if (!served_at.empty()) {
        take_over_if_gone();
      }
    }
  }
}

std::vector<Hung> LauncherStore::take_hung() {
  char buffer[64];
  while (::read(wake_[0], buffer, sizeof(buffer)) > 0) {
  }
  std::lock_guard<std::mutex> lock(hung_mutex_);
  return std::exchange(hung_, {});
}

std::string LauncherStore::prefix(int attempt) const {
  return detail::job_key_prefix(job_id_, std::to_string(attempt));
}

std::string LauncherStore::nonce() {
  auto record = client_->get(detail::kJobRecordKey);
  std::string job, nonce;
  if (record) {
    std::istringstream(*record) >> job >> nonce;
  }
  return nonce;
}

std::string LauncherStore::prove(const std::string& claim) {
  if (secret_.empty()) {
    return "-";
  }
  return detail::prove(secret_, detail::fault_tolerance_claim(job_id_, claim, nonce()));
}

bool LauncherStore::proven(const std::string& claim, const std::string& proof) {
  if (secret_.empty()) {
    return proof == "-";
  }
  return detail::proven(secret_, detail::fault_tolerance_claim(job_id_, claim, nonce()), proof);
}

std::map<int, int> LauncherStore::known_incarnations() {
  std::map<int, int> known;
  try {
    store::StoreClient client(store_endpoint(), kConnectTry);
    client.set_timeout(kStoreTimeout);
    for (const auto& slot : client.watch(0, 0, std::chrono::milliseconds(0), {}).slots) {
      known[slot.slot] = slot.incarnation;
    }
    std::istringstream lines(client.get(kIncarnationsKey).value_or(""));
    for (int slot = 0, incarnation = 0; lines >> slot >> incarnation;) {
      known[slot] = known.count(slot) ? std::max(known[slot], incarnation) : incarnation;
    }
  } catch (const store::UnprovenError& e) {
    throw std::runtime_error(std::string(e.what()) + ": give every launcher and rank of the "
                             "job the same LOCKSTEP_JOB_SECRET");
  } catch (const std::exception&) {
    // No store yet (node 0 starts it): the job is starting.
  }
  return known;
}

store::Endpoint LauncherStore::store_endpoint() const {
  auto endpoint = store::Endpoint::parse(endpoint_);
  endpoint.secret = secret_; // proven on connecting
  return endpoint;
}

void LauncherStore::begin_attempt(int attempt) {
  attempt_ = attempt;
  if (options_.node_rank != 0 || attempt == 0) {
    return;
  }
  std::lock_guard<std::mutex> lock(client_mutex_);
  try {
    if (!client_) {
      client_ = std::make_unique<store::StoreClient>(store_endpoint(),
                                                     kStoreTimeout);
    }
    client_->erase_prefix(prefix(attempt - 1) + "/");
  } catch (const std::exception&) {
    client_.reset();
  }
  if (!folder_.empty()) {
    std::error_code ignored;
    std::string stale = "ledger-lockstep_" + job_id_ + "_" + std::to_string(attempt - 1);
    for (const auto& entry : fs::directory_iterator(folder_, ignored)) {
      if (entry.path().filename().string().rfind(stale, 0) == 0) {
        fs::remove(entry.path(), ignored);
      }
    }
  }
}

void LauncherStore::job_finished(int attempt) {
  loop_ended_ = true;
  std::lock_guard<std::mutex> lock(client_mutex_);
  try {
    if (!client_) {
      client_ = std::make_unique<store::StoreClient>(store_endpoint(),
                                                     kStoreTimeout);
    }
    std::string key = prefix(attempt) + "/ft/finished";
    std::string value = std::string("ended") + kProof + prove(key + "|ended");
    client_->set(key, value);
    std::lock_guard<std::mutex> finished(finished_mutex_);
    finished_key_ = key; // written back where the store moves
    finished_value_ = value;
  } catch (const std::exception&) {
    client_.reset(); // a job without fault tolerance, or its store gone
  }
}

std::optional<std::string> LauncherStore::left(int attempt, int slot, int incarnation) {
  std::lock_guard<std::mutex> lock(client_mutex_);
  try {
    if (!client_) {
      client_ = std::make_unique<store::StoreClient>(store_endpoint(),
                                                     kStoreTimeout);
    }
    std::string where = "left/" + std::to_string(slot) + "/" + std::to_string(incarnation);
    auto value = client_->get(prefix(attempt) + "/ft/" + where);
    if (!value) {
      return std::nullopt;
    }
    auto at = value->rfind(kProof);
    if (at == std::string::npos) {
      return std::nullopt;
    }
    auto body = value->substr(0, at);
    if (!proven(prefix(attempt) + "/ft/left|" + std::to_string(slot) + "|" +
                    std::to_string(incarnation) + "|" + body,
                value->substr(at + std::string(kProof).size()))) {
      return std::nullopt;
    }
    return body;
  } catch (const std::exception&) {
    client_.reset();
    return std::nullopt;
  }
}

} // namespace lockstep::run
