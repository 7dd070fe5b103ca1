#include "transport/fd_handover.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include <lockstep/error.h>

namespace lockstep::detail {
namespace {

using Clock = std::chrono::steady_clock;

// The abstract namespace: sun_path starts with a NUL, and the name is the
// bytes after it.
socklen_t address_of(const std::string& name, sockaddr_un& address) {
  address = {};
  address.sun_family = AF_UNIX;
  size_t length = std::min(name.size(), sizeof(address.sun_path) - 1);
  std::memcpy(address.sun_path + 1, name.data(), length);
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + length);
}

std::string random_name() {
  std::random_device device;
  std::string name = "lockstep/";
  static const char kHex[] = "0123456789abcdef";
  for (int i = 0; i < 32; ++i) {
    name += kHex[device() % 16];
  }
  return name;
}

bool peer_of(int socket, ucred& credentials) {
  socklen_t length = sizeof(credentials);
  return ::getsockopt(socket, SOL_SOCKET, SO_PEERCRED, &credentials, &length) == 0;
}

// One byte, with room for one descriptor beside it.
struct FdMessage {
  char byte = 0;
  iovec payload{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr message{};

  FdMessage() {
    message.msg_iov = &payload;
    message.msg_iovlen = 1;
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;
};

int milliseconds_until(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::max<int64_t>(0, left.count()));
}

} // namespace

FdOffer::FdOffer(std::string& failure) {
  listener_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  name_ = random_name();
  sockaddr_un address{};
  socklen_t length = address_of(name_, address);
  if (listener_ < 0 || ::bind(listener_, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
      ::listen(listener_, 64) != 0) {
    failure = str("cannot open a socket to hand the shared segment over: ",
                  std::strerror(errno));
  }
}

FdOffer::~FdOffer() {
  if (listener_ >= 0) {
    ::close(listener_);
  }
}

std::vector<int> FdOffer::serve(int fd,
                                std::vector<int> pids,
                                Clock::time_point deadline,
                                const std::function<bool()>& keep_serving) {
  while (!pids.empty() && Clock::now() < deadline && keep_serving()) {
    pollfd waiting{listener_, POLLIN, 0};
    if (::poll(&waiting, 1, std::min(50, milliseconds_until(deadline))) <= 0) {
      continue;
    }
    int client = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) {
      continue;
    }
    ucred credentials{};
    auto wanted = pids.end();
    if (peer_of(client, credentials) && credentials.uid == ::geteuid()) {
      wanted = std::find(pids.begin(), pids.end(), static_cast<int>(credentials.pid));
    }
    if (wanted != pids.end()) {
      FdMessage handed;
      cmsghdr* header = CMSG_FIRSTHDR(&handed.message);
      header->cmsg_level = SOL_SOCKET;
      header->cmsg_type = SCM_RIGHTS;
      header->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(header), &fd, sizeof(int));
      if (::sendmsg(client, &handed.message, MSG_NOSIGNAL) == 1) {
        pids.erase(wanted);
      }
    }
    ::close(client); // a stranger gets nothing but the closed connection
  }
  return pids;
}

int take_fd(const std::string& name,
            int expected_pid,
            Clock::time_point deadline,
            std::string& failure) {
  int socket = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  socklen_t length = address_of(name, address);
  if (socket < 0 || ::connect(socket, reinterpret_cast<sockaddr*>(&address), length) != 0) {
    failure = str("cannot reach the offer of the shared segment: ", std::strerror(errno));
    if (socket >= 0) {
      ::close(socket);
    }
    return -1;
  }
  ucred credentials{};
  if (!peer_of(socket, credentials) || static_cast<int>(credentials.pid) != expected_pid ||
      credentials.uid != ::geteuid()) {
    failure = str("the shared segment was offered by process ", credentials.pid, " (user ",
                  credentials.uid, "), not by the rank that creates it (pid ", expected_pid,
                  "): refused, since whoever writes to the store could offer one");
    ::close(socket);
    return -1;
  }
  int received = -1;
  pollfd waiting{socket, POLLIN, 0};
  if (::poll(&waiting, 1, milliseconds_until(deadline)) == 1) {
    FdMessage handed;
    if (::recvmsg(socket, &handed.message, MSG_CMSG_CLOEXEC) == 1) {
      cmsghdr* header = CMSG_FIRSTHDR(&handed.message);
      if (header != nullptr && header->cmsg_level == SOL_SOCKET &&
          header->cmsg_type == SCM_RIGHTS && header->cmsg_len == CMSG_LEN(sizeof(int))) {
        std::memcpy(&received, CMSG_DATA(header), sizeof(int));
      }
    }
  }
  ::close(socket);
  if (received < 0) {
    failure = "the rank that creates the shared segment did not hand it over in time";
  }
  return received;
}

} // namespace lockstep::detail
