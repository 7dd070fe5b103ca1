#include "transport/shared_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <lockstep/error.h>

#include "compat/c10d.h"

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

// Polls the store: the group forms inside init(), before any collective.
bool await_key(c10d::Store& store, const std::string& key, Clock::time_point deadline) {
  auto pause = std::chrono::microseconds(100);
  while (!store.check({key})) {
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
  std::string path; // set when it lives in LOCKSTEP_SHM_DIR
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
    file.path = str(dir, "/lockstep-", ::getpid(), "-", made++);
    file.fd = ::open(file.path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  } else {
    file.fd = ::memfd_create("lockstep", MFD_CLOEXEC);
  }
  if (file.fd < 0) {
    file.failure = str("cannot create shared memory",
                       file.path.empty() ? std::string() : " at " + file.path, ": ",
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
    if (!file.path.empty()) {
      ::unlink(file.path.c_str());
    }
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

SharedMappingResult share_mapping(c10d::Store& store,
                                  const std::string& key,
                                  const HostGroup& group,
                                  size_t bytes) {
  auto deadline = Clock::now() + group.timeout;
  std::string failure;
  void* data = MAP_FAILED;
  MemoryFile file;
  if (group.index == 0) {
    file = create_memory_file(bytes);
    failure = file.failure;
    if (failure.empty()) {
      data = map(file.fd, bytes, failure);
    }
    store_set(store, key + "/where",
        failure.empty() ? str(::getpid(), " ", file.fd, " ", file.path) : "!" + failure);
  } else if (!await_key(store, key + "/where", deadline)) {
    failure = str("rank ", group.ranks[0], " did not offer the shared segment in time");
  } else {
    std::string where = text(store.get(key + "/where"));
    if (where.rfind("!", 0) == 0) {
      failure = where.substr(1);
    } else {
      std::istringstream fields(where);
      int pid = 0;
      int fd = -1;
      std::string path;
      fields >> pid >> fd >> path;
      std::string source = path.empty() ? str("/proc/", pid, "/fd/", fd) : path;
      int mine = ::open(source.c_str(), O_RDWR | O_CLOEXEC);
      struct stat info {};
      if (mine < 0 || ::fstat(mine, &info) != 0 || static_cast<size_t>(info.st_size) != bytes) {
        failure = str("cannot open the shared segment of rank ", group.ranks[0], " at ", source,
                      ": ", mine < 0 ? std::strerror(errno) : "wrong size");
      } else {
        data = map(mine, bytes, failure);
      }
      if (mine >= 0) {
        ::close(mine);
      }
    }
  }
  // Everyone says how it went; the first failure, in rank order, decides.
  store_set(store, str(key, "/status/", group.index), failure.empty() ? "ok" : failure);
  std::string common;
  for (size_t i = 0; i < group.ranks.size() && common.empty(); ++i) {
    std::string status_key = str(key, "/status/", i);
    if (!await_key(store, status_key, deadline)) {
      common = str("rank ", group.ranks[i], " did not map the shared segment in time");
    } else if (std::string status = text(store.get(status_key)); status != "ok") {
      common = str("rank ", group.ranks[i], ": ", status);
    }
  }
  // Mapped everywhere (or given up): the file need not be reachable any more.
  if (file.fd >= 0) {
    ::close(file.fd);
  }
  if (!file.path.empty()) {
    ::unlink(file.path.c_str());
  }
  if (!common.empty()) {
    if (data != MAP_FAILED) {
      ::munmap(data, bytes);
    }
    return {nullptr, common};
  }
  return {std::make_unique<SharedMapping>(data, bytes), ""};
}

} // namespace lockstep::detail
