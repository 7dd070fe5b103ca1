#pragma once

// Hands an open file from one process to chosen others: a Unix socket in
// the abstract namespace (no file to plant or leave behind) carries it with
// SCM_RIGHTS, and each side checks who is at the other end (SO_PEERCRED):
// the expected process ids, known from rendezvous, and this user. A name
// read from the store only says where to knock; whoever answers there, or
// knocks, is not trusted for it.

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace lockstep::detail {

class FdOffer {
 public:
  /// Listens under a fresh random name; `failure` says why not.
  explicit FdOffer(std::string& failure);
  ~FdOffer();
  FdOffer(const FdOffer&) = delete;
  FdOffer& operator=(const FdOffer&) = delete;

  /// The name to publish.
  const std::string& name() const {
    return name_;
  }

  /// Hands `fd` to each process of `pids` that asks before `deadline`,
  /// turning away any other; between looks, stops early when
  /// `keep_serving` returns false (it may also throw). Returns the pids
  /// that were not served.
  std::vector<int> serve(int fd,
                         std::vector<int> pids,
                         std::chrono::steady_clock::time_point deadline,
                         const std::function<bool()>& keep_serving);

 private:
  int listener_ = -1;
  std::string name_;
};

/// Takes the file offered under `name`, if the process offering it is
/// `expected_pid` of this user; -1 and `failure` otherwise.
int take_fd(const std::string& name,
            int expected_pid,
            std::chrono::steady_clock::time_point deadline,
            std::string& failure);

} // namespace lockstep::detail
