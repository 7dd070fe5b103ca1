#include "checkpoint/checkpoint_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <lockstep/error.h>

namespace lockstep::detail {
namespace {

constexpr const char* kMagic = "LOCKSTEP-CHECKPOINT 1\n";
constexpr size_t kChunk = 1 << 20;

std::function<void(size_t, size_t)>& write_observer() {
  static std::function<void(size_t, size_t)> observer;
  return observer;
}

uint64_t fnv1a(const std::string& data) {
  uint64_t hash = 1469598103934665603ull;
  for (unsigned char byte : data) {
    hash = (hash ^ byte) * 1099511628211ull;
  }
  return hash;
}

std::string folder_of(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

[[noreturn]] void fail_io(const std::string& what, const std::string& path) {
  LOCKSTEP_FAIL(CheckpointError, what, " ", path, ": ", std::strerror(errno));
}

} // namespace

void set_checkpoint_write_observer(std::function<void(size_t, size_t)> observer) {
  write_observer() = std::move(observer);
}

void write_checkpoint_file(const std::string& path, const CheckpointFile& file) {
  std::ostringstream header;
  header << kMagic << "world_size " << file.world_size << "\n"
         << "payload_bytes " << file.payload.size() << "\n"
         << "fnv1a64 " << std::hex << fnv1a(file.payload) << "\n\n";
  std::string bytes = header.str() + file.payload;

  std::string temp = path + ".tmp-" + std::to_string(::getpid());
  int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    fail_io("cannot create the temp file", temp);
  }
  for (size_t done = 0; done < bytes.size();) {
    size_t chunk = std::min(kChunk, bytes.size() - done);
    ssize_t wrote = ::write(fd, bytes.data() + done, chunk);
    if (wrote < 0) {
      if (errno == EINTR) {
        continue;
      }
      ::close(fd);
      ::unlink(temp.c_str());
      fail_io("cannot write", temp);
    }
    done += static_cast<size_t>(wrote);
    if (write_observer()) {
      write_observer()(done, bytes.size());
    }
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(temp.c_str());
    fail_io("cannot flush", temp);
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    ::unlink(temp.c_str());
    fail_io("cannot rename the temp file onto", path);
  }
  // The rename itself is durable once the folder is.
  int folder = ::open(folder_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (folder >= 0) {
    ::fsync(folder);
    ::close(folder);
  }
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LOCKSTEP_ENFORCE(
      in.good(), CheckpointError, "cannot read the checkpoint ", path, ": ",
      std::strerror(errno), ".");
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

CheckpointFile parse_checkpoint_bytes(const std::string& bytes, const std::string& path) {
  LOCKSTEP_ENFORCE(
      bytes.rfind(kMagic, 0) == 0, CheckpointError, path,
      " is not a lockstep checkpoint (it does not start with \"",
      std::string(kMagic, std::strlen(kMagic) - 1), "\").");
  std::istringstream header(bytes.substr(std::strlen(kMagic)));
  std::string key;
  CheckpointFile file;
  size_t payload_bytes = 0;
  uint64_t checksum = 0;
  header >> key >> file.world_size;
  bool ok = key == "world_size";
  header >> key >> payload_bytes;
  ok = ok && key == "payload_bytes";
  header >> key >> std::hex >> checksum;
  ok = ok && key == "fnv1a64" && !header.fail();
  LOCKSTEP_ENFORCE(ok, CheckpointError, path, " has a damaged header.");
  size_t start = bytes.find("\n\n", std::strlen(kMagic));
  LOCKSTEP_ENFORCE(start != std::string::npos, CheckpointError, path,
                   " has a damaged header.");
  start += 2;
  size_t found = bytes.size() - start;
  LOCKSTEP_ENFORCE(
      found >= payload_bytes, CheckpointError, path, " is truncated: ",
      payload_bytes, " bytes of payload expected, ", found,
      " found. Was it copied before its save completed? The previous "
      "checkpoint, if any, is still whole.");
  file.payload = bytes.substr(start, payload_bytes);
  LOCKSTEP_ENFORCE(
      found == payload_bytes && fnv1a(file.payload) == checksum,
      CheckpointError, path, " is corrupted: its checksum does not match "
      "its contents.");
  return file;
}

CheckpointFile read_checkpoint_file(const std::string& path) {
  return parse_checkpoint_bytes(read_bytes(path), path);
}

} // namespace lockstep::detail
