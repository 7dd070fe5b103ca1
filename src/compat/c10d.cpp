#include "compat/c10d.h"

#include <cstdlib>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <lockstep/error.h>

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

// LibTorch 1.13's Gloo has no bfloat16 at all.
bool gloo_lacks_type(const at::Tensor& tensor) {
  return tensor.device().is_cpu() && tensor.scalar_type() == at::kBFloat16;
}

} // namespace

c10::intrusive_ptr<CollectiveBackend> make_gloo_backend(
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

c10::intrusive_ptr<CollectiveBackend> make_nccl_backend(
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

c10::intrusive_ptr<c10d::ProcessGroup> as_process_group(
    const c10::intrusive_ptr<CollectiveBackend>& backend,
    const c10::intrusive_ptr<c10d::Store>& store,
    const GroupOptions& options,
    bool cuda) {
#if !defined(LOCKSTEP_TORCH_HAS_BACKEND)
  (void)store;
  (void)options;
  (void)cuda;
  return backend;
#else
  using BackendType = c10d::ProcessGroup::BackendType;
  auto type = cuda ? BackendType::NCCL : BackendType::GLOO;
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 5
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, options.rank, options.size);
#else
  auto group_options = c10::make_intrusive<c10d::ProcessGroup::Options>(
      cuda ? "nccl" : "gloo", options.timeout);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(
      store, options.rank, options.size, group_options);
#endif
  group->setBackend(cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU, type, backend);
  group->setDefaultBackend(type);
  return group;
#endif
}

c10::intrusive_ptr<c10d::Work> start_all_reduce(
    CollectiveBackend& group, const at::Tensor& tensor, ReduceOp op) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = to_c10d(op);
  return group.allreduce(tensors, options);
}

c10::intrusive_ptr<c10d::Work> start_broadcast(
    CollectiveBackend& group, const at::Tensor& tensor, int root) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  return group.broadcast(tensors, options);
}

c10::intrusive_ptr<c10d::Work> start_all_gather(
    CollectiveBackend& group,
    std::vector<at::Tensor>& outputs,
    const at::Tensor& input) {
  std::vector<std::vector<at::Tensor>> output_lists{outputs};
  std::vector<at::Tensor> inputs{input};
  return group.allgather(output_lists, inputs);
}

c10::intrusive_ptr<c10d::Work> start_barrier(CollectiveBackend& group) {
  return group.barrier();
}

c10::intrusive_ptr<c10d::Work> start_send(CollectiveBackend& group,
                                          const at::Tensor& tensor,
                                          int peer,
                                          int tag) {
  std::vector<at::Tensor> tensors{tensor};
  return group.send(tensors, peer, tag);
}

c10::intrusive_ptr<c10d::Work> start_recv(CollectiveBackend& group,
                                          const at::Tensor& tensor,
                                          int peer,
                                          int tag) {
  std::vector<at::Tensor> tensors{tensor};
  return group.recv(tensors, peer, tag);
}

void store_set(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

void choose_tcp_store_server(c10d::TCPStoreOptions& options) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2)
  // Set by CMake from the libraries LibTorch links: libuv's server where
  // LibTorch has it, else the classic one, which every 2.x has (2.4 made
  // libuv the default even where it is missing, and then fails).
#ifdef LOCKSTEP_TORCH_HAS_LIBUV
  options.useLibUV = true;
#else
  options.useLibUV = false;
#endif
#else
  (void)options;
#endif
}

at::ScalarType reduction_type(const at::Tensor& tensor) {
  // float16 too: Gloo adds it in float16, rounding at every step and
  // overflowing at 65504 where the shared-memory transport sums in float32.
  if (tensor.device().is_cpu() &&
      (tensor.scalar_type() == at::kBFloat16 || tensor.scalar_type() == at::kHalf)) {
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

} // namespace lockstep::detail
