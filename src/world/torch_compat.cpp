#include "world/torch_compat.h"

#include <cstdlib>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace lockstep::detail {
namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Average: // Gloo has no average: the caller divides.
      return c10d::ReduceOp::SUM;
    case ReduceOp::Min:
      return c10d::ReduceOp::MIN;
    case ReduceOp::Max:
      return c10d::ReduceOp::MAX;
    case ReduceOp::Product:
      return c10d::ReduceOp::PRODUCT;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ReduceOp");
}

} // namespace

c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    const GroupOptions& options) {
  auto gloo = c10d::ProcessGroupGloo::Options::create(options.timeout);
  const char* interface = std::getenv("GLOO_SOCKET_IFNAME");
  if (interface != nullptr && *interface != '\0') {
    gloo->devices.push_back(
        c10d::ProcessGroupGloo::createDeviceForInterface(interface));
  } else {
    gloo->devices.push_back(
        c10d::ProcessGroupGloo::createDeviceForHostname(options.local_address));
  }
  // One Gloo worker thread per rank: collectives run one at a time in bucket
  // order anyway, and the cores belong to the model's compute.
  gloo->threads = 1;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(
      store, options.rank, options.size, gloo);
}

c10::intrusive_ptr<c10d::ProcessGroup> make_nccl_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    const GroupOptions& options) {
#ifdef USE_C10D_NCCL
  auto nccl = c10d::ProcessGroupNCCL::Options::create();
  nccl->timeout = options.timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(
      store, options.rank, options.size, nccl);
#else
  (void)store;
  (void)options;
  LOCKSTEP_FAIL(
      CollectiveError, "this LibTorch was built without NCCL, so CUDA "
      "tensors cannot be reduced; keep the model on the CPU or use a "
      "LibTorch built with CUDA.");
#endif
}

c10::intrusive_ptr<c10d::Work> start_all_reduce(
    c10d::ProcessGroup& group, const at::Tensor& tensor, ReduceOp op) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = to_c10d(op);
  return group.allreduce(tensors, options);
}

c10::intrusive_ptr<c10d::Work> start_broadcast(
    c10d::ProcessGroup& group, const at::Tensor& tensor, int root) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  return group.broadcast(tensors, options);
}

c10::intrusive_ptr<c10d::Work> start_all_gather(
    c10d::ProcessGroup& group,
    std::vector<at::Tensor>& outputs,
    const at::Tensor& input) {
  std::vector<std::vector<at::Tensor>> output_lists{outputs};
  std::vector<at::Tensor> inputs{input};
  auto work = group.allgather(output_lists, inputs);
  return work;
}

c10::intrusive_ptr<c10d::Work> start_barrier(c10d::ProcessGroup& group) {
  return group.barrier();
}

// LibTorch 1.13's Gloo has no bfloat16 at all.
bool gloo_lacks_type(const at::Tensor& tensor) {
  return tensor.device().is_cpu() && tensor.scalar_type() == at::kBFloat16;
}

at::ScalarType reduction_type(const at::Tensor& tensor) {
  if (gloo_lacks_type(tensor)) {
    return at::kFloat;
  }
  return tensor.scalar_type();
}

at::Tensor bitwise_view(const at::Tensor& tensor) {
  if (gloo_lacks_type(tensor)) {
    return tensor.view(at::kHalf); // same width; Gloo moves half's bytes as they are
  }
  return tensor;
}

std::string describe_exception(const std::exception& error) {
  if (const auto* torch_error = dynamic_cast<const c10::Error*>(&error)) {
    return torch_error->what_without_backtrace();
  }
  return error.what();
}

void when_done(c10d::Work& work, std::function<void()> callback) {
  work.getFuture()->addCallback(
      [callback = std::move(callback)](c10::ivalue::Future&) { callback(); });
}

void wait_work(c10d::Work& work, std::chrono::milliseconds timeout) {
  work.wait(timeout);
}

bool wait_work_for(c10d::Work& work, std::chrono::milliseconds slice) {
  try {
    work.wait(slice);
    return true;
  } catch (...) {
    if (!work.isCompleted()) {
      return false; // the slice ran out, not the work
    }
  }
  work.wait(); // completed meanwhile, or failed: its own outcome
  return true;
}

} // namespace lockstep::detail
