#pragma once

// Every call whose form depends on the LibTorch version lives behind this
// header (its .cpp is the one file to change for LibTorch 2.x, where a
// ProcessGroup wraps per-device Backends and ReduceOp became a struct).

#include <chrono>
#include <functional>
#include <string>

#include <c10/util/intrusive_ptr.h>

#include <lockstep/world.h>

namespace c10d {
class Store;
class ProcessGroup;
class Work;
} // namespace c10d

namespace lockstep::detail {

struct GroupOptions {
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  /// The local address Gloo binds to; ignored when GLOO_SOCKET_IFNAME names
  /// an interface.
  std::string local_address;
};

c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    const GroupOptions& options);

/// NCCL for CUDA tensors; raises CollectiveError when LibTorch has no NCCL.
c10::intrusive_ptr<c10d::ProcessGroup> make_nccl_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    const GroupOptions& options);

c10::intrusive_ptr<c10d::Work> start_all_reduce(
    c10d::ProcessGroup& group, const at::Tensor& tensor, ReduceOp op);
c10::intrusive_ptr<c10d::Work> start_broadcast(
    c10d::ProcessGroup& group, const at::Tensor& tensor, int root);
c10::intrusive_ptr<c10d::Work> start_all_gather(
    c10d::ProcessGroup& group,
    std::vector<at::Tensor>& outputs,
    const at::Tensor& input);
c10::intrusive_ptr<c10d::Work> start_barrier(c10d::ProcessGroup& group);

/// The type in which `tensor` travels through its backend: Gloo in LibTorch
/// 1.13 cannot reduce bfloat16, so those go as float32 (exact for the
/// values, and a more accurate sum).
at::ScalarType reduction_type(const at::Tensor& tensor);

/// `tensor` as the backend can move it without arithmetic (broadcast,
/// all_gather): bfloat16 travels as its bits, viewed as float16 (Gloo has
/// no int16 either).
at::Tensor bitwise_view(const at::Tensor& tensor);

/// The message of an exception without LibTorch's C++ backtrace, which says
/// nothing to a user and buries the cause.
std::string describe_exception(const std::exception& error);

/// Calls `callback` (on the backend's thread) when `work` completes.
void when_done(c10d::Work& work, std::function<void()> callback);

/// Waits for `work` at most `timeout`; rethrows the backend's failure.
void wait_work(c10d::Work& work, std::chrono::milliseconds timeout);

/// Waits for `work` at most `slice`: true when it completed, false when it
/// still runs; rethrows the backend's failure.
bool wait_work_for(c10d::Work& work, std::chrono::milliseconds slice);

} // namespace lockstep::detail
