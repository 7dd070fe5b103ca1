#pragma once

// The seam between lockstep::FaultTolerance and what it keeps alive. The
// loop agrees on who trains and whether a step counts; what a step
// synchronises, how a failure inside it is seen, what a joining rank
// receives and how the work goes on in a new world belong to the guarded
// side: DistributedDataParallel's reducer (a step is a backward),
// DiLoCo's outer loop (a step is a fragment's synchronisation), or the
// reduction across replica groups (a step is a backward inside each
// group, then an all-reduce across them at commit).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <lockstep/world.h>

namespace torch::nn {
class Module;
} // namespace torch::nn
namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace lockstep::detail {

class Reducer;

/// The step's verdict where the reduction at commit carries it (torchft's
/// should_commit: the error flag folded into the reduction): what this rank
/// brings, and, once carried, the sums over the step's world.
struct FoldedVerdict {
  /// In: whether this rank saw a rank ask to join.
  bool join_asked = false;
  /// In: whether this rank commits sums (ft.commit(sums)).
  bool summing = false;
  /// Out: whether finish_step carried the two above.
  bool carried = false;
  /// Out: over the step's world, the ranks that saw a join asked, and those
  /// that commit sums.
  int64_t joins = 0;
  int64_t summing_ranks = 0;
};

class Guarded {
 public:
  virtual ~Guarded() = default;
  /// The world its collectives run in now; the first is the job's.
  virtual World world() const = 0;
  /// From now on a collective that fails inside a step ends the step
  /// quietly, and take_failure() says why; raises UsageError where what is
  /// guarded cannot undo a failed step.
  virtual void tolerate_failures() = 0;
  /// Why a collective since the last call failed, or "".
  virtual std::string take_failure() = 0;
  /// Synchronisations begun so far: a step that began none has nothing to
  /// commit.
  virtual int64_t synchronisations() const = 0;
  /// Runs what the step synchronises at commit, if anything (collective
  /// in world()), carrying `verdict` where it can; returns why it failed,
  /// or "".
  virtual std::string finish_step(FoldedVerdict& /*verdict*/) { return ""; }
  /// The step was dropped on every rank: what it synchronised is let go
  /// of without a step.
  virtual void drop_step() {}
  /// Carries on in `world` (collectively with its other ranks).
  virtual void adopt_world(World world) = 0;
  /// What makes a replica, which a joining rank receives; or only what a
  /// dropped step must put back as it was (the buffers).
  virtual std::vector<at::Tensor> replica_tensors(bool buffers_only) const = 0;
};

/// DistributedDataParallel's reducer, as FaultTolerance guards it.
std::shared_ptr<Guarded> guard(std::shared_ptr<Reducer> reducer);
/// Replica groups as the unit of failure (group_reduction.cpp): at commit,
/// the gradients of what `optimizer` steps (a ZeroRedundancyOptimizer: its
/// shard) are averaged with the ranks of the same place in the other
/// groups (`across`), and `module`'s buffers become the first group's; a
/// joining rank receives the parameters and `module`'s buffers.
std::shared_ptr<Guarded> guard_across_groups(World across, torch::nn::Module& module,
                                             torch::optim::Optimizer& optimizer);

} // namespace lockstep::detail
