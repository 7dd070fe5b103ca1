#include <torch/csrc/distributed/c10d/Store.hpp>

#include "compat/c10d.h"
#include "world/ledger_board.h"

namespace lockstep::detail {
namespace {

// What DETAIL compares: the last few posts of each rank, in a ring of keys
// overwritten in turn (every rank waits for all before each collective, so
// two would do).
constexpr uint64_t kRing = 64;

constexpr const char* kClosedCount = "closed_count";

// How many collectives a rank has reached: a counter, so that whether it
// reached one is known however many newer ones there are.
std::string reached_key(int rank) {
  return "reached/" + std::to_string(rank);
}

std::string posted_key(uint64_t seq, int rank) {
  return "posted/" + std::to_string(seq % kRing) + "/" + std::to_string(rank);
}

std::string closed_key(int rank) {
  return "closed/" + std::to_string(rank);
}

class StoreBoard : public LedgerBoard {
 public:
  StoreBoard(c10::intrusive_ptr<c10d::Store> store, int rank, int size)
      : store_(std::move(store)), rank_(rank), size_(size) {}

  void post(uint64_t seq, const std::string& what) override {
    store_set(*store_, posted_key(seq, rank_), std::to_string(seq) + " " + what);
    store_->add(reached_key(rank_), 1);
  }

  bool reached(int rank, uint64_t seq) override {
    return static_cast<uint64_t>(store_->add(reached_key(rank), 0)) >= seq;
  }

  std::optional<std::string> posted(int rank, uint64_t seq) override {
    auto key = posted_key(seq, rank);
    if (!store_->check({key})) {
      return std::nullopt;
    }
    auto bytes = store_->get(key);
    std::string text(bytes.begin(), bytes.end());
    std::string prefix = std::to_string(seq) + " ";
    if (text.rfind(prefix, 0) != 0) {
      return std::nullopt; // an older post, or a newer one
    }
    return text.substr(prefix.size());
  }

  void close(uint64_t count, bool failed, const std::string& cause) override {
    if (closed_here_) {
      return;
    }
    closed_here_ = true;
    auto text = std::to_string(count) + (failed ? " failed" : "") +
        (cause.empty() ? "" : "\n" + cause);
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
        auto line_end = text.find('\n');
        std::string head = text.substr(0, line_end);
        ranks[rank] = {std::stoull(head), head.find("failed") != std::string::npos,
                       line_end == std::string::npos ? "" : text.substr(line_end + 1)};
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

std::unique_ptr<LedgerBoard> make_store_board(c10::intrusive_ptr<c10d::Store> store,
                                             int rank,
                                             int size) {
  return std::make_unique<StoreBoard>(std::move(store), rank, size);
}

} // namespace lockstep::detail
