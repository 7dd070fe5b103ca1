#pragma once

// Where the ledger keeps its records. Across hosts, in the store; for a job
// on one host, in a small file that every rank maps (a mapped word costs
// nothing to read, where the store is a round trip). The ledger's logic is
// the same over both.

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <c10/util/intrusive_ptr.h>

namespace c10d {
class Store;
} // namespace c10d

namespace lockstep::detail {

struct Closed {
  uint64_t completed = 0;
  bool failed = false;
  /// Why it gave up, where it knows more than the others can see: the
  /// peers it found gone (only a rank on their host can tell).
  std::string cause;
};

class LedgerBoard {
 public:
  virtual ~LedgerBoard() = default;
  /// Records that this rank reached collective `seq` to do `what`, before
  /// it returns (the others wait for it to compare: DETAIL).
  virtual void post(uint64_t seq, const std::string& what) = 0;
  /// Records that this rank reached collective `seq`, soon: a board whose
  /// every write is a round trip (the store's, across hosts) writes the
  /// latest from a thread of its own, at most every few hundred
  /// milliseconds, so that no collective waits on it. What a wait reads of
  /// the others is then that old at most; it names a rank late only after
  /// seconds.
  virtual void post_soon(uint64_t seq, const std::string& what) {
    post(seq, what);
  }
  /// Whether `rank` has reached collective `seq` (asked only of the last
  /// few collectives).
  virtual bool reached(int rank, uint64_t seq) = 0;
  /// What `rank` posted for `seq`, once it has.
  virtual std::optional<std::string> posted(int rank, uint64_t seq) = 0;
  /// Records that this rank will complete no collective after the first
  /// `count`: it closed its world, or gave up on it (`failed`: because of
  /// an error, `cause` when it knows which peer made it give up).
  virtual void close(uint64_t count, bool failed, const std::string& cause) = 0;
  /// The ranks that closed, each with its count and whether it failed.
  virtual std::map<int, Closed> closed() = 0;
};

/// How long a process of another host may fall silent before a wait names
/// it (its heartbeat timeout in the job's liveness, world/liveness.h,
/// unless fault tolerance declares its own).
constexpr auto kHeartbeatSilence = std::chrono::seconds(5);

/// Records as keys of `store` (already scoped to the world's ledger).
std::unique_ptr<LedgerBoard> make_store_board(c10::intrusive_ptr<c10d::Store> store,
                                             int rank,
                                             int size);

/// Records in the file at `path`, which every rank of the world creates
/// (or finds) with create_mapped_board, then maps.
std::unique_ptr<LedgerBoard> open_mapped_board(const std::string& path, int rank, int size);
void create_mapped_board(const std::string& path, int size);

} // namespace lockstep::detail
