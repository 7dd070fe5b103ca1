// The store of a job whose ranks all run on this host: a Unix socket and
// the worlds' mapped ledgers in the job's private folder (store/
// host_folder.h), so that no socket another machine could reach is opened.
// lockstep-run makes the folder and serves the store there; a job started
// otherwise has rank 0 do both, holding MASTER_PORT on loopback while it
// runs, so that two jobs told the same port collide with an error (as
// with a TCP store) instead of merging. The host removes the folder when
// the job ends; one that a crash left behind is removed by the next rank 0
// that finds its owner gone.

#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <thread>

#include <lockstep/error.h>

#include "store/host_folder.h"
#include "store/server.h"
#include "world/job_store.h"
#include "world/process_identity.h"
#include "world/rendezvous.h"

namespace lockstep::detail {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// MASTER_PORT on loopback, listened on so that no other socket can bind it
// (another lockstep job's rank 0, a TCP store): never reachable from
// another machine. Closed with the process.
int hold_port(const WorldConfig& config) {
  std::string error;
  int fd = store::hold_loopback_port(config.master_port, error);
  if (fd < 0) {
    fail_port_in_use(config, error);
  }
  return fd;
}

// Whether the process recorded as a folder's owner has ended.
bool owner_gone(const std::string& folder) {
  std::string owner = store::folder_owner(folder);
  return owner.empty() || process_gone(ProcessIdentity::from_record(owner));
}

// Folders of earlier jobs whose host is gone (a crash left them).
void remove_abandoned(const std::string& base) {
  std::error_code ignored;
  for (const auto& entry : fs::directory_iterator(base, ignored)) {
    if (entry.is_directory(ignored) &&
        store::is_job_folder_name(entry.path().filename().string()) &&
        owner_gone(entry.path().string())) {
      store::remove_folder(entry.path().string());
    }
  }
}

// "ledger-" and the world's keys with '/' made '_': the attempt and the
// scope, so that each world of each attempt has a board of its own.
std::string ledger_name(const std::string& key_prefix, const std::string& scope) {
  std::string name = "ledger-" + key_prefix + (scope.empty() ? "" : "-" + scope);
  for (char& c : name) {
    if (c == '/') {
      c = '_';
    }
  }
  return name;
}

class HostJobStore : public JobStore {
 public:
  HostJobStore(const WorldConfig& config, const std::optional<store::Endpoint>& launcher)
      : config_(config) {
    if (launcher) {
      // lockstep-run made the folder and serves the store in it.
      folder_ = fs::path(launcher->path).parent_path().string();
      attach(config, *launcher);
      return;
    }
    std::string error;
    auto base = store::private_base(error);
    LOCKSTEP_ENFORCE(!base.empty(), RendezvousError, "rank ", config.rank, ": ", error);
    folder_ = store::job_folder(base, config.master_port);
    auto endpoint = store::Endpoint::unix_socket(store::socket_path(folder_));
    if (config.rank == 0 && !config.standby) {
      port_fd_ = hold_port(config);
      remove_abandoned(base);
      error = store::create_job_folder(folder_, this_process().to_record());
      LOCKSTEP_ENFORCE(error.empty(), RendezvousError, "rank 0 cannot create the job's store: ",
                       error, ".");
      try {
        server_ = std::make_unique<store::StoreServer>(store::ServerOptions{endpoint, {}, config.secret});
      } catch (const std::exception& e) {
        LOCKSTEP_FAIL(RendezvousError, "rank 0 cannot host the job's store at ",
                      endpoint.describe(), ": ", e.what(), ".");
      }
      server_->start();
    } else {
      await(config);
    }
    attach(config, endpoint);
  }

  ~HostJobStore() override {
    if (port_fd_ >= 0) {
      ::close(port_fd_);
    }
  }

  std::unique_ptr<LedgerBoard> ledger_board(const std::string& scope,
                                            c10::intrusive_ptr<c10d::Store> /*store*/, int rank,
                                            int size) override {
    auto path = (fs::path(folder_) / ledger_name(key_prefix_, scope)).string();
    create_mapped_board(path, size);
    return open_mapped_board(path, rank, size);
  }

  void retire(const std::string& scope) override {
    JobStore::retire(scope);
    std::error_code ignored;
    fs::remove(fs::path(folder_) / ledger_name(key_prefix_, scope), ignored);
  }

  void close() override {
    bool hosted = hosted_here();
    JobStore::close();
    if (hosted) {
      store::remove_folder(folder_);
    }
  }

 private:
  // Until rank 0 has made the folder and listens in it.
  void await(const WorldConfig& config) {
    auto deadline = Clock::now() + config.timeout;
    auto pause = std::chrono::milliseconds(2);
    auto socket = store::socket_path(folder_);
    std::error_code ignored;
    // A restarted rank joins the survivors whoever hosts the store; a
    // first one waits for a live rank 0.
    while (!fs::exists(socket, ignored) || (!config.standby && owner_gone(folder_))) {
      LOCKSTEP_ENFORCE(
          !config.standby || fs::exists(folder_, ignored), RendezvousError, "rank ",
          config.rank, " was restarted alone, but the job's store at ", folder_, " is gone "
          "(the rank that hosted it has ended): there is no training left to rejoin.");
      LOCKSTEP_ENFORCE(
          Clock::now() < deadline, RendezvousError, "rank ", config.rank,
          " found no job on this host at MASTER_PORT=", config.master_port, " within ",
          seconds(config.timeout), " (its store would be ", folder_,
          "). Is rank 0 running, on this host, with the same MASTER_PORT and TMPDIR? "
          "Raise the limit with LOCKSTEP_TIMEOUT (seconds).");
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
  }

  WorldConfig config_;
  std::string folder_;
  int port_fd_ = -1;
};

} // namespace

std::unique_ptr<JobStore> connect_host_store(const WorldConfig& config) {
  std::optional<store::Endpoint> launcher;
  if (!config.store_endpoint.empty()) {
    launcher = store::Endpoint::parse(config.store_endpoint);
  }
  return std::make_unique<HostJobStore>(config, launcher);
}

} // namespace lockstep::detail
