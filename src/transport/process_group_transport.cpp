#include "transport/process_group_transport.h"

#include <atomic>

#include <ATen/ATen.h>
// 2.x: Backend.hpp comes with it.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "compat/c10d.h"
#include "timeline/recorder.h"

namespace lockstep::detail {
namespace {

class ProcessGroupWork : public TransportWork {
 public:
  // `travelling` is what the backend moves: `result` itself, or a copy in
  // a type the backend can reduce, copied back on completion.
  ProcessGroupWork(c10::intrusive_ptr<c10d::Work> work, at::Tensor result, at::Tensor travelling)
      : work_(std::move(work)), result_(std::move(result)), travelling_(std::move(travelling)) {
    if (timeline::enabled()) {
      when_done(*work_, [completed = completed_] { completed->store(steady_now_ns()); });
    }
  }

  bool wait_for(std::chrono::milliseconds slice) override {
    if (!wait_work_for(*work_, slice)) {
      return false;
    }
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
    return completed_->load();
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  at::Tensor result_;
  at::Tensor travelling_;
  // Set by the backend's callback, which may outlive this.
  std::shared_ptr<std::atomic<int64_t>> completed_ = std::make_shared<std::atomic<int64_t>>(0);
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
