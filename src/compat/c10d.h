#pragma once

// The ground floor: every call whose form depends on the LibTorch version
// lives behind this header, and nothing in it knows of World, transports or
// the reducer. LibTorch 1.13 and 2.x differ here (checked by
// TORCH_VERSION_MAJOR/MINOR in the .cpp, never by trial):
// - 1.13: ProcessGroupGloo is a c10d::ProcessGroup, called directly.
// - 2.x: ProcessGroupGloo is a c10d::Backend; a c10d::ProcessGroup is a
//   dispatcher over backends (its constructor changed again in 2.5).
//   lockstep holds and calls the Backend itself, and wraps it in a
//   ProcessGroup only where the public API hands one out.
// - 2.x: Store::set has a std::string overload beside the byte vector, so
//   `set(key, {...})` is ambiguous; TCPStore has a libuv server, the
//   default even where LibTorch was built without libuv (Debian 13).

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/version.h>

#include <lockstep/world.h>

#if TORCH_VERSION_MAJOR >= 2
#define LOCKSTEP_TORCH_HAS_BACKEND 1
#endif

namespace c10d {
class Store;
class ProcessGroup;
class Work;
#if defined(LOCKSTEP_TORCH_HAS_BACKEND)
class Backend;
#endif
struct TCPStoreOptions;
} // namespace c10d

namespace lockstep::detail {

/// What carries the collectives of one group: the Gloo (or NCCL)
/// implementation itself, with no dispatcher in between.
#if defined(LOCKSTEP_TORCH_HAS_BACKEND)
using CollectiveBackend = c10d::Backend;
#else
using CollectiveBackend = c10d::ProcessGroup;
#endif

struct GroupOptions {
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  /// The local address Gloo binds to; ignored when GLOO_SOCKET_IFNAME names
  /// an interface.
  std::string local_address;
};

c10::intrusive_ptr<CollectiveBackend> make_gloo_backend(
    const c10::intrusive_ptr<c10d::Store>& store,
    const GroupOptions& options);

/// NCCL for CUDA tensors; raises CollectiveError when LibTorch has no NCCL.
c10::intrusive_ptr<CollectiveBackend> make_nccl_backend(
    const c10::intrusive_ptr<c10d::Store>& store,
    const GroupOptions& options);

/// `backend` as the c10d::ProcessGroup that users of c10d expect (the same
/// object on 1.13; a ProcessGroup dispatching to it on 2.x).
c10::intrusive_ptr<c10d::ProcessGroup> as_process_group(
    const c10::intrusive_ptr<CollectiveBackend>& backend,
    const c10::intrusive_ptr<c10d::Store>& store,
    const GroupOptions& options,
    bool cuda);

c10::intrusive_ptr<c10d::Work> start_all_reduce(
    CollectiveBackend& group, const at::Tensor& tensor, ReduceOp op);
c10::intrusive_ptr<c10d::Work> start_broadcast(
    CollectiveBackend& group, const at::Tensor& tensor, int root);
c10::intrusive_ptr<c10d::Work> start_all_gather(
    CollectiveBackend& group,
    std::vector<at::Tensor>& outputs,
    const at::Tensor& input);
c10::intrusive_ptr<c10d::Work> start_barrier(CollectiveBackend& group);
/// Point to point, matched by `tag` between the two ranks. Gloo posts them
/// at once on the connection, with no work queued for its threads; their
/// works have no future (wait on them, or abort them).
c10::intrusive_ptr<c10d::Work> start_send(CollectiveBackend& group,
                                          const at::Tensor& tensor,
                                          int peer,
                                          int tag);
c10::intrusive_ptr<c10d::Work> start_recv(CollectiveBackend& group,
                                          const at::Tensor& tensor,
                                          int peer,
                                          int tag);

/// Writes `value` under `key`.
void store_set(c10d::Store& store, const std::string& key, const std::string& value);

/// TCPStore options with the server this LibTorch has: libuv only where it
/// was built with it (never on 1.13, which has only the classic one).
void choose_tcp_store_server(c10d::TCPStoreOptions& options);

/// The type in which `tensor` is all-reduced by its backend: Gloo cannot
/// reduce bfloat16 in LibTorch 1.13 and sums float16 in float16, so both
/// go as float32 (exact for the values, the sum rounded once, no overflow)
/// on every version alike.
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

} // namespace lockstep::detail
