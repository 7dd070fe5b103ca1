#include "fault/reachability.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>

#include <lockstep/error.h>

#include "common/wording.h"

namespace lockstep::detail {
namespace {

// How often the accepting thread looks whether it is to stop.
constexpr int kLookMs = 200;

std::string host_of(const std::string& endpoint) {
  return endpoint.substr(0, endpoint.rfind(':'));
}

// What a connection attempt says of a host.
enum class Answer { Pending, Reached, Cut };

// Whether a failed connection says the host is out of reach. A refusal is
// the host's own answer (a process that ended, not a cut): it is reached.
bool cut_by(int error) {
  return error == ETIMEDOUT || error == EHOSTUNREACH || error == ENETUNREACH;
}

// A non-blocking connection to `endpoint` under way (`fd`), or already
// answered. What fails here (an endpoint that does not parse, no socket
// left) says nothing of the host: it counts as reached.
Answer start_connecting(const std::string& endpoint, int& fd) {
  fd = -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  auto colon = endpoint.rfind(':');
  if (colon == std::string::npos ||
      ::inet_pton(AF_INET, endpoint.substr(0, colon).c_str(), &address.sin_addr) != 1) {
    return Answer::Reached;
  }
  address.sin_port = htons(static_cast<uint16_t>(std::atoi(endpoint.c_str() + colon + 1)));
  fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return Answer::Reached;
  }
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 ||
      errno == EINPROGRESS) {
    return Answer::Pending;
  }
  int error = errno;
  ::close(fd);
  fd = -1;
  return cut_by(error) ? Answer::Cut : Answer::Reached;
}

bool said_cut(const Member& by, const Member& of) {
  return std::find(by.cut_off.begin(), by.cut_off.end(), of.replica) != by.cut_off.end();
}

} // namespace

ProbeListener::ProbeListener(const std::string& address) {
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  LOCKSTEP_ENFORCE(fd_ >= 0, FaultToleranceError, "cannot open the socket that other ranks "
                   "probe to tell whether they reach this one: ", std::strerror(errno));
  sockaddr_in any{};
  any.sin_family = AF_INET;
  any.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t length = sizeof(any);
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&any), sizeof(any)) != 0 ||
      ::listen(fd_, SOMAXCONN) != 0 ||
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(&any), &length) != 0) {
    int error = errno;
    ::close(fd_);
    LOCKSTEP_FAIL(FaultToleranceError, "cannot listen for the probes of other ranks: ",
                  std::strerror(error));
  }
  endpoint_ = str(address, ":", ntohs(any.sin_port));
  accepting_ = std::thread([this] {
    while (!stopping_) {
      pollfd ready{fd_, POLLIN, 0};
      if (::poll(&ready, 1, kLookMs) > 0) {
        int connection = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (connection >= 0) {
          ::close(connection); // reached: that is all a probe asks
        } else if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
          // No descriptor left (EMFILE): the kernel has answered the
          // prober already; look again later rather than spin.
          std::this_thread::sleep_for(std::chrono::milliseconds(kLookMs));
        }
      }
    }
  });
}

ProbeListener::~ProbeListener() {
  stopping_ = true;
  accepting_.join();
  ::close(fd_);
}

std::vector<int> unreachable_members(const std::vector<Member>& members, const Member& me,
                                     std::chrono::milliseconds timeout) {
  const std::string my_host = host_of(me.probe);
  // One connection per other host, to one of its members: which one, by
  // this rank's number, so that a thousand ranks probing at once spread
  // over a host's listeners instead of filling one's backlog.
  std::map<std::string, std::vector<std::string>> endpoints_of_host;
  for (const auto& member : members) {
    auto host = host_of(member.probe);
    if (!member.probe.empty() && host != my_host) {
      endpoints_of_host[host].push_back(member.probe);
    }
  }
  std::map<std::string, std::string> endpoint_of_host;
  for (const auto& [host, endpoints] : endpoints_of_host) {
    endpoint_of_host[host] = endpoints[static_cast<size_t>(me.replica) % endpoints.size()];
  }
  struct Attempt {
    int fd = -1;
    Answer answer = Answer::Pending;
  };
  std::map<std::string, Attempt> attempts;
  for (const auto& [host, endpoint] : endpoint_of_host) {
    auto& attempt = attempts[host];
    attempt.answer = start_connecting(endpoint, attempt.fd);
  }
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    std::vector<pollfd> waiting;
    std::vector<Attempt*> of;
    for (auto& [host, attempt] : attempts) {
      if (attempt.answer == Answer::Pending) {
        waiting.push_back({attempt.fd, POLLOUT, 0});
        of.push_back(&attempt);
      }
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (waiting.empty() || left.count() <= 0) {
      break;
    }
    if (::poll(waiting.data(), waiting.size(), static_cast<int>(left.count())) <= 0) {
      continue; // interrupted, or the deadline: looked at next time round
    }
    for (size_t k = 0; k < waiting.size(); ++k) {
      if (waiting[k].revents == 0) {
        continue;
      }
      int error = 0;
      socklen_t length = sizeof(error);
      ::getsockopt(waiting[k].fd, SOL_SOCKET, SO_ERROR, &error, &length);
      of[k]->answer = cut_by(error) ? Answer::Cut : Answer::Reached;
    }
  }
  std::set<std::string> cut_hosts; // what did not answer within `timeout`, too
  for (auto& [host, attempt] : attempts) {
    if (attempt.fd >= 0) {
      ::close(attempt.fd);
    }
    if (attempt.answer != Answer::Reached) {
      cut_hosts.insert(host);
    }
  }
  std::vector<int> unreachable;
  for (const auto& member : members) {
    if (member.replica != me.replica && cut_hosts.count(host_of(member.probe))) {
      unreachable.push_back(member.replica);
    }
  }
  return unreachable;
}

std::vector<std::vector<Member>> reachable_sides(std::vector<Member> candidates) {
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Member& a, const Member& b) { return a.replica < b.replica; });
  std::vector<std::vector<Member>> sides;
  for (const auto& seed : candidates) {
    bool placed = std::any_of(sides.begin(), sides.end(), [&](const std::vector<Member>& side) {
      return std::any_of(side.begin(), side.end(),
                         [&](const Member& m) { return m.replica == seed.replica; });
    });
    if (placed) {
      continue;
    }
    std::vector<Member> side{seed};
    for (const auto& candidate : candidates) {
      bool reaches_all = candidate.replica != seed.replica &&
          std::none_of(side.begin(), side.end(), [&](const Member& k) {
            return said_cut(candidate, k) || said_cut(k, candidate);
          });
      if (reaches_all) {
        side.push_back(candidate);
      }
    }
    std::stable_sort(side.begin(), side.end(),
                     [](const Member& a, const Member& b) { return a.replica < b.replica; });
    sides.push_back(std::move(side));
  }
  return sides;
}

} // namespace lockstep::detail
