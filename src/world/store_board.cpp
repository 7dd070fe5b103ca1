#include <torch/csrc/distributed/c10d/Store.hpp>

#include "compat/c10d.h"
#include "world/ledger_board.h"

namespace lockstep::detail {
namespace {

// Records older than this many collectives are removed: enough for every
// bucket of an iteration to be in flight at once.
constexpr uint64_t kKept = 64;

constexpr const char* kClosedCount = "closed_count";

std::string arrived_key(uint64_t seq, int rank) {
  return "arrived/" + std::to_string(seq) + "/" + std::to_string(rank);
}

std::string closed_key(int rank) {
  return "closed/" + std::to_string(rank);
}

class StoreBoard : public LedgerBoard {
 public:
  StoreBoard(c10::intrusive_ptr<c10d::Store> store, int rank, int size)
      : store_(std::move(store)), rank_(rank), size_(size) {}

  void post(uint64_t seq, const std::string& what) override {
    store_set(*store_, arrived_key(seq, rank_), what);
    if (seq > kKept) {
      store_->deleteKey(arrived_key(seq - kKept, rank_));
    }
  }

  bool reached(int rank, uint64_t seq) override {
    return store_->check({arrived_key(seq, rank)});
  }

  std::optional<std::string> posted(int rank, uint64_t seq) override {
    if (!reached(rank, seq)) {
      return std::nullopt;
    }
    auto bytes = store_->get(arrived_key(seq, rank));
    return std::string(bytes.begin(), bytes.end());
  }

  void close(uint64_t count, bool failed) override {
    if (closed_here_) {
      return;
    }
    closed_here_ = true;
    auto text = std::to_string(count) + (failed ? " failed" : "");
    store_set(*store_, closed_key(rank_), text);
    store_->add(kClosedCount, 1);
  }

  std::map<int, Closed> closed() override {
    // One round trip while no rank has closed, which is almost always.
    std::map<int, Closed> ranks;
    if (store_->add(kClosedCount, 0) == 0) {
      return ranks;
    }
    for (int rank = 0; rank < size_; ++rank) {
      if (store_->check({closed_key(rank)})) {
        auto bytes = store_->get(closed_key(rank));
        std::string text(bytes.begin(), bytes.end());
        ranks[rank] = {std::stoull(text), text.find("failed") != std::string::npos};
      }
    }
    return ranks;
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int size_;
  bool closed_here_ = false;
};

} // namespace

std::unique_ptr<LedgerBoard> make_store_board(
    c10::intrusive_ptr<c10d::Store> store, int rank, int size) {
  return std::make_unique<StoreBoard>(std::move(store), rank, size);
}

} // namespace lockstep::detail
