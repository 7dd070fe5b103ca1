#pragma once

// Which ranks can reach which, for a network cut that leaves the job's
// store reachable: heartbeats go on, so every rank looks alive, yet the
// world of all of them never forms. A rank that could not form a world
// probes the others (a TCP connection to a listener each rank keeps, one
// per host), and says whom it cannot reach when it comes for the next
// epoch; the rank that decides splits those that came into sides that
// reach one another and chooses one to train on (the one that holds the
// live state, is large enough, is furthest on, is largest, holds the
// lowest rank), and the others wait until they reach it again.

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "fault/membership.h"

namespace lockstep::detail {

/// Accepts and closes connections on a port of its own, on every address
/// of this host: whoever connects reaches this host (the kernel completes
/// the connection even while this process computes).
class ProbeListener {
 public:
  /// `address`: where the others connect, as this host's transport is
  /// reached (WorldAccess::local_address).
  explicit ProbeListener(const std::string& address);
  ~ProbeListener();
  ProbeListener(const ProbeListener&) = delete;
  ProbeListener& operator=(const ProbeListener&) = delete;

  /// "address:port".
  const std::string& endpoint() const { return endpoint_; }

 private:
  int fd_ = -1;
  std::string endpoint_;
  std::atomic<bool> stopping_{false};
  std::thread accepting_;
};

/// The launcher ranks of `members` (other than `me`) whose probe endpoint
/// this process cannot connect to within `timeout`: one connection per
/// host (all of a host's members share its verdict), all at once. Members
/// on this rank's host, and those without an endpoint, count as reached.
std::vector<int> unreachable_members(const std::vector<Member>& members, const Member& me,
                                     std::chrono::milliseconds timeout);

/// The sides `candidates` fall into, each in rank order: from the lowest
/// rank not yet on a side, every candidate that reaches all those taken
/// before it, where reaching fails if either of a pair said it could not
/// reach the other (Member::cut_off). Without a cut, one side: everyone.
/// The decider chooses one (Agreement::next_epoch).
std::vector<std::vector<Member>> reachable_sides(std::vector<Member> candidates);

} // namespace lockstep::detail
