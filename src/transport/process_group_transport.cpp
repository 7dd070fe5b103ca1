#include "transport/process_group_transport.h"

#include <atomic>
#include <condition_variable>
#include <mutex>

#include <ATen/ATen.h>
// 2.x: Backend.hpp comes with it.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "compat/c10d.h"
#include "timeline/recorder.h"
#include "transport/posted_exchange.h"
#include "transport/shm_reduce.h"

namespace lockstep::detail {
namespace {

// Set by the backend's callback, which may outlive the work that waits.
struct Completion {
  std::mutex mutex;
  std::condition_variable done_changed;
  bool done = false;
  std::atomic<int64_t> ns{0};
};

class ProcessGroupWork : public TransportWork {
 public:
  // `travelling` is what the backend moves: `result` itself, or a copy in
  // a type the backend can reduce, copied back on completion.
  ProcessGroupWork(c10::intrusive_ptr<c10d::Work> work, at::Tensor result, at::Tensor travelling)
      : work_(std::move(work)), result_(std::move(result)), travelling_(std::move(travelling)) {
    // Waiting on the backend's completion, never on work.wait(slice): to
    // c10d a zero slice means no limit, and every slice that runs out
    // throws a c10::Error, which captures and symbolises a backtrace.
    when_done(*work_, [completion = completion_] {
      completion->ns.store(steady_now_ns());
      std::lock_guard<std::mutex> lock(completion->mutex);
      completion->done = true;
      completion->done_changed.notify_all();
    });
  }

  bool wait_for(std::chrono::milliseconds slice) override {
    {
      std::unique_lock<std::mutex> lock(completion_->mutex);
      if (!completion_->done_changed.wait_for(lock, slice, [&] { return completion_->done; })) {
        return false;
      }
    }
    wait_work(*work_, kNoLimit); // completed, or failed: rethrows the backend's failure
    if (result_.defined() && !travelling_.is_same(result_)) {
      result_.copy_(travelling_);
    }
    return true;
  }

  std::string stall() override {
    try {
      wait_work(*work_, std::chrono::milliseconds(1));
    } catch (const std::exception& e) {
      return describe_exception(e);
    }
    return "the backend completed it just now";
  }

  int64_t completed_ns() const override {
    return completion_->ns.load();
  }

 private:
  // c10d's "no timeout"; the work has completed when it is used.
  static constexpr std::chrono::milliseconds kNoLimit{0};

  c10::intrusive_ptr<c10d::Work> work_;
  at::Tensor result_;
  at::Tensor travelling_;
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
  // A 16-bit sum. Gloo cannot add it in float32, so it travels either as
  // 16 bits, every rank's whole tensor sent to every other rank ((n - 1)
  // tensors of 16 bits out of each rank), or widened to float32 through
  // Gloo's ring (2 (n - 1) / n tensors of 32 bits): the first moves fewer
  // bytes up to 4 ranks. Either way each element is summed in float32 in
  // one order and rounded once, so every rank holds the same bits.
  int ranks = group_->getSize();
  if (type != tensor.scalar_type() && op == ReduceOp::Sum && ranks <= 4) {
    auto flat = tensor.reshape({-1});
    std::vector<at::Tensor> parts;
    std::vector<at::Tensor> travelling;
    for (int rank = 0; rank < ranks; ++rank) {
      parts.push_back(rank == group_->getRank() ? flat : at::empty_like(flat));
      travelling.push_back(bitwise_view(parts.back()));
    }
    return start_posted_exchange(
        *group_, bitwise_view(flat), travelling, exchanges_++,
        [flat, parts, room = at::Tensor()](int64_t first, int64_t length) mutable {
          if (!room.defined() || room.numel() < length) {
            room = at::empty({length}, at::kFloat);
          }
          std::vector<at::Tensor> arrived;
          for (const auto& part : parts) {
            arrived.push_back(part.narrow(0, first, length));
          }
          reduce_into(flat.narrow(0, first, length), arrived, ReduceOp::Sum,
                      room.narrow(0, 0, length));
        });
  }
  at::Tensor travelling = type == tensor.scalar_type() ? tensor : tensor.to(type);
  return std::make_unique<ProcessGroupWork>(start_all_reduce(*group_, travelling, op), tensor,
                                            travelling);
}

std::unique_ptr<TransportWork> ProcessGroupTransport::broadcast(const at::Tensor& tensor,
                                                                int root) {
  return std::make_unique<ProcessGroupWork>(
      start_broadcast(*group_, bitwise_view(tensor), root), at::Tensor(), at::Tensor());
}

std::unique_ptr<TransportWork> ProcessGroupTransport::all_gather(
    const std::vector<at::Tensor>& outputs, const at::Tensor& input) {
  std::vector<at::Tensor> travelling;
  for (const auto& output : outputs) {
    travelling.push_back(bitwise_view(output));
  }
  return std::make_unique<ProcessGroupWork>(
      start_all_gather(*group_, travelling, bitwise_view(input)), at::Tensor(), at::Tensor());
}

std::unique_ptr<TransportWork> ProcessGroupTransport::barrier() {
  return std::make_unique<ProcessGroupWork>(start_barrier(*group_), at::Tensor(), at::Tensor());
}

} // namespace lockstep::detail
