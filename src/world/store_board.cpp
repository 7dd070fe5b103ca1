#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>

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

// How often at most a rank's progress goes to the store when nothing
// waits for it: a few operations a second per rank, where a post per
// collective was two round trips on every collective's path.
constexpr auto kPostEvery = std::chrono::milliseconds(250);

class StoreBoard : public LedgerBoard {
 public:
  StoreBoard(c10::intrusive_ptr<c10d::Store> store, int rank, int size)
      : store_(std::move(store)), rank_(rank), size_(size) {}

  ~StoreBoard() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (poster_.joinable()) {
      poster_.join();
    }
  }

  void post(uint64_t seq, const std::string& what) override {
    std::lock_guard<std::mutex> lock(store_mutex_);
    store_set(*store_, posted_key(seq, rank_), std::to_string(seq) + " " + what);
    advance_to(seq);
  }

  void post_soon(uint64_t seq, const std::string& /*what*/) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_.empty()) {
      throw std::runtime_error(error_);
    }
    pending_ = seq;
    if (!poster_.joinable()) {
      poster_ = std::thread([this] { run_poster(); });
    }
    wake_.notify_one();
  }

  bool reached(int rank, uint64_t seq) override {
    std::lock_guard<std::mutex> lock(store_mutex_);
    return static_cast<uint64_t>(store_->add(reached_key(rank), 0)) >= seq;
  }

  std::optional<std::string> posted(int rank, uint64_t seq) override {
    auto key = posted_key(seq, rank);
    std::lock_guard<std::mutex> lock(store_mutex_);
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
    std::lock_guard<std::mutex> lock(store_mutex_);
    if (closed_here_) {
      return;
    }
    closed_here_ = true;
    // What this rank reached goes first, where it can: a reader of the
    // close reads it (the close itself matters more).
    uint64_t pending = 0;
    {
      std::lock_guard<std::mutex> state(mutex_);
      pending = pending_;
    }
    try {
      advance_to(pending);
    } catch (const std::exception&) {
    }
    auto text = std::to_string(count) + (failed ? " failed" : "") +
        (cause.empty() ? "" : "\n" + cause);
    store_set(*store_, closed_key(rank_), text);
    store_->add(kClosedCount, 1);
  }

  std::map<int, Closed> closed() override {
    std::lock_guard<std::mutex> lock(store_mutex_);
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
  // The reached counter, up to `seq` (never back: a late post of the
  // poster changes nothing after a newer one). Under store_mutex_.
  void advance_to(uint64_t seq) {
    if (seq > added_) {
      store_->add(reached_key(rank_), static_cast<int64_t>(seq - added_));
      added_ = seq;
    }
  }

  void run_poster() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      wake_.wait(lock, [&] { return stopping_ || pending_ > written_; });
      if (stopping_) {
        return;
      }
      uint64_t seq = pending_;
      written_ = seq;
      lock.unlock();
      std::string error;
      try {
        std::lock_guard<std::mutex> store_lock(store_mutex_);
        advance_to(seq);
      } catch (const std::exception& e) {
        error = e.what();
      }
      lock.lock();
      // While it fails, the next collective raises it (the store's host is
      // gone); the poster goes on, and posts again once the store answers.
      error_ = error;
      if (!error.empty()) {
        written_ = 0;
      }
      wake_.wait_for(lock, kPostEvery, [&] { return stopping_; });
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int size_;
  // Held for every use of store_, which two threads share.
  std::mutex store_mutex_;
  bool closed_here_ = false;
  uint64_t added_ = 0;
  // The poster's: the latest collective reached, and the latest written.
  std::mutex mutex_;
  std::condition_variable wake_;
  std::thread poster_;
  uint64_t pending_ = 0;
  uint64_t written_ = 0;
  bool stopping_ = false;
  std::string error_;
};

} // namespace

std::unique_ptr<LedgerBoard> make_store_board(c10::intrusive_ptr<c10d::Store> store,
                                             int rank,
                                             int size) {
  return std::make_unique<StoreBoard>(std::move(store), rank, size);
}

} // namespace lockstep::detail
