#pragma once

// Uneven inputs: ranks that hold different numbers of batches train
// together. Inside a join guard, a rank that ran out of batches shadows the
// collectives the others still run (with zero gradients) until every rank
// has run out; then every rank takes the model of the last one to finish.
// PyTorch's counterpart is `with model.join():`. See docs/ddp.md.

#include <exception>
#include <memory>
#include <utility>
#include <vector>

#include <torch/arg.h>

namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace lockstep {
namespace detail {
class Reducer;
} // namespace detail

/// How the ranks of a join guard treat one another's uneven inputs.
struct JoinOptions {
  /// Divide each summed gradient by the world size (true, as PyTorch does),
  /// so that a rank that ran out counts as a zero gradient; false divides by
  /// the number of ranks that still had a batch in that iteration.
  TORCH_ARG(bool, divide_by_initial_world_size) = true;
  /// Instead of shadowing, raise lockstep::UsageError on every rank at the
  /// first forward that some rank no longer joins, naming the ranks that ran
  /// out (PyTorch's throw_on_early_termination).
  TORCH_ARG(bool, throw_on_early_termination) = false;
  /// Optimizers whose state (momentum, Adam's moments, step counts) the
  /// guard's end also copies from the last rank to finish. Without this, the
  /// ranks that ran out keep a state that lags, and the replicas drift apart
  /// again at the next step of a stateful optimizer (PyTorch's join leaves
  /// it so). A ZeroRedundancyOptimizer named here instead steps along on
  /// the ranks that ran out, with the others' averages: its step is
  /// collective. (An optimizer that steps inside backward steps along by
  /// itself.)
  TORCH_ARG(std::vector<torch::optim::Optimizer*>, optimizers) = {};
};

/// Made by DistributedDataParallel::join(); lives around the training loop.
/// Each forward inside it costs one extra all-reduce of (world size + 1)
/// integers, which tells every rank who is still training.
class JoinGuard {
 public:
  JoinGuard(std::shared_ptr<detail::Reducer> reducer, const JoinOptions& options);
  JoinGuard(JoinGuard&& other) noexcept;
  JoinGuard(const JoinGuard&) = delete;
  JoinGuard& operator=(const JoinGuard&) = delete;
  JoinGuard& operator=(JoinGuard&&) = delete;
  /// finish(), unless an exception is on its way out of the loop: then the
  /// guard only leaves (the other ranks learn of the failure from the world,
  /// as without a guard).
  ~JoinGuard() noexcept(false);

  /// Collective, once this rank has no more batches: shadows the other
  /// ranks' iterations until every rank has called it, then overwrites this
  /// rank's parameters and buffers with those of the last rank to finish
  /// (the lowest-numbered of them), and the state of
  /// JoinOptions::optimizers, so that the replicas are identical again.
  /// Raises under throw_on_early_termination when another rank still
  /// trains. Called by the destructor if not before.
  void finish();

 private:
  std::shared_ptr<detail::Reducer> reducer_;
  int exceptions_at_start_ = 0;
};

} // namespace lockstep
