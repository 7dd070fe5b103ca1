#pragma once

// Where the ledger keeps its records. Across hosts, in the store; for a job
// on one host, in a small file that every rank maps (the file store there
// would grow by a record per collective, and a mapped word costs nothing to
// read). The ledger's logic is the same over both.

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
  /// Records that this rank reached collective `seq` to do `what`.
  virtual void post(uint64_t seq, const std::string& what) = 0;
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
  /// How many heartbeats `rank` has sent, where the board carries them
  /// (across hosts, where a peer's pid cannot be checked): a count that
  /// stops is a rank stopped, or a host that this one can no longer reach.
  virtual std::optional<int64_t> heartbeats(int rank) {
    (void)rank;
    return std::nullopt;
  }
};

/// How often a rank sends a heartbeat, and how long a silent peer is given
/// before a wait names it.
constexpr auto kHeartbeatInterval = std::chrono::seconds(1);
constexpr auto kHeartbeatSilence = std::chrono::seconds(5);

/// Records as keys of `store` (already scoped to the job's ledger). With
/// `heartbeat_store`, a connection to the same store of its own, a thread
/// sends this rank's heartbeat through it every kHeartbeatInterval.
std::unique_ptr<LedgerBoard> make_store_board(
    c10::intrusive_ptr<c10d::Store> store,
    int rank,
    int size,
    c10::intrusive_ptr<c10d::Store> heartbeat_store = {});

/// Records in the file at `path`, which rank 0 created with
/// create_mapped_board and every rank maps.
std::unique_ptr<LedgerBoard> open_mapped_board(const std::string& path, int rank, int size);
void create_mapped_board(const std::string& path, int size);

} // namespace lockstep::detail
