#include "store/endpoint.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace lockstep::store {
namespace {

using Clock = std::chrono::steady_clock;

bool unix_address(const std::string& path, sockaddr_un& address, std::string& error) {
  address = {};
  address.sun_family = AF_UNIX;
  if (path.size() >= sizeof(address.sun_path)) {
    error = "the socket path " + path + " is longer than the " +
        std::to_string(sizeof(address.sun_path) - 1) + " bytes a Unix socket allows (set "
        "TMPDIR to a shorter folder)";
    return false;
  }
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  return true;
}

void no_delay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Connects `fd` to `address`, waiting at most until `deadline`.
bool connect_within(int fd, const sockaddr* address, socklen_t length, Clock::time_point deadline,
                    std::string& error) {
  int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  bool connected = ::connect(fd, address, length) == 0;
  if (!connected && errno == EINPROGRESS) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    pollfd writable{fd, POLLOUT, 0};
    int status = 0;
    socklen_t size = sizeof(status);
    int wait = static_cast<int>(std::clamp<int64_t>(left.count(), 1, std::numeric_limits<int>::max()));
    if (::poll(&writable, 1, wait) == 1 &&
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &status, &size) == 0) {
      connected = status == 0;
      errno = status;
    } else {
      errno = ETIMEDOUT;
    }
  }
  if (!connected) {
    error = std::strerror(errno);
    return false;
  }
  ::fcntl(fd, F_SETFL, flags);
  return true;
}

} // namespace

Endpoint Endpoint::unix_socket(std::string path) {
  Endpoint endpoint;
  endpoint.kind = Kind::Unix;
  endpoint.path = std::move(path);
  return endpoint;
}

Endpoint Endpoint::tcp(std::string host, int port) {
  Endpoint endpoint;
  endpoint.kind = Kind::Tcp;
  endpoint.host = std::move(host);
  endpoint.port = port;
  return endpoint;
}

namespace {

Endpoint parse_one(const std::string& text) {
  if (text.rfind("unix:", 0) == 0 && text.size() > 5) {
    return Endpoint::unix_socket(text.substr(5));
  }
  auto colon = text.rfind(':');
  if (text.rfind("tcp:", 0) == 0 && colon > 4 && colon + 1 < text.size()) {
    auto digits = text.substr(colon + 1);
    int port = -1;
    if (digits.size() <= 5 && digits.find_first_not_of("0123456789") == std::string::npos) {
      port = std::stoi(digits);
    }
    if (port > 0 && port <= 65535) {
      return Endpoint::tcp(text.substr(4, colon - 4), port);
    }
  }
  throw std::invalid_argument("'" + text + "' is not a store endpoint (unix:PATH or "
                              "tcp:HOST:PORT)");
}

} // namespace

Endpoint Endpoint::parse(const std::string& text) {
  // Split only where another endpoint begins: a Unix socket's path may
  // hold a comma.
  auto next_one = [&](size_t from) {
    auto tcp = text.find(",tcp:", from);
    auto unix = text.find(",unix:", from);
    return std::min(tcp, unix);
  };
  auto comma = next_one(0);
  Endpoint endpoint = parse_one(text.substr(0, comma));
  while (comma != std::string::npos) {
    auto next = next_one(comma + 1);
    endpoint.successors.push_back(parse_one(text.substr(comma + 1, next - comma - 1)));
    comma = next;
  }
  return endpoint;
}

std::string Endpoint::to_string() const {
  std::string text = kind == Kind::Unix ? "unix:" + path : "tcp:" + host + ":" + std::to_string(port);
  for (const auto& successor : successors) {
    text += "," + successor.to_string();
  }
  return text;
}

std::string Endpoint::describe() const {
  return kind == Kind::Unix ? path : host + ":" + std::to_string(port);
}

std::vector<Endpoint> Endpoint::candidates() const {
  std::vector<Endpoint> all{*this};
  all[0].successors.clear();
  for (auto successor : successors) {
    successor.secret = secret;
    successor.successors.clear();
    all.push_back(std::move(successor));
  }
  return all;
}

int hold_loopback_port(int port, std::string& error) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::listen(fd, 1) != 0) {
    error = "bind 127.0.0.1:" + std::to_string(port) + ": " + std::strerror(errno);
    if (fd >= 0) {
      ::close(fd);
    }
    return -1;
  }
  return fd;
}

int listen_on(Endpoint& endpoint, std::string& error) {
  if (endpoint.kind == Endpoint::Kind::Unix) {
    sockaddr_un address{};
    if (!unix_address(endpoint.path, address, error)) {
      return -1;
    }
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    ::unlink(endpoint.path.c_str());
    if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
        ::listen(fd, 4096) != 0) {
      error = "listen on " + endpoint.path + ": " + std::strerror(errno);
      if (fd >= 0) {
        ::close(fd);
      }
      return -1;
    }
    return fd;
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  std::string port = std::to_string(endpoint.port);
  int status = ::getaddrinfo(endpoint.host.empty() ? nullptr : endpoint.host.c_str(),
                             port.c_str(), &hints, &found);
  if (status != 0 || found == nullptr) {
    error = "resolve " + endpoint.describe() + ": " + ::gai_strerror(status);
    return -1;
  }
  int fd = -1;
  std::string cause;
  for (addrinfo* candidate = found; candidate != nullptr && fd < 0;
       candidate = candidate->ai_next) {
    fd = ::socket(candidate->ai_family, candidate->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                  0);
    if (fd < 0) {
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, candidate->ai_addr, candidate->ai_addrlen) != 0 || ::listen(fd, 4096) != 0) {
      cause = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  if (fd < 0) {
    error = "bind " + endpoint.describe() + ": " + cause;
    return -1;
  }
  sockaddr_storage bound{};
  socklen_t length = sizeof(bound);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) == 0) {
    endpoint.port = ntohs(bound.ss_family == AF_INET6
                              ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                              : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  }
  return fd;
}

int connect_to(const Endpoint& endpoint, Clock::time_point deadline, std::string& error,
               bool retry) {
  auto pause = std::chrono::milliseconds(1);
  while (true) {
    int fd = -1;
    if (endpoint.kind == Endpoint::Kind::Unix) {
      sockaddr_un address{};
      if (!unix_address(endpoint.path, address, error)) {
        return -1;
      }
      fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd >= 0 && connect_within(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address),
                                    deadline, error)) {
        return fd;
      }
    } else {
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* found = nullptr;
      std::string port = std::to_string(endpoint.port);
      int status = ::getaddrinfo(endpoint.host.c_str(), port.c_str(), &hints, &found);
      if (status != 0 || found == nullptr) {
        error = std::string("cannot resolve ") + endpoint.host + ": " + ::gai_strerror(status);
        errno = EHOSTUNREACH; // no answer from a host, never a refusal (presence())
      }
      for (addrinfo* candidate = found; candidate != nullptr; candidate = candidate->ai_next) {
        fd = ::socket(candidate->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd >= 0 && connect_within(fd, candidate->ai_addr, candidate->ai_addrlen, deadline,
                                      error)) {
          no_delay(fd);
          break;
        }
        if (fd >= 0) {
          ::close(fd);
          fd = -1;
        }
      }
      if (found != nullptr) {
        ::freeaddrinfo(found);
      }
      if (fd >= 0) {
        return fd;
      }
    }
    if (fd >= 0) {
      ::close(fd);
    }
    if (!retry || Clock::now() + pause >= deadline) {
      return -1;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
}

Presence presence(const Endpoint& endpoint, std::chrono::milliseconds within) {
  std::string error;
  errno = 0;
  int fd = connect_to(endpoint, Clock::now() + within, error, /*retry=*/false);
  if (fd >= 0) {
    ::close(fd);
    return Presence::Listening;
  }
  // connect_within leaves the connection's own errno (ENOENT: no socket
  // file where a Unix store was).
  return errno == ECONNREFUSED || errno == ENOENT ? Presence::Refused : Presence::Silent;
}

} // namespace lockstep::store
