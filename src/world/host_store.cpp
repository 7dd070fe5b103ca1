// The store of a job whose ranks all run on this host: a c10d FileStore and
// the ledger's mapped board, in a folder that only this user can enter
// ($TMPDIR or /tmp, lockstep-<uid>/port-<MASTER_PORT>). No socket another
// machine could reach. Rank 0 holds MASTER_PORT on loopback while the job
// runs, so that two jobs told the same port collide with an error (as with
// the TCP store) instead of merging; it builds the folder under another
// name and renames it into place, so that a rank never sees half of it.
// The last rank to close removes the folder; one that a crash left behind
// is removed by the next rank 0 of the same port.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <lockstep/error.h>

#include "world/job_store.h"
#include "world/process_identity.h"
#include "world/rendezvous.h"

namespace lockstep::detail {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kOwnerFile = "owner";
constexpr const char* kJobFile = "job";
constexpr const char* kClosedFile = "closed";
constexpr const char* kStoreFile = "store";
constexpr const char* kLedgerFile = "ledger";
constexpr const char* kClosedRanks = "closed_ranks";
// One file per process that opened the job's store: a job whose rank 0
// died goes on under fault tolerance, so its folder is abandoned only once
// every one of them is gone.
constexpr const char* kUsersFolder = "users";

// lockstep-<uid> under $TMPDIR or /tmp, created 0700 and refused unless it
// is ours and private: another user must not read or plant a job's keys.
fs::path private_base(const WorldConfig& config) {
  const char* tmp = std::getenv("TMPDIR");
  fs::path base = fs::path(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") /
      ("lockstep-" + std::to_string(::getuid()));
  if (::mkdir(base.c_str(), 0700) != 0 && errno != EEXIST) {
    LOCKSTEP_FAIL(RendezvousError, "rank ", config.rank, " cannot create ", base.string(),
                  " for the job's store: ", std::strerror(errno),
                  ". Set TMPDIR to a writable folder (the same for every rank).");
  }
  struct stat info {};
  bool private_folder = ::lstat(base.c_str(), &info) == 0 && S_ISDIR(info.st_mode) &&
      info.st_uid == ::getuid() && (info.st_mode & 077) == 0;
  LOCKSTEP_ENFORCE(
      private_folder, RendezvousError, base.string(), " must be a folder that only this "
      "user can enter (owner uid ", ::getuid(), ", mode 0700), since it holds the job's "
      "store; remove it, or set TMPDIR to another folder (the same for every rank).");
  return base;
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  std::string text;
  std::getline(in, text);
  return text;
}

// Whether `folder` is a job's folder that a rank may still join: complete,
// its rank 0 alive (unless `standby`: a rank restarted alone joins the
// survivors, rank 0 among them or not), and no rank closed yet.
bool open_for_joining(const fs::path& folder, bool standby) {
  std::error_code ignored;
  if (fs::exists(folder / kClosedFile, ignored)) {
    return false;
  }
  std::string owner = read_file(folder / kOwnerFile);
  return !owner.empty() && (standby || !process_gone(ProcessIdentity::from_record(owner)));
}

// MASTER_PORT on loopback, listened on so that no other socket can bind it
// (another lockstep job's rank 0, a TCP store): never reachable from
// another machine. Closed with the process.
int hold_port(const WorldConfig& config) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(config.master_port));
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::listen(fd, 1) != 0) {
    std::string cause = std::strerror(errno);
    if (fd >= 0) {
      ::close(fd);
    }
    fail_port_in_use(config, "bind 127.0.0.1:" + std::to_string(config.master_port) + ": " +
                                 cause);
  }
  return fd;
}

// Whether a process that opened the job's store in `folder` still runs.
bool has_live_user(const fs::path& folder) {
  std::error_code ignored;
  for (const auto& entry : fs::directory_iterator(folder / kUsersFolder, ignored)) {
    if (!process_gone(ProcessIdentity::from_record(read_file(entry.path())))) {
      return true;
    }
  }
  return false;
}

void add_user(const fs::path& folder) {
  auto me = this_process();
  std::error_code ignored;
  fs::create_directory(folder / kUsersFolder, ignored);
  std::ofstream(folder / kUsersFolder / (std::to_string(me.pid) + "-" +
                                         std::to_string(me.start_time)))
      << me.to_record() << "\n";
}

// Folders of earlier jobs whose rank 0 is gone (a crash left them), and no
// other process of theirs runs.
void remove_abandoned(const fs::path& base) {
  std::error_code ignored;
  for (const auto& entry : fs::directory_iterator(base, ignored)) {
    std::string owner = read_file(entry.path() / kOwnerFile);
    if (entry.is_directory(ignored) && entry.path().filename().string().rfind("port-", 0) == 0 &&
        (owner.empty() ? fs::exists(entry.path() / kClosedFile, ignored)
                       : process_gone(ProcessIdentity::from_record(owner))) &&
        !has_live_user(entry.path())) {
      fs::remove_all(entry.path(), ignored);
    }
  }
}

class HostJobStore : public JobStore {
 public:
  explicit HostJobStore(const WorldConfig& config) : config_(config) {
    auto base = private_base(config);
    folder_ = base / ("port-" + std::to_string(config.master_port));
    if (config.rank == 0 && !config.standby) {
      port_fd_ = hold_port(config);
      create(base, config);
    } else {
      await(config);
      add_user(folder_);
    }
    auto file_store = c10::make_intrusive<c10d::FileStore>((folder_ / kStoreFile).string(), -1);
    file_store->setTimeout(config.timeout);
    unscoped_ = file_store;
    store_ = c10::make_intrusive<c10d::PrefixStore>(config.key_prefix, file_store);
  }

  ~HostJobStore() override {
    if (port_fd_ >= 0) {
      ::close(port_fd_);
    }
  }

  std::unique_ptr<LedgerBoard> ledger_board(int rank, int size) override {
    return open_mapped_board((folder_ / kLedgerFile).string(), rank, size);
  }

  c10::intrusive_ptr<c10d::Store> another_connection() override {
    auto file_store = c10::make_intrusive<c10d::FileStore>((folder_ / kStoreFile).string(), -1);
    file_store->setTimeout(config_.timeout);
    return c10::make_intrusive<c10d::PrefixStore>(config_.key_prefix, file_store);
  }

  void close() override {
    std::error_code ignored;
    if (!fs::exists(folder_ / kOwnerFile, ignored)) {
      return; // removed already: the file store would wait for it to reappear
    }
    std::ofstream(folder_ / kClosedFile) << this_process().to_record() << "\n";
    try {
      if (unscoped_->add(kClosedRanks, 1) == config_.size) {
        fs::remove_all(folder_, ignored);
      }
    } catch (const std::exception&) {
      // Another rank removed it already.
    }
  }

 private:
  void create(const fs::path& base, const WorldConfig& config) {
    std::error_code ignored;
    remove_abandoned(base);
    // Holding the port, this rank 0 is the only live one of this port; but a
    // fault-tolerant job whose rank 0 died goes on in its folder.
    LOCKSTEP_ENFORCE(!fs::exists(folder_, ignored) || !has_live_user(folder_), RendezvousError,
                     "rank 0 cannot host the job's store at MASTER_PORT=", config.master_port,
                     ": a job that lost its rank 0 still runs there (its other ranks go on, "
                     "under lockstep::FaultTolerance). Choose another MASTER_PORT.");
    fs::remove_all(folder_, ignored);
    fs::path draft = folder_.string() + ".draft";
    fs::remove_all(draft, ignored);
    fs::create_directory(draft, ignored);
    std::ofstream(draft / kOwnerFile) << this_process().to_record() << "\n";
    add_user(draft);
    std::ofstream(draft / kJobFile) << config.job_id << "\n";
    create_mapped_board((draft / kLedgerFile).string(), config.size);
    std::error_code renamed;
    fs::rename(draft, folder_, renamed);
    LOCKSTEP_ENFORCE(!renamed, RendezvousError, "rank 0 cannot create the job's store at ",
                     folder_.string(), ": ", renamed.message(), ".");
  }

  void await(const WorldConfig& config) {
    auto deadline = Clock::now() + config.timeout;
    auto pause = std::chrono::milliseconds(2);
    while (!open_for_joining(folder_, config.standby)) {
      std::error_code ignored;
      LOCKSTEP_ENFORCE(
          !config.standby || !fs::exists(folder_ / kClosedFile, ignored), RendezvousError,
          "rank ", config.rank, " was restarted alone, but the job's other ranks have ended "
          "(the first to close was process ", read_file(folder_ / kClosedFile), "): there is "
          "no training left to rejoin.");
      LOCKSTEP_ENFORCE(
          Clock::now() < deadline, RendezvousError, "rank ", config.rank,
          " found no job on this host at MASTER_PORT=", config.master_port, " within ",
          seconds(config.timeout), " (its store would be ", folder_.string(),
          "). Is rank 0 running, on this host, with the same MASTER_PORT and TMPDIR? "
          "Raise the limit with LOCKSTEP_TIMEOUT (seconds).");
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
    // As the TCP store checks: a rank of another job told the same port
    // refuses itself before it writes anything, and that job goes on.
    std::string job = read_file(folder_ / kJobFile);
    LOCKSTEP_ENFORCE(
        job == config.job_id, RendezvousError, "rank ", config.rank, " was refused: the job "
        "on this host at MASTER_PORT=", config.master_port, " is '", job, "', not this job '",
        config.job_id, "' (LOCKSTEP_JOB_ID). Two jobs were given the same MASTER_PORT: give "
        "each its own port. The other job goes on.");
  }

  WorldConfig config_;
  fs::path folder_;
  int port_fd_ = -1;
  c10::intrusive_ptr<c10d::Store> unscoped_;
};

} // namespace

std::unique_ptr<JobStore> connect_host_store(const WorldConfig& config) {
  return std::make_unique<HostJobStore>(config);
}

} // namespace lockstep::detail
