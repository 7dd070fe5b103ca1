#pragma once

// An endpoint that never answers, as a host behind a cut: a listener
// whose accept queue is full, so that the kernel drops further connection
// requests unanswered (Linux, tcp_abort_on_overflow off as by default).

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace lockstep::testing {

class Silent {
 public:
  Silent() {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    ::inet_pton(AF_INET, "127.0.0.4", &address.sin_addr); // a host of its own
    socklen_t length = sizeof(address);
    ::bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof(address));
    ::listen(listener_, 0);
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length);
    endpoint_ = "127.0.0.4:" + std::to_string(ntohs(address.sin_port));
    for (int k = 0; k < 2; ++k) { // queue full: 1 more than the backlog
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
      ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
      fillers_.push_back(fd);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100)); // the handshakes done
  }
  ~Silent() {
    for (int fd : fillers_) {
      ::close(fd);
    }
    ::close(listener_);
  }
  const std::string& endpoint() const { return endpoint_; }

 private:
  int listener_ = -1;
  std::vector<int> fillers_;
  std::string endpoint_;
};

} // namespace lockstep::testing
