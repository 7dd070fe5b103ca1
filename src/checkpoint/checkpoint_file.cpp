#include "checkpoint/checkpoint_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <streambuf>
#include <vector>

#include <lockstep/error.h>

namespace lockstep::detail {
namespace {

constexpr const char* kMagic = "LOCKSTEP-CHECKPOINT 1\n";
constexpr size_t kChunk = 1 << 20;
// Enough for any header: the magic and three fields.
constexpr size_t kHeaderMost = 256;
constexpr uint64_t kFnvStart = 1469598103934665603ull;

std::function<void(size_t)>& write_observer() {
  static std::function<void(size_t)> observer;
  return observer;
}

uint64_t fnv1a(uint64_t hash, const char* data, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i) {
    hash = (hash ^ static_cast<unsigned char>(data[i])) * 1099511628211ull;
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

// The header at a fixed width, so that it can be written before the
// payload and rewritten, once its length and checksum are known, in place.
std::string header_of(int64_t world_size, uint64_t payload_bytes, uint64_t checksum) {
  char fields[128];
  std::snprintf(fields, sizeof(fields),
                "world_size %lld\npayload_bytes %020llu\nfnv1a64 %016llx\n\n",
                static_cast<long long>(world_size), static_cast<unsigned long long>(payload_bytes),
                static_cast<unsigned long long>(checksum));
  return kMagic + std::string(fields);
}

void write_all(int fd, const char* data, size_t bytes, off_t at, const std::string& temp) {
  for (size_t done = 0; done < bytes;) {
    ssize_t wrote = ::pwrite(fd, data + done, bytes - done, at + static_cast<off_t>(done));
    if (wrote < 0 && errno == EINTR) {
      continue;
    }
    if (wrote < 0) {
      fail_io("cannot write", temp);
    }
    done += static_cast<size_t>(wrote);
  }
}

// Writes what the serialiser streams into the temp file in pieces, with
// their length and checksum.
class PayloadWriter : public std::streambuf {
 public:
  PayloadWriter(int fd, off_t start, std::string temp)
      : fd_(fd), at_(start), temp_(std::move(temp)), buffer_(kChunk) {
    setp(buffer_.data(), buffer_.data() + buffer_.size());
  }
  uint64_t bytes() const {
    return bytes_;
  }
  uint64_t checksum() const {
    return checksum_;
  }

 protected:
  int_type overflow(int_type c) override {
    flush_buffer();
    if (c != traits_type::eof()) {
      *pptr() = traits_type::to_char_type(c);
      pbump(1);
    }
    return traits_type::not_eof(c);
  }
  int sync() override {
    flush_buffer();
    return 0;
  }

 private:
  void flush_buffer() {
    size_t pending = static_cast<size_t>(pptr() - pbase());
    if (pending == 0) {
      return;
    }
    checksum_ = fnv1a(checksum_, pbase(), pending);
    write_all(fd_, pbase(), pending, at_, temp_);
    at_ += static_cast<off_t>(pending);
    bytes_ += pending;
    setp(buffer_.data(), buffer_.data() + buffer_.size());
    if (write_observer()) {
      write_observer()(static_cast<size_t>(bytes_));
    }
  }

  int fd_;
  off_t at_;
  std::string temp_;
  std::vector<char> buffer_;
  uint64_t bytes_ = 0;
  uint64_t checksum_ = kFnvStart;
};

// A temp file beside `path`, made afresh: O_EXCL and O_NOFOLLOW, so that
// a file or link planted under the name (in a shared folder) is never
// written through, and 0666 less the user's umask, as any file they save.
int create_temp(const std::string& path, std::string& temp) {
  std::random_device random;
  for (int attempt = 0; attempt < 16; ++attempt) {
    temp = path + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(random() % 1000000);
    int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd >= 0 || errno != EEXIST) {
      return fd;
    }
  }
  return -1;
}

struct Header {
  int64_t world_size = 0;
  size_t payload_bytes = 0;
  uint64_t checksum = 0;
  size_t start = 0; // where the payload begins
};

Header parse_header(const std::string& head, const std::string& path) {
  LOCKSTEP_ENFORCE(
      head.rfind(kMagic, 0) == 0, CheckpointError, path,
      " is not a lockstep checkpoint (it does not start with \"",
      std::string(kMagic, std::strlen(kMagic) - 1), "\").");
  std::istringstream fields(head.substr(std::strlen(kMagic)));
  std::string key;
  Header header;
  fields >> key >> header.world_size;
  bool ok = key == "world_size";
  fields >> key >> header.payload_bytes;
  ok = ok && key == "payload_bytes";
  fields >> key >> std::hex >> header.checksum;
  ok = ok && key == "fnv1a64" && !fields.fail();
  size_t start = head.find("\n\n", std::strlen(kMagic));
  LOCKSTEP_ENFORCE(ok && start != std::string::npos, CheckpointError, path,
                   " has a damaged header.");
  header.start = start + 2;
  return header;
}

void check_length(const Header& header, size_t found, const std::string& path) {
  LOCKSTEP_ENFORCE(
      found >= header.payload_bytes, CheckpointError, path, " is truncated: ",
      header.payload_bytes, " bytes of payload expected, ", found,
      " found. Was it copied before its save completed? The previous "
      "checkpoint, if any, is still whole.");
}

void check_sum(const Header& header, size_t found, uint64_t checksum, const std::string& path) {
  LOCKSTEP_ENFORCE(
      found == header.payload_bytes && checksum == header.checksum, CheckpointError, path,
      " is corrupted: its checksum does not match its contents.");
}

} // namespace

void set_checkpoint_write_observer(std::function<void(size_t)> observer) {
  write_observer() = std::move(observer);
}

void write_checkpoint_file(const std::string& path,
                           int64_t world_size,
                           const std::function<void(std::ostream&)>& write_payload) {
  std::string temp;
  int fd = create_temp(path, temp);
  if (fd < 0) {
    fail_io("cannot create the temp file", temp);
  }
  try {
    std::string header = header_of(world_size, 0, 0);
    write_all(fd, header.data(), header.size(), 0, temp);
    PayloadWriter payload(fd, static_cast<off_t>(header.size()), temp);
    std::ostream out(&payload);
    write_payload(out);
    out.flush();
    LOCKSTEP_ENFORCE(out.good(), CheckpointError, "cannot serialise the checkpoint into ", temp,
                     ".");
    header = header_of(world_size, payload.bytes(), payload.checksum());
    write_all(fd, header.data(), header.size(), 0, temp);
    if (::fsync(fd) != 0) {
      fail_io("cannot flush", temp);
    }
  } catch (...) {
    ::close(fd);
    ::unlink(temp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
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
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  LOCKSTEP_ENFORCE(
      in.good(), CheckpointError, "cannot read the checkpoint ", path, ": ",
      std::strerror(errno), ".");
  std::string bytes(static_cast<size_t>(in.tellg()), '\0');
  in.seekg(0);
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  LOCKSTEP_ENFORCE(in.good(), CheckpointError, "cannot read the checkpoint ", path, ".");
  return bytes;
}

CheckpointSource checkpoint_in_bytes(const std::string& bytes, const std::string& path) {
  Header header = parse_header(bytes.substr(0, kHeaderMost), path);
  size_t found = bytes.size() - std::min(bytes.size(), header.start);
  check_length(header, found, path);
  check_sum(header, found, fnv1a(kFnvStart, bytes.data() + header.start, found), path);
  CheckpointSource source;
  source.world_size = header.world_size;
  source.payload_bytes = header.payload_bytes;
  const char* payload = bytes.data() + header.start;
  source.read = [payload, size = found](uint64_t position, void* into, size_t wanted) {
    size_t count = position >= size ? 0 : std::min<size_t>(wanted, size - position);
    std::memcpy(into, payload + position, count);
    return count;
  };
  return source;
}

CheckpointSource open_checkpoint_file(const std::string& path) {
  int opened = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  LOCKSTEP_ENFORCE(opened >= 0, CheckpointError, "cannot read the checkpoint ", path, ": ",
                   std::strerror(errno), ".");
  // Closed with the last copy of the source's reader.
  auto fd = std::shared_ptr<int>(new int(opened), [](int* held) {
    ::close(*held);
    delete held;
  });
  struct stat info {};
  LOCKSTEP_ENFORCE(::fstat(*fd, &info) == 0, CheckpointError, "cannot read the checkpoint ",
                   path, ": ", std::strerror(errno), ".");
  auto size = static_cast<size_t>(info.st_size);
  std::string head(std::min(size, kHeaderMost), '\0');
  LOCKSTEP_ENFORCE(::pread(*fd, head.data(), head.size(), 0) == static_cast<ssize_t>(head.size()),
                   CheckpointError, "cannot read the checkpoint ", path, ".");
  Header header = parse_header(head, path);
  size_t found = size - std::min(size, header.start);
  check_length(header, found, path);
  auto read = [fd, start = header.start, size = found](uint64_t position, void* into,
                                                       size_t wanted) -> size_t {
    size_t count = position >= size ? 0 : std::min<size_t>(wanted, size - position);
    ssize_t got = ::pread(*fd, into, count, static_cast<off_t>(start + position));
    return got < 0 ? 0 : static_cast<size_t>(got);
  };
  uint64_t checksum = kFnvStart;
  std::vector<char> piece(kChunk);
  for (size_t done = 0; done < found;) {
    size_t got = read(done, piece.data(), piece.size());
    LOCKSTEP_ENFORCE(got > 0, CheckpointError, "cannot read the checkpoint ", path, ".");
    checksum = fnv1a(checksum, piece.data(), got);
    done += got;
  }
  check_sum(header, found, checksum, path);
  CheckpointSource source;
  source.world_size = header.world_size;
  source.payload_bytes = header.payload_bytes;
  source.read = read;
  return source;
}

} // namespace lockstep::detail
