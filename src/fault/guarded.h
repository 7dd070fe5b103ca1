#pragma once

// The seam between lockstep::FaultTolerance and what it keeps alive. The
// loop agrees on who trains and whether a step counts; what a step
// synchronises, how a failure inside it is seen, what a joining rank
// receives and how the work goes on in a new world belong to the guarded
// side: DistributedDataParallel's reducer (a step is a backward), or
// DiLoCo's outer loop (a step is a fragment's synchronisation).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <lockstep/world.h>

namespace lockstep::detail {

class Reducer;

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
  /// Carries on in `world` (collectively with its other ranks).
  virtual void adopt_world(World world) = 0;
  /// What makes a replica, which a joining rank receives; or only what a
  /// dropped step must put back as it was (the buffers).
  virtual std::vector<at::Tensor> replica_tensors(bool buffers_only) const = 0;
};

/// DistributedDataParallel's reducer, as FaultTolerance guards it.
std::shared_ptr<Guarded> guard(std::shared_ptr<Reducer> reducer);

} // namespace lockstep::detail
