#pragma once

// A dead rank costs one step, not the job. Every step, the ranks agree on
// who trains it (begin_step) and on whether it counts (commit): a step in
// which a rank failed is dropped on every rank, the survivors go on at
// once in a world of their own, and a rank that lockstep-run restarts
// (--restart rank) rejoins at a later begin_step and receives the model,
// the optimizer's state and the step number from a live peer, never from
// a file. See docs/fault-tolerance.md.
//
//   lockstep::FaultTolerance ft(ddp, optimizer,
//                               lockstep::FaultToleranceOptions().min_world_size(1));
//   while (ft.step() < steps) {
//     ft.begin_step();
//     auto [x, y] = batch_for(ft.step(), ft.world().rank(), ft.world().size());
//     optimizer.zero_grad();
//     torch::nll_loss(ddp(x), y).backward();
//     if (ft.commit()) optimizer.step();
//   }

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <functional>

#include <torch/arg.h>
#include <torch/serialize/archive.h>

#include <lockstep/ddp.h>
#include <lockstep/replica_groups.h>
#include <lockstep/world.h>

namespace torch::nn {
class Module;
} // namespace torch::nn
namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace lockstep {

class DiLoCo;
namespace amp {
class GradScaler;
} // namespace amp
namespace detail {
class Guarded;
} // namespace detail

struct FaultToleranceOptions {
  /// The fewest ranks that train on. Below it, the survivors wait (at most
  /// `timeout`) for ranks to come back, then raise FaultToleranceError.
  TORCH_ARG(int, min_world_size) = 1;
  /// A rank whose heartbeat stops for this long (stopped, cut off) is taken
  /// for failed and left out. A rank whose process ends is left out at
  /// once: its connection to the job's store closes.
  TORCH_ARG(std::chrono::milliseconds, heartbeat_timeout) = std::chrono::seconds(2);
  /// A rank that has not finished a step that the others finished, or not
  /// come back for the next world, this long after them is hung (its
  /// heartbeat, sent by a thread of its own, goes on): the others report
  /// it, drop the step and train on without it, and lockstep-run ends it
  /// (and restarts it under --restart rank).
  TORCH_ARG(std::chrono::milliseconds, step_timeout) = std::chrono::minutes(5);
  /// The limit on waiting for enough ranks, and on forming a world.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  /// With the step number and the rank's launcher rank, seeds the random
  /// stream of a rank that joins (see docs/fault-tolerance.md).
  TORCH_ARG(uint64_t, seed) = 0;
  /// One line on stderr per failure, and per world formed.
  TORCH_ARG(bool, verbose) = true;
  /// Across hosts the job's store is reached over the network, and without
  /// a job secret (LOCKSTEP_JOB_SECRET) any process there could forge the
  /// decisions that the ranks act on (docs/world.md#security); so a job
  /// across hosts needs a secret, unless this says that the network is
  /// trusted.
  TORCH_ARG(bool, trusted_network) = false;
  /// The live state travels to a rank that rejoins in pieces of at most
  /// this many bytes: what the transfer adds in memory on either side.
  TORCH_ARG(size_t, state_piece_bytes) = size_t{64} << 20;
};

/// What a fault-tolerant loop went through, for logs and figures.
struct FaultToleranceStats {
  /// Steps begun but not committed (a rank failed in them).
  int64_t aborted_steps = 0;
  /// Worlds formed after the first (after a failure, or to take a rank in).
  int64_t worlds_formed = 0;
  /// Seconds spent forming those worlds and bringing new ranks up to date.
  double reform_seconds = 0;
  /// Of the last one alone.
  double last_reform_seconds = 0;
  /// Bytes of live state this rank sent to ranks that rejoined, and
  /// received where it rejoined (a rank up to date does neither).
  int64_t state_bytes_sent = 0;
  int64_t state_bytes_received = 0;
};

class FaultTolerance {
 public:
  /// On a rank of the job's first processes: collective over ddp's world.
  /// On a rank restarted alone (lockstep-run --restart rank): local; it
  /// joins the others at its first begin_step(). Takes over the failures
  /// of ddp's collectives: from now on a rank that fails inside forward or
  /// backward makes commit() return false instead of an exception.
  template <typename ModuleType>
  FaultTolerance(DistributedDataParallel<ModuleType>& ddp,
                 torch::optim::Optimizer& optimizer,
                 FaultToleranceOptions options = {})
      : FaultTolerance(ddp.reducer(), optimizer, options) {}
  FaultTolerance(std::shared_ptr<detail::Reducer> reducer,
                 torch::optim::Optimizer& optimizer,
                 FaultToleranceOptions options);
  /// DiLoCo across replicas of one rank each (its world is the job's): a
  /// step is a fragment's synchronisation, which diloco.step() begins and
  /// commits itself; a replica that fails costs one (the one in flight, or
  /// the next), and a restarted one receives the parameters, the global
  /// ones, the inner and outer optimizers' states and the local step
  /// (docs/diloco.md).
  FaultTolerance(DiLoCo& diloco, torch::optim::Optimizer& inner,
                 FaultToleranceOptions options = {});
  /// Replica groups as the unit of failure (torchft's FT-HSDP and FT-DDP):
  /// inside each group of `groups` (replica_groups(world, k) of init()'s
  /// world) the program trains as without fault tolerance, with FSDP or
  /// DDP over groups.replica; commit() then averages the gradients of what
  /// `optimizer` steps on this rank (FSDP: its shards) with the same place
  /// of every other group, fault-tolerantly. A group in which a rank fails
  /// drops out whole: its other ranks raise (FaultToleranceError, or the
  /// CollectiveError of the group's collective they were in) and end, and
  /// once lockstep-run has restarted them all (--restart rank), the group
  /// forms again (replica_groups on the restarted ranks) and rejoins at a
  /// begin_step(): each of its ranks receives its own part (what its
  /// optimizer steps, that state, `module`'s buffers) from the rank of the
  /// same place in a live group. See docs/fault-tolerance.md.
  FaultTolerance(const ReplicaGroups& groups, torch::nn::Module& module,
                 torch::optim::Optimizer& optimizer, FaultToleranceOptions options = {});
  ~FaultTolerance();
  FaultTolerance(const FaultTolerance&) = delete;
  FaultTolerance& operator=(const FaultTolerance&) = delete;

  /// Agrees on who trains this step. After a failure, or when a restarted
  /// rank asks to join, the ranks form a new world here, and a rank that is
  /// behind receives the live state.
  void begin_step();
  /// Whether this step counts, agreed in the step's own world (no store
  /// operation): true only where every rank of world() averaged its
  /// gradients; then call optimizer.step(). False when a rank failed
  /// during the step: nothing is applied, and the buffers are as the step
  /// found them. (A rank whose verdict alone failed after the others had
  /// theirs drops what they commit, and receives their state when the
  /// world re-forms at once: no replica trains on from another state.)
  bool commit();
  /// commit(), which also sums `sums` (a small CPU tensor of this rank's
  /// figures: its loss summed, the samples it got right, those it saw) over
  /// the step's world, inside the step's agreement: returns the sums when
  /// the step counts, nullopt when it is dropped, so that an epoch's
  /// figures count each committed sample once, whoever trained it.
  std::optional<at::Tensor> commit(const at::Tensor& sums);
  /// Committed steps.
  int64_t step() const;
  /// State of the program's own that must reach a rank that rejoins with
  /// the model and the optimizer (a learning-rate scheduler's step, the
  /// program's counters), as torchft's register_state_dict_fn: the rank
  /// that holds the live state `save`s it, the one that receives it
  /// `load`s it. Register the same names in the same order on every rank,
  /// before the first begin_step().
  void register_state(const std::string& name,
                      std::function<void(torch::serialize::OutputArchive&)> save,
                      std::function<void(torch::serialize::InputArchive&)> load);
  /// A GradScaler that steps this FaultTolerance's optimizer: its scale
  /// and growth tracker reach a rank that rejoins, so that every rank
  /// scales its loss alike. Its step() refuses to run unregistered (a
  /// rejoined rank would scale by init_scale while the others scale by
  /// what they learned, and DDP would average unlike gradients).
  void register_state(const std::string& name, amp::GradScaler& scaler);
  /// Who trains the current step: this process's rank and the size. Over
  /// replica groups: the groups' world, whose rank is this rank's group's
  /// index among those that train (so that a rank's share of the batch is
  /// world().rank() * k + groups.replica.rank() of world().size() * k).
  const World& world() const;
  FaultToleranceStats stats() const;

  struct Impl;

 private:
  FaultTolerance(std::shared_ptr<detail::Guarded> guarded, torch::optim::Optimizer& optimizer,
                 FaultToleranceOptions options, const ReplicaGroups* groups = nullptr);
  std::unique_ptr<Impl> impl_;
};

} // namespace lockstep
