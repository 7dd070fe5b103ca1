#pragma once

// The world: which processes take part in a job, and the collectives that
// connect them. `init()` forms it from the environment that a launcher sets
// (lockstep-run, torchrun, mpirun, srun) or from explicit options.

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <lockstep/debug_level.h>
#include <lockstep/error.h>
#include <lockstep/world_options.h>

namespace c10d {
class Store;
class ProcessGroup;
} // namespace c10d

namespace lockstep {
namespace detail {
struct WorldAccess;
} // namespace detail

enum class ReduceOp { Sum, Average, Min, Max, Product };

/// A collective in flight, started by World::all_reduce_async.
class PendingCollective {
 public:
  /// Blocks until the collective completes, at most the world's timeout;
  /// raises TimeoutError or CollectiveError naming the rank and the
  /// operation. Waiting again is a no-op.
  void wait();
  /// When the collective completed, as the backend reported it; meaningful
  /// once wait() has returned. Only the timeline asks the backend; otherwise
  /// this is when wait() saw it done.
  std::chrono::steady_clock::time_point completed_at() const;

  struct State;
  explicit PendingCollective(std::shared_ptr<State> state);

 private:
  std::shared_ptr<State> state_;
};

/// A formed world. Copies share the same connections; the connections close
/// when the last copy goes.
class World {
 public:
  int rank() const;
  int size() const;
  int local_rank() const;
  int local_size() const;
  /// Where the configuration came from: "options", "RANK/WORLD_SIZE" (set
  /// by lockstep-run and torchrun), "OpenMPI", "SLURM" or "single process".
  const std::string& source() const;
  std::chrono::milliseconds timeout() const;
  /// WorldOptions::debug, else LOCKSTEP_DEBUG.
  DebugLevel debug() const;
  /// What carries the collectives of CPU tensors: "Gloo", or "shared memory
  /// (N ranks on this host)".
  const std::string& transport() const;
  /// At Detail, the ranks compare every later collective before running it.
  /// Every rank must set the same level at the same point of the program
  /// (DistributedDataParallel does so when DdpOptions::debug asks for it).
  void set_debug(DebugLevel level);

  /// The store shared by all ranks, scoped to this job (keys written here do
  /// not collide with another job's on the same store). Include
  /// <torch/csrc/distributed/c10d/Store.hpp> to use it.
  c10::intrusive_ptr<c10d::Store> store() const;
  /// The process group for tensors on `device`: Gloo for CPU, NCCL for CUDA
  /// when LibTorch was built with it.
  c10::intrusive_ptr<c10d::ProcessGroup> process_group(
      const at::Device& device = at::kCPU) const;

  /// Every collective below waits at most timeout() and raises TimeoutError
  /// (naming the rank and the operation) past it.
  void barrier();
  /// `description` names the operation in errors; by default "broadcast
  /// from rank R of <dtype> <shape>".
  void broadcast(at::Tensor& tensor, int root = 0, const std::string& description = "");
  void all_reduce(at::Tensor& tensor, ReduceOp op = ReduceOp::Sum);
  /// Starts an all-reduce that runs while the caller goes on. `description`
  /// names the operation in errors (for example "bucket 2 (fc.weight)").
  PendingCollective all_reduce_async(
      at::Tensor tensor, ReduceOp op, std::string description);
  std::vector<at::Tensor> all_gather(const at::Tensor& tensor);
  /// Gathers one short string per rank through the store. Meant for error
  /// messages that show every rank's view, not for data.
  std::vector<std::string> all_gather_strings(const std::string& value);

  /// Collective: every rank calls it with the same arguments. A zero-filled
  /// contiguous CPU tensor in the memory that all_reduce moves fastest:
  /// with the shared-memory transport, this rank's part of a segment that
  /// the ranks of its host share, so that an all-reduce of the whole tensor
  /// reads and writes it in place, without a copy in or out. Elsewhere,
  /// plain memory. DistributedDataParallel keeps its buckets there.
  at::Tensor allocate(int64_t numel, at::ScalarType dtype);

  struct Impl;
  explicit World(std::shared_ptr<Impl> impl);

 private:
  friend struct detail::WorldAccess;
  std::shared_ptr<Impl> impl_;
};

/// Forms the world: rendezvous through a c10d TCPStore, then one process
/// group per device type. Blocks until every rank has joined, or raises
/// RendezvousError naming the ranks that did not within the timeout.
World init(const WorldOptions& options = {});

} // namespace lockstep
