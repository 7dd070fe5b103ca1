#include "transport/shared_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>
#include <thread>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <lockstep/error.h>

#include "common/wording.h"
#include "compat/c10d.h"
#include "transport/fd_handover.h"

namespace lockstep::detail {
namespace {

using Clock = std::chrono::steady_clock;

std::string mib(size_t bytes) {
  std::ostringstream out;
  out.precision(1);
  out << std::fixed << static_cast<double>(bytes) / (1 << 20) << " MiB";
  return out.str();
}

std::string text(const std::vector<uint8_t>& bytes) {
  return {bytes.begin(), bytes.end()};
}

// Polls the store (the group forms inside init(), before any collective),
// calling `check` between looks; it may throw.
bool await_key(c10d::Store& store,
               const std::string& key,
               Clock::time_point deadline,
               const std::function<void()>& check) {
  auto pause = std::chrono::microseconds(100);
  while (!store.check({key})) {
    check();
    if (Clock::now() >= deadline) {
      return false;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
  return true;
}

struct MemoryFile {
  int fd = -1;
  std::string where; // the file's name in LOCKSTEP_SHM_DIR, for messages
  std::string failure;
};

MemoryFile create_memory_file(size_t bytes) {
  static std::atomic<int> made{0};
  MemoryFile file;
  const char* dir = std::getenv("LOCKSTEP_SHM_DIR");
  if (dir != nullptr && *dir != '\0') {
    struct statvfs room {};
    if (::statvfs(dir, &room) != 0) {
      file.failure = str("LOCKSTEP_SHM_DIR=", dir, " cannot be used: ", std::strerror(errno));
      return file;
    }
    size_t free_bytes = static_cast<size_t>(room.f_bavail) * room.f_frsize;
    if (free_bytes < bytes) {
      file.failure = str(dir, " has ", mib(free_bytes), " free and the shared segment needs ",
                         mib(bytes), " (in a container, give it more with --shm-size, or "
                         "unset LOCKSTEP_SHM_DIR to use memory no mount bounds)");
      return file;
    }
    std::string path = str(dir, "/lockstep-", ::getpid(), "-", made++);
    file.fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (file.fd >= 0) {
      // The others receive the open file, never its name: nothing is left
      // in the folder, however this process ends.
      ::unlink(path.c_str());
    }
    file.where = path;
  } else {
    file.fd = ::memfd_create("lockstep", MFD_CLOEXEC);
  }
  if (file.fd < 0) {
    file.failure = str("cannot create shared memory",
                       file.where.empty() ? std::string() : " at " + file.where, ": ",
                       std::strerror(errno));
    return file;
  }
  int error = 0;
  if (::ftruncate(file.fd, static_cast<off_t>(bytes)) != 0) {
    error = errno;
  } else {
    error = ::posix_fallocate(file.fd, 0, static_cast<off_t>(bytes));
  }
  if (error != 0) {
    file.failure = str("cannot reserve ", mib(bytes), " of shared memory: ", std::strerror(error));
    ::close(file.fd);
    file.fd = -1;
  }
  return file;
}

void* map(int fd, size_t bytes, std::string& failure) {
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    failure = str("cannot map ", mib(bytes), " of shared memory: ", std::strerror(errno));
  }
  return data;
}

} // namespace

SharedMapping::~SharedMapping() {
  ::munmap(data_, bytes_);
}

namespace {

constexpr const char* kOk = "ok";
constexpr const char* kFallBack = "fall back: ";
constexpr const char* kFail = "fail: ";

// The keys of one shared segment, and the rule that the creating rank
// alone decides whether the group uses it: every rank reads that one
// verdict, so that none maps while another falls back.
struct Handshake {
  c10d::Store& store;
  const std::string& key;
  const HostGroup& group;
  Clock::time_point deadline;

  std::string where() const {
    return key + "/where";
  }
  std::string status(size_t index) const {
    return str(key, "/status/", index);
  }
  std::string verdict() const {
    return key + "/verdict";
  }

  // Raises CollectiveError naming every rank of the group whose process is
  // gone: they will never take part. Every one, not the first: a peer that
  // met the dead rank first may already have reported it and exited, and
  // naming that peer alone would hide the rank that caused it.
  void check_peers() const {
    std::string gone;
    for (size_t i = 0; i < group.ranks.size(); ++i) {
      if (static_cast<int>(i) != group.index && group.gone && group.gone(i)) {
        gone += str(gone.empty() ? "" : ", ", "rank ", group.ranks[i], " (pid ", group.pids[i],
                    ")");
      }
    }
    LOCKSTEP_ENFORCE(gone.empty(), CollectiveError, "rank ",
                     group.ranks[static_cast<size_t>(group.index)], ": ", gone,
                     " exited while the ranks of this host set up shared memory; their own "
                     "output says why.");
  }

  bool await(const std::string& name) const {
    return await_key(store, name, deadline, [this] { check_peers(); });
  }

  // Whether a rank of the group has said that it failed: one that could not
  // take the segment says so before it is served, and will not ask again.
  bool a_rank_failed() const {
    for (size_t i = 1; i < group.ranks.size(); ++i) {
      if (store.check({status(i)}) && text(store.get(status(i))) != kOk) {
        return true;
      }
    }
    return false;
  }
};

// The creating rank: makes the segment, hands it to the group's processes,
// hears how each fared, and decides.
void* create_and_offer(const Handshake& shake, size_t bytes, std::string& failure) {
  void* data = MAP_FAILED;
  MemoryFile file = create_memory_file(bytes);
  failure = file.failure;
  if (failure.empty()) {
    data = map(file.fd, bytes, failure);
  }
  std::unique_ptr<FdOffer> offer;
  if (failure.empty()) {
    offer = std::make_unique<FdOffer>(failure);
  }
  const auto& group = shake.group;
  if (!failure.empty()) {
    failure = str("rank ", group.ranks[0], ": ", failure);
  }
  store_set(shake.store, shake.where(), failure.empty() ? "socket " + offer->name()
                                                        : "!" + failure);
  try {
    std::vector<int> unserved;
    if (failure.empty()) {
      std::vector<int> others(group.pids.begin() + 1, group.pids.end());
      unserved = offer->serve(file.fd, others, shake.deadline, [&] {
        shake.check_peers();
        return !shake.a_rank_failed();
      });
    }
    // Everyone says how it went; the first failure, in rank order, decides.
    for (size_t i = 1; i < group.ranks.size() && failure.empty(); ++i) {
      bool served =
          std::find(unserved.begin(), unserved.end(), group.pids[i]) == unserved.end();
      if (!served && !shake.store.check({shake.status(i)})) {
        failure = str("rank ", group.ranks[i], " did not take the shared segment in time");
      } else if (!shake.await(shake.status(i))) {
        failure = str("rank ", group.ranks[i], " did not map the shared segment in time");
      } else if (std::string status = text(shake.store.get(shake.status(i))); status != kOk) {
        failure = str("rank ", group.ranks[i], ": ", status);
      }
    }
  } catch (const Error& e) {
    store_set(shake.store, shake.verdict(), kFail + std::string(e.what()));
    if (data != MAP_FAILED) {
      ::munmap(data, bytes);
    }
    if (file.fd >= 0) {
      ::close(file.fd);
    }
    throw;
  }
  store_set(shake.store, shake.verdict(), failure.empty() ? kOk : kFallBack + failure);
  if (file.fd >= 0) {
    ::close(file.fd); // the mapping keeps the memory
  }
  return data;
}

// Any other rank: takes the segment from the process of the creating rank
// (whatever the store says, no other), says how it went, and follows the
// verdict.
void* take_offered(const Handshake& shake, size_t bytes, std::string& failure) {
  const auto& group = shake.group;
  void* data = MAP_FAILED;
  if (!shake.await(shake.where())) {
    failure = str("rank ", group.ranks[0], " did not offer the shared segment in time");
  } else if (std::string where = text(shake.store.get(shake.where())); where.rfind("!", 0) == 0) {
    failure = where.substr(1);
  } else if (where.rfind("socket ", 0) != 0) {
    failure = "the store holds an offer of the shared segment that lockstep does not make";
  } else {
    int fd = take_fd(where.substr(7), group.pids[0], shake.deadline, failure);
    struct stat info {};
    if (fd >= 0 && (::fstat(fd, &info) != 0 || static_cast<size_t>(info.st_size) != bytes)) {
      failure = "the shared segment handed over has the wrong size";
    } else if (fd >= 0) {
      data = map(fd, bytes, failure);
    }
    if (fd >= 0) {
      ::close(fd);
    }
  }
  store_set(shake.store, shake.status(static_cast<size_t>(group.index)),
            failure.empty() ? kOk : failure);
  // The creating rank decides by its own deadline, which may fall after
  // this rank's: a second timeout's grace, so that a verdict given on time
  // is never missed (a creator that is gone is named meanwhile).
  Handshake verdict_wait = shake;
  verdict_wait.deadline += group.timeout;
  if (!verdict_wait.await(shake.verdict())) {
    if (data != MAP_FAILED) {
      ::munmap(data, bytes);
    }
    LOCKSTEP_FAIL(TimeoutError, "rank ", group.ranks[static_cast<size_t>(group.index)],
                  ": rank ", group.ranks[0], " did not say within ", seconds(2 * group.timeout),
                  " whether the ranks of this host share memory; that rank is not taking "
                  "part, or is slow (raise LOCKSTEP_TIMEOUT).");
  }
  std::string verdict = text(shake.store.get(shake.verdict()));
  if (verdict != kOk && data != MAP_FAILED) {
    ::munmap(data, bytes);
    data = MAP_FAILED;
  }
  if (verdict.rfind(kFail, 0) == 0) {
    // The creating rank's own error, which names the cause.
    std::string cause = verdict.substr(std::string(kFail).size());
    LOCKSTEP_FAIL(CollectiveError, "rank ", group.ranks[static_cast<size_t>(group.index)],
                  ": shared memory could not be set up: ", cause);
  }
  LOCKSTEP_ENFORCE(verdict != kOk || data != MAP_FAILED, CollectiveError, "rank ",
                   group.ranks[static_cast<size_t>(group.index)], ": told to use a shared "
                   "segment that it could not map (", failure, "); the store holds a verdict "
                   "that the rank which decides did not give.");
  if (verdict != kOk) {
    failure = verdict.substr(std::string(kFallBack).size());
  }
  return data;
}

} // namespace

SharedMappingResult share_mapping(c10d::Store& store,
                                  const std::string& key,
                                  const HostGroup& group,
                                  size_t bytes) {
  TORCH_INTERNAL_ASSERT(group.pids.size() == group.ranks.size());
  Handshake shake{store, key, group, Clock::now() + group.timeout};
  std::string failure;
  void* data = group.index == 0 ? create_and_offer(shake, bytes, failure)
                                : take_offered(shake, bytes, failure);
  if (!failure.empty()) {
    if (data != MAP_FAILED) {
      ::munmap(data, bytes);
    }
    return {nullptr, failure};
  }
  return {std::make_unique<SharedMapping>(data, bytes), ""};
}

} // namespace lockstep::detail
