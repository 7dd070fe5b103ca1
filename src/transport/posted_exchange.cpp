#include "transport/posted_exchange.h"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

#include <ATen/ATen.h>
#include <lockstep/error.h>
// 2.x: Backend.hpp comes with it.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace lockstep::detail {
namespace {

// One message as one piece of a few MiB made a 1 Gbit/s link carry 8 MiB
// at 0.6 Gbit/s; pieces of 512 KiB keep it full.
constexpr int64_t kPieceBytes = 512 << 10;
// A tag holds the exchange's number and the piece's: at most 2^10 pieces
// (larger pieces past 512 MiB), 2^21 exchanges before the numbers repeat,
// which no two exchanges in flight at once come near.
constexpr int kPieceBits = 10;
constexpr uint64_t kExchangeNumbers = uint64_t{1} << 21;

class PostedExchange : public TransportWork {
 public:
  // `messages` holds `per_piece` messages for each piece in `pieces`.
  PostedExchange(std::vector<c10::intrusive_ptr<c10d::Work>> messages,
                 size_t per_piece,
                 std::vector<std::pair<int64_t, int64_t>> pieces,
                 PieceArrived arrived)
      : messages_(std::move(messages)) {
    // Gloo's point-to-point works have no future: a thread waits on them
    // in the order they were posted, which is the order they complete in,
    // and reduces each piece as it completes.
    waiter_ = std::thread([this, per_piece, pieces = std::move(pieces),
                           arrived = std::move(arrived)] {
      std::exception_ptr failure;
      size_t completed = 0;
      try {
        for (const auto& [first, length] : pieces) {
          for (size_t m = 0; m < per_piece; ++m) {
            if (!messages_[completed]->wait()) {
              throw CollectiveError("a point-to-point exchange was abandoned");
            }
            ++completed;
          }
          arrived(first, length);
          std::lock_guard<std::mutex> lock(mutex_);
          completed_ = completed;
        }
      } catch (...) {
        failure = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex_);
      failure_ = failure;
      done_ = true;
      completed_ns_ = steady_now_ns();
      done_changed_.notify_all();
    });
  }

  ~PostedExchange() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!done_ || failure_) { // what is still posted must not outlive its tensors
        for (auto& message : messages_) {
          message->abort();
        }
      }
    }
    waiter_.join();
  }

  bool wait_for(std::chrono::milliseconds slice) override {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!done_changed_.wait_for(lock, slice, [&] { return done_; })) {
        return false;
      }
      if (failure_) {
        std::rethrow_exception(failure_);
      }
    }
    return true;
  }

  std::string stall() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_) {
      try {
        std::rethrow_exception(failure_);
      } catch (const std::exception& e) {
        return describe_exception(e);
      }
    }
    return std::to_string(messages_.size() - completed_) + " of its " +
        std::to_string(messages_.size()) + " point-to-point messages had not completed";
  }

  int64_t completed_ns() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return completed_ns_;
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> messages_;
  mutable std::mutex mutex_;
  std::condition_variable done_changed_;
  bool done_ = false;
  size_t completed_ = 0;
  std::exception_ptr failure_;
  int64_t completed_ns_ = 0;
  std::thread waiter_;
};

} // namespace

std::unique_ptr<TransportWork> start_posted_exchange(CollectiveBackend& group,
                                                     const at::Tensor& mine,
                                                     const std::vector<at::Tensor>& parts,
                                                     uint64_t exchange,
                                                     PieceArrived arrived) {
  int rank = group.getRank();
  int ranks = group.getSize();
  int64_t bytes = mine.numel() * mine.element_size();
  int64_t piece_bytes = std::max(kPieceBytes, (bytes >> kPieceBits) + 1);
  int64_t piece = std::max<int64_t>(1, piece_bytes / mine.element_size());
  int tag_base = static_cast<int>((exchange % kExchangeNumbers) << kPieceBits);
  std::vector<c10::intrusive_ptr<c10d::Work>> messages;
  std::vector<std::pair<int64_t, int64_t>> pieces;
  for (int64_t first = 0; first < mine.numel(); first += piece) {
    int64_t length = std::min(piece, mine.numel() - first);
    int tag = tag_base + static_cast<int>(pieces.size());
    // Each rank begins with its right-hand neighbour, so that no rank is
    // every rank's first destination.
    for (int step = 1; step < ranks; ++step) {
      int peer = (rank + step) % ranks;
      messages.push_back(start_recv(group, parts[peer].narrow(0, first, length), peer, tag));
      messages.push_back(start_send(group, mine.narrow(0, first, length), peer, tag));
    }
    pieces.emplace_back(first, length);
  }
  return std::make_unique<PostedExchange>(std::move(messages), 2 * (ranks - 1),
                                          std::move(pieces), std::move(arrived));
}

} // namespace lockstep::detail
