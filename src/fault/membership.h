#pragma once

// Who trains, agreed through the job's store. Each world of a fault-
// tolerant job is an epoch: its members are decided once, by the first
// rank to propose them (a compare-and-set), from the ranks that arrived
// for it; each of its steps is decided once the same way ("commit" when
// every member voted that its reduction held, "abort" as soon as one says
// otherwise). Whoever proposes, every rank reads the same answer.
//
// Keys, under the job's scope and "ft/":
//   e<E>/arrive/<rank>    a member record: who wants to train in epoch E
//   e<E>/wanting          how many asked (the last voter of epoch E-1 sees it)
//   e<E>/members          the decided members, one record per line
//   e<E>/abandoned        why epoch E was given up
//   e<E>/s<S>/votes       how many members' reductions of step S held
//   e<E>/s<S>/decision    "commit", "commit reform" or "abort <why>"
//   finished              the step at which a rank ended its loop
//   beat/<rank>           "<incarnation> <count>": the heartbeat (liveness.h)

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>

#include "world/process_identity.h"

namespace c10d {
class Store;
} // namespace c10d

namespace lockstep::detail {

/// A process that takes part, as it announced itself for an epoch.
struct Member {
  /// Its launcher rank: the slot that lockstep-run refills.
  int replica = 0;
  int incarnation = 0;
  /// Committed steps of the state it holds; -1: none (restarted).
  int64_t step = -1;
  /// Its proof of the job secret for this epoch ("-" without one).
  std::string proof = "-";
  ProcessIdentity identity;

  std::string to_record() const;
  static Member from_record(const std::string& record);
  /// "rank 2 (incarnation 1, pid 4242 on host)".
  std::string describe() const;
};

std::string epoch_key(int64_t epoch, const std::string& key);
std::string step_key(int64_t epoch, int64_t step, const std::string& key);

/// The store operations of the protocol, through one connection.
class Membership {
 public:
  explicit Membership(c10::intrusive_ptr<c10d::Store> store);

  void arrive(int64_t epoch, const Member& me);
  /// Those that arrived for `epoch`, of the ranks 0..slots-1.
  std::vector<Member> arrivals(int64_t epoch, int slots);
  bool wanted(int64_t epoch);
  /// The decided members of `epoch`, once decided.
  std::optional<std::vector<Member>> members(int64_t epoch);
  /// Proposes `members`; returns the decided ones (these or an earlier
  /// proposal).
  std::vector<Member> decide_members(int64_t epoch, const std::vector<Member>& members);
  /// The latest epoch known to be decided (a hint that only grows).
  int64_t latest_epoch();
  void note_latest_epoch(int64_t epoch);

  /// Counts this member's vote; returns the votes so far.
  int64_t vote(int64_t epoch, int64_t step);
  /// Proposes `decision` for the step; returns the decided one.
  std::string decide_step(int64_t epoch, int64_t step, const std::string& decision);
  std::optional<std::string> decision(int64_t epoch, int64_t step);

  /// Records that the loop ended, at `step`: a rank restarted later has
  /// nothing to rejoin.
  void finish(int64_t step);
  std::optional<int64_t> finished();

  /// Marks `epoch` as given up (the first reason stays); returns it.
  std::string abandon(int64_t epoch, const std::string& why);
  std::optional<std::string> abandoned(int64_t epoch);

  c10d::Store& store() {
    return *store_;
  }

 private:
  std::optional<std::string> read(const std::string& key);
  std::string compare_set(const std::string& key, const std::string& value);
  c10::intrusive_ptr<c10d::Store> store_;
};

} // namespace lockstep::detail
