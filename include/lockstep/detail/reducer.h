#pragma once

// The non-template heart of DistributedDataParallel: owns the buckets and
// the autograd hooks of one module. Users go through ddp.h.

#include <chrono>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include <lockstep/comm_hook.h>
#include <lockstep/ddp_options.h>
#include <lockstep/ddp_stats.h>
#include <lockstep/join.h>
#include <lockstep/step_in_backward.h>
#include <lockstep/world.h>

namespace torch::nn {
class Module;
} // namespace torch::nn
namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace lockstep::detail {

class Reducer {
 public:
  /// Checks that every rank holds the same model, broadcasts rank 0's
  /// parameters and buffers, lays out the buckets and installs the hooks.
  Reducer(torch::nn::Module& module, World world, DdpOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  /// What must happen before a forward through the wrapper: the buffer
  /// broadcast when needed, and the iteration's bookkeeping.
  void before_forward();
  /// `outputs` are the forward's output tensors, for find_unused_parameters.
  void after_forward(const std::vector<at::Tensor>& outputs);
  /// What forward's floating tensor arguments are cast to: the
  /// mixed-precision policy's param_dtype, when there is one.
  std::optional<at::ScalarType> input_dtype() const;
  /// The module's forward raised: the parameters take back what they held
  /// before it (their masters, under a mixed-precision policy).
  void forward_failed();

  /// Whether backward passes average gradients (false under no_sync()).
  void set_sync_enabled(bool enabled);
  bool sync_enabled() const;

  DdpStats stats() const;

  /// Collective: raises UsageError naming the first parameter or buffer
  /// whose bytes differ between ranks, and the ranks that differ.
  void check_replicas(ReplicaCheck what);

  /// Collective: every rank takes rank 0's buffers now.
  void sync_buffers();

  /// Before the first forward: buckets travel through `hook`.
  void register_comm_hook(CommHook hook);

  /// Before the first forward: `step` steps each bucket's parameters once
  /// averaged (step_in_backward.h).
  void step_in_backward(ParameterStep step, const StepInBackwardOptions& options);
  /// The same with `optimizer` (a ZeroRedundancyOptimizer steps its shard).
  void step_in_backward(torch::optim::Optimizer& optimizer,
                        const StepInBackwardOptions& options);

  /// Before the first forward, with DdpOptions::shard_gradients: the
  /// ZeroRedundancyOptimizer (a GradientShardOwner) that shards its pieces
  /// by the buckets and keeps each bucket's slice of the average.
  void shard_gradients_with(torch::optim::Optimizer& optimizer);

  /// Uneven inputs (join.h): from now on, each forward agrees on which
  /// ranks still train.
  void enter_join(const JoinOptions& options);
  /// Collective: this rank ran out of batches; shadows the others until all
  /// did, then takes the last one's model.
  void finish_join();
  /// Leaves the join without a collective (an exception is unwinding).
  void leave_join();

  // For lockstep::FaultTolerance (world_change.cpp).
  /// From now on, a collective that fails inside an iteration ends it
  /// quietly; take_failure() says why. Raises UsageError where the wrapper
  /// uses what cannot be undone by a failed step (a step inside backward,
  /// a join).
  void tolerate_failures();
  /// Why a collective of the iterations since the last call failed, or "".
  std::string take_failure();
  /// Synchronised backward passes begun so far.
  int64_t synchronised_backwards() const;
  /// The world the buckets travel in.
  World world() const;
  /// Carries on in `world`, collectively with its other ranks: the
  /// buckets are laid out there anew, and rebuilt after its first iteration.
  void adopt_world(World world);
  /// Every parameter and buffer of the module (what makes its replica), or
  /// only the buffers.
  std::vector<at::Tensor> replica_tensors(bool buffers_only = false) const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

} // namespace lockstep::detail
