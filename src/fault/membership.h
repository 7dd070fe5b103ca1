#pragma once

// Who trains, agreed through the job's store (store/server.h). Each world
// of a fault-tolerant job is an epoch; its members are decided once, by a
// compare-and-set whose first proposal stands, and every rank reads the
// same answer. The steps of an epoch make no store operation: whether one
// counts is agreed in the epoch's own world (fault_tolerance.cpp).
//
// Keys, under the job's prefix and "ft/":
//   epoch                the latest epoch decided, its members and the
//                        lineage: epoch E is decided by a compare-and-set
//                        over E-1's value, so epochs are totally ordered
//                        and a world forms only from the latest; once its
//                        world formed and holds the live state, a member
//                        marks it formed by a second compare-and-set over
//                        the same key (any member: no one writer's death
//                        can lose the mark), and the lineage is E from then
//   e<E>/members         a copy of epoch E's decision, for those who wait
//   e<E>/arrive/<slot>   a member record: who wants to train in epoch E
//   e<E>/abandoned       why epoch E was given up
//   e<E>/state/<slot>    the digest of the live state that launcher rank
//                        <slot> sent in epoch E (over replica groups, a
//                        sender per place)
//   finished             "ended" once a rank exited with 0 (lockstep-run
//                        writes it): a rank restarted later has nothing to
//                        rejoin
//   left/<slot>/<incarnation>   "left": that restarted rank found so;
//                        "crashed after the loop": and its earlier
//                        incarnation was a member of the last world, so it
//                        failed after the loop (the job fails)
// Bounded: an epoch's keys go two epochs later; the rest is one key each.
//
// With a job secret, every value a rank acts on ends with "\nproof HMAC"
// over what it claims and where (the epoch), bound to the job's
// nonce; a value that does not verify is refused with FaultToleranceError,
// never acted on. Without one, any process that reaches the store could
// write them (docs/world.md#security).

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "world/process_identity.h"

namespace lockstep::store {
class StoreClient;
} // namespace lockstep::store

namespace lockstep::detail {

/// A process that takes part, as it announced itself for an epoch.
struct Member {
  /// Its launcher rank: the slot that lockstep-run refills.
  int replica = 0;
  int incarnation = 0;
  /// Committed steps of the state it holds; -1: none (restarted).
  int64_t step = -1;
  /// The last epoch it trained in (-1: none): the state of the latest one
  /// (the lineage) is the live state.
  int64_t trained = -1;
  /// Where the others check that they reach it ("address:port" of its
  /// ProbeListener; empty on one host, where no cut falls between ranks).
  std::string probe;
  /// The launcher ranks it could not reach when it came (after a world
  /// that did not form): the decider leaves one side of each such pair out
  /// (reachability.h).
  std::vector<int> cut_off;
  ProcessIdentity identity;

  std::string to_record() const;
  static Member from_record(const std::string& record);
  /// "rank 2 (incarnation 1, pid 4242 on host)".
  std::string describe() const;
};

/// "rank 2" or "ranks 0, 2" (launcher ranks).
std::string describe(const std::vector<Member>& members);
/// The first line of an error's text, for one-line decisions and logs.
std::string first_line(const std::string& text);

/// The member of `decided` whose state is the live one: of the latest
/// lineage it trained in, at the most steps; -1 if none holds state.
int live_state_source(const std::vector<Member>& decided);
/// Whether `member` must receive the live state of `source`: it has none,
/// fewer steps, or it trained in an older world (stopped while the others
/// went on), even at the same step.
bool behind(const Member& member, const Member& source);

/// Proves and checks claims with the job's secret (WorldAccess::prove):
/// "-" and always true without one.
struct Signer {
  std::function<std::string(const std::string& claim)> prove;
  std::function<bool(const std::string& claim, const std::string& proof)> proven;
  /// Whether there is a secret (without one every proof holds).
  bool secured = false;
};

/// An epoch as decided: its number (-1 before the first) and members, and
/// the stored value that the next decision must find.
struct Epoch {
  int64_t number = -1;
  /// The latest epoch whose world formed (its members hold the trained
  /// state): `number` once marked formed, before that the lineage of the
  /// epoch it was decided over; -1 before the first.
  int64_t lineage = -1;
  std::vector<Member> members;
  std::string stored;

  bool formed() const { return number >= 0 && lineage == number; }
};

/// The store operations of the protocol, through one connection. A store
/// that does not answer raises FaultToleranceError ("lost the job's store").
class Membership {
 public:
  /// `prefix`: the job's key prefix (JobStore::key_prefix). `patience`:
  /// how long a rank that has read no epoch yet waits for a genuine latest
  /// one where the store holds one without a valid proof (a member that
  /// reads it writes the genuine one back).
  Membership(std::unique_ptr<store::StoreClient> client, const std::string& prefix,
             Signer signer, std::chrono::milliseconds patience = std::chrono::seconds(60));
  ~Membership();

  /// The latest epoch. One without a valid proof, or older than one this
  /// rank read (an old signed value put back), is ignored and logged: this
  /// rank writes back the latest it read over it, or, having read none,
  /// waits `patience` for a member to, calling `waiting` once a second
  /// meanwhile (to ask the members to come: in steady state they read
  /// nothing). A second decision for an epoch it acted on, or a lineage
  /// that went back in a later epoch (the epochs forked), or none where it
  /// read one, raises FaultToleranceError.
  Epoch latest(const std::function<void()>& waiting = nullptr);
  /// Proposes `members` for the epoch after `after` (the latest read);
  /// returns the latest after the attempt: this proposal, another one for
  /// the same epoch, or a later epoch.
  Epoch decide(const Epoch& after, const std::vector<Member>& members);
  /// Epoch `epoch`'s members once decided, within `wait`.
  std::optional<std::vector<Member>> await_members(int64_t epoch, std::chrono::milliseconds wait);

  void arrive(int64_t epoch, const Member& me);
  /// Those that arrived for `epoch`, with their proofs checked (one read).
  std::vector<Member> arrivals(int64_t epoch);
  /// Until each of `members` has arrived for `epoch` (one wait, answered by
  /// the store at the last arrival), at most `wait`.
  bool await_arrivals(int64_t epoch, const std::vector<Member>& members,
                      std::chrono::milliseconds wait);
  /// Marks `epoch` as given up (the first reason stays); returns it, and
  /// in `first` whether it was this call's. A reason without a valid proof
  /// is ignored (logged) and replaced.
  std::string abandon(int64_t epoch, const std::string& why, bool* first = nullptr);
  /// Why `epoch` was given up, if it was (a reason without a valid proof
  /// is ignored, and logged).
  std::optional<std::string> abandoned(int64_t epoch);
  /// Deletes the keys of an epoch that nobody uses any more.
  void retire(int64_t epoch);
  /// Retires every epoch up to `epoch` not retired yet; returns them.
  std::vector<int64_t> retire_through(int64_t epoch);

  /// The sender of the live state in `epoch` says what it sent.
  void announce_state(int64_t epoch, int source, int64_t step, const std::string& digest);
  /// What the sender of the live state in `epoch` announced it sent
  /// (state_claim), once it has, awaited at most `wait`; nullopt until then.
  /// A value without a valid proof is ignored (and logged): the
  /// sender's own overwrites it.
  std::optional<std::string> announced_state(int64_t epoch, int source,
                                             std::chrono::milliseconds wait);
  /// What a sender announces: its launcher rank, the step, the digest.
  static std::string state_claim(int source, int64_t step, const std::string& digest);
  /// How often the job's store has moved under this connection
  /// (StoreClient::moves): what was written to an earlier store may be gone.
  int store_moves() const;

  /// Marks `epoch` formed: its world formed and every member holds the
  /// live state. Returns false when a later epoch was decided meanwhile
  /// (this world is given up: it must not train).
  bool mark_formed(int64_t epoch);
  /// The latest epoch that formed (Epoch::lineage of the latest).
  int64_t lineage();

  /// Whether the job's loop has ended (a rank exited with 0).
  bool finished();
  /// Records that this restarted rank found the loop ended: `why` is
  /// kLeft (lockstep-run then counts its exit as no failure) or
  /// kCrashedAfterLoop (its earlier incarnation was in the last world: the
  /// job fails).
  void left(int replica, int incarnation, const char* why);

  /// The claim a signed value proves ("<prefix><what>|<body>": bound to
  /// the job's attempt by its key prefix), and the value.
  std::string sign(const std::string& what, const std::string& body) const;

 private:
  std::string claim(const std::string& what, const std::string& body) const;
  /// The body of a signed value whose proof holds; nullopt for one without
  /// a proof or with a false one.
  std::optional<std::string> proven_body(const std::string& what, const std::string& value) const;

  std::unique_ptr<store::StoreClient> client_;
  std::string prefix_; // "<job prefix>/ft/"
  Signer signer_;
  std::string epoch_value(int64_t number, int64_t lineage, const std::vector<Member>& members) const;
  /// A stored latest epoch; nullopt for one without a valid proof.
  std::optional<Epoch> parse_epoch(const std::string& value) const;
  /// Logs, once per value, that `value` of `key` is ignored, and why.
  void note_ignored(const std::string& key, const std::string& value, const std::string& why);
  /// `held_` written over `value`, the stored latest epoch, where that is
  /// older, unproven or none (after the store moved, StoreClient::moves;
  /// or one latest() ignores), by up to `attempts` compare-and-sets;
  /// returns the latest after. Logs `why`, if any, where it wrote.
  std::optional<std::string> write_back(std::optional<std::string> value,
                                        const std::string& why, int attempts = 8);
  /// Whether `epoch` is older than the latest this rank read.
  bool older_than_held(const Epoch& epoch) const;

  // The highest epoch and lineage read: a value that goes back is an old
  // signed value put back by a store writer, and is refused.
  int64_t highest_epoch_ = -1;
  int64_t highest_lineage_ = -1;
  // The stored value of the highest read, and the client's moves then.
  std::string held_;
  int moves_seen_ = 0;
  std::chrono::milliseconds patience_;
  // The last value logged as ignored.
  std::string ignored_;
};

/// Leaves a job whose loop has ended (Membership::finished), as
/// incarnation `incarnation` of launcher rank `replica`, restarted: where an
/// earlier incarnation of it was a member of the last world, that one
/// failed after the loop, and the job fails (kCrashedAfterLoop); otherwise
/// it has nothing to rejoin (kLeft). Raises FaultToleranceError saying so.
[[noreturn]] void leave_ended_job(Membership& membership, int replica, int incarnation);

/// The values lockstep-run writes and reads (tools/lockstep-run).
constexpr const char* kFinished = "ended";
constexpr const char* kLeft = "left";
constexpr const char* kCrashedAfterLoop = "crashed after the loop";

std::string epoch_key(int64_t epoch, const std::string& key);

} // namespace lockstep::detail
