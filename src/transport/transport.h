#pragma once

// The seam between World and what carries its collectives. World numbers
// each collective, records it in the ledger, and waits on it in slices
// (naming a peer that closed or died); a Transport only moves and reduces
// bytes: a c10d process group (Gloo, NCCL), shared memory between the ranks
// of one host, or both, hierarchically. Nothing above World knows which.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <lockstep/world.h>

namespace lockstep::detail {

/// The steady clock in nanoseconds: when a collective completed.
inline int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// One collective in flight.
class TransportWork {
 public:
  virtual ~TransportWork() = default;
  /// Waits at most `slice`: true once the collective is complete and its
  /// result is in place, false while it still runs. Raises the transport's
  /// own failure (a closed connection, for instance).
  virtual bool wait_for(std::chrono::milliseconds slice) = 0;
  /// What the transport has to say about a collective that did not
  /// complete within the world's timeout: the cause in the error.
  virtual std::string stall() = 0;
  /// When it completed (steady clock, ns), where the transport knows it
  /// better than the waiter; 0 otherwise.
  virtual int64_t completed_ns() const {
    return 0;
  }
};

// Every tensor handed to a transport is contiguous (World makes a dense
// copy of a strided view): the transports, and Gloo beneath them, move
// data_ptr() and numel() elements.
class Transport {
 public:
  virtual ~Transport() = default;
  /// What carries the collectives, for INFO and messages.
  virtual std::string describe() const = 0;
  /// Reduces `tensor` in place on every rank: Sum, Min, Max or Product
  /// (World divides the sum for an average).
  virtual std::unique_ptr<TransportWork> all_reduce(const at::Tensor& tensor, ReduceOp op) = 0;
  virtual std::unique_ptr<TransportWork> broadcast(const at::Tensor& tensor, int root) = 0;
  /// `outputs` has one contiguous tensor per rank, shaped like `input`.
  virtual std::unique_ptr<TransportWork> all_gather(const std::vector<at::Tensor>& outputs,
                                                    const at::Tensor& input) = 0;
  virtual std::unique_ptr<TransportWork> barrier() = 0;
  /// `input` holds one slice of output.numel() elements per rank; `output`
  /// takes this rank's slice reduced over every rank's input. Null where
  /// the transport has no reduce-scatter of its own: World then all-reduces
  /// a copy of `input` and keeps its slice.
  virtual std::unique_ptr<TransportWork> reduce_scatter(const at::Tensor& output,
                                                        const at::Tensor& input,
                                                        ReduceOp op) {
    (void)output;
    (void)input;
    (void)op;
    return nullptr;
  }
  /// Collective (every rank, same arguments): a zero-filled contiguous
  /// tensor in the memory that this transport's all_reduce moves fastest.
  virtual at::Tensor allocate(int64_t numel, at::ScalarType dtype);
};

} // namespace lockstep::detail
