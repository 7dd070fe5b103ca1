#include "transport/process_group_transport.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>

#include <ATen/ATen.h>
// 2.x: Backend.hpp comes with it.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "compat/c10d.h"
#include "timeline/recorder.h"
#include "transport/shm_reduce.h"

namespace lockstep::detail {
namespace {

constexpr int64_t kGatherPieceBytes = 4 << 20;

// Set by the backend's callbacks, which may outlive the work that waits.
struct Completion {
  std::mutex mutex;
  std::condition_variable done_changed;
  size_t remaining = 0;
  std::atomic<int64_t> ns{0};
};

// One collective, carried by one or more works of the backend.
class ProcessGroupWork : public TransportWork {
 public:
  // `finish` puts the result in place once every work has completed (a
  // copy back from the type the backend reduced, a sum of gathered parts),
  // in the thread that sees them complete.
  explicit ProcessGroupWork(std::vector<c10::intrusive_ptr<c10d::Work>> works,
                            std::function<void()> finish = nullptr)
      : works_(std::move(works)), finish_(std::move(finish)) {
    completion_->remaining = works_.size();
    // Waiting on the backend's completion, never on work.wait(slice): to
    // c10d a zero slice means no limit, and every slice that runs out
    // throws a c10::Error, which captures and symbolises a backtrace.
    for (auto& work : works_) {
      when_done(*work, [completion = completion_] {
        std::lock_guard<std::mutex> lock(completion->mutex);
        if (--completion->remaining == 0) {
          completion->ns.store(steady_now_ns());
          completion->done_changed.notify_all();
        }
      });
    }
  }
  explicit ProcessGroupWork(c10::intrusive_ptr<c10d::Work> work,
                            std::function<void()> finish = nullptr)
      : ProcessGroupWork(std::vector<c10::intrusive_ptr<c10d::Work>>{std::move(work)},
                         std::move(finish)) {}

  bool wait_for(std::chrono::milliseconds slice) override {
    {
      std::unique_lock<std::mutex> lock(completion_->mutex);
      if (!completion_->done_changed.wait_for(
              lock, slice, [&] { return completion_->remaining == 0; })) {
        return false;
      }
    }
    for (auto& work : works_) {
      wait_work(*work, kNoLimit); // completed, or failed: rethrows the backend's failure
    }
    if (finish_) {
      auto finish = std::move(finish_);
      finish_ = nullptr;
      finish();
    }
    return true;
  }

  std::string stall() override {
    for (auto& work : works_) {
      try {
        wait_work(*work, std::chrono::milliseconds(1));
      } catch (const std::exception& e) {
        return describe_exception(e);
      }
    }
    return "the backend completed it just now";
  }

  int64_t completed_ns() const override {
    return completion_->ns.load();
  }

 private:
  // c10d's "no timeout"; the work has completed when it is used.
  static constexpr std::chrono::milliseconds kNoLimit{0};

  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::function<void()> finish_;
  std::shared_ptr<Completion> completion_ = std::make_shared<Completion>();
};

} // namespace

at::Tensor Transport::allocate(int64_t numel, at::ScalarType dtype) {
  return at::zeros({numel}, at::TensorOptions().dtype(dtype));
}

ProcessGroupTransport::ProcessGroupTransport(c10::intrusive_ptr<CollectiveBackend> group,
                                             std::string name)
    : group_(std::move(group)), name_(std::move(name)) {}

std::unique_ptr<TransportWork> ProcessGroupTransport::all_reduce(const at::Tensor& tensor,
                                                                 ReduceOp op) {
  auto type = reduction_type(tensor);
  if (type == tensor.scalar_type()) {
    return std::make_unique<ProcessGroupWork>(start_all_reduce(*group_, tensor, op));
  }
  // A 16-bit sum. Gloo cannot add it in float32, so it travels either as
  // 16 bits, every rank's whole tensor gathered by every rank ((n - 1)
  // tensors of 16 bits out of each rank), or widened to float32 through
  // Gloo's ring (2 (n - 1) / n tensors of 32 bits): the first moves fewer
  // bytes up to 4 ranks. Either way each element is summed in float32 in
  // one order and rounded once, so every rank holds the same bits.
  int ranks = group_->getSize();
  if (op == ReduceOp::Sum && ranks <= 4) {
    auto flat = tensor.reshape({-1});
    std::vector<at::Tensor> parts;
    for (int rank = 0; rank < ranks; ++rank) {
      parts.push_back(at::empty_like(flat));
    }
    // In pieces: Gloo sends one gather's part as one message, which a
    // 1 Gbit/s link carried at 0.6 Gbit/s (8 MiB: 110 ms whole, 70 ms in
    // 16 pieces of 512 KiB). But each piece is a work of Gloo's, which a
    // rank busy with backward on its core runs a few ms late: 512 KiB
    // pieces made the fp16 MLP (20 MiB a step) 219 ms a step on a 10 Gbit/s
    // link, 4 MiB 97 ms, one gather 104 ms; on 1 Gbit/s, 241, 297 and
    // 314 ms. 4 MiB is never worse than one gather; the best size depends
    // on the link (bench-hosts.md).
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    int64_t piece = std::max<int64_t>(1, kGatherPieceBytes / tensor.element_size());
    for (int64_t first = 0; first < flat.numel(); first += piece) {
      int64_t length = std::min(piece, flat.numel() - first);
      std::vector<at::Tensor> travelling;
      for (auto& part : parts) {
        travelling.push_back(bitwise_view(part.narrow(0, first, length)));
      }
      works.push_back(start_all_gather(*group_, travelling,
                                       bitwise_view(flat.narrow(0, first, length))));
    }
    return std::make_unique<ProcessGroupWork>(std::move(works), [flat, parts] {
      reduce_into(flat, parts, ReduceOp::Sum, at::empty({flat.numel()}, at::kFloat));
    });
  }
  auto widened = tensor.to(type);
  return std::make_unique<ProcessGroupWork>(
      start_all_reduce(*group_, widened, op),
      [tensor, widened]() mutable { tensor.copy_(widened); });
}

std::unique_ptr<TransportWork> ProcessGroupTransport::broadcast(const at::Tensor& tensor,
                                                                int root) {
  return std::make_unique<ProcessGroupWork>(start_broadcast(*group_, bitwise_view(tensor), root));
}

std::unique_ptr<TransportWork> ProcessGroupTransport::all_gather(
    const std::vector<at::Tensor>& outputs, const at::Tensor& input) {
  std::vector<at::Tensor> travelling;
  for (const auto& output : outputs) {
    travelling.push_back(bitwise_view(output));
  }
  return std::make_unique<ProcessGroupWork>(
      start_all_gather(*group_, travelling, bitwise_view(input)));
}

std::unique_ptr<TransportWork> ProcessGroupTransport::barrier() {
  return std::make_unique<ProcessGroupWork>(start_barrier(*group_));
}

} // namespace lockstep::detail
