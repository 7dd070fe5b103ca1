#pragma once

// What a lockstep::DiLoCo holds, shared by its schedule (diloco.cpp) and
// its side of fault tolerance (fault_tolerance.cpp here), which guards it
// as FaultTolerance guards DistributedDataParallel's reducer: a step is one
// fragment's synchronisation, from its send to its apply.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <lockstep/diloco.h>
#include <lockstep/fault_tolerance.h>

#include "fault/guarded.h"

namespace lockstep {

struct DiLoCo::Impl final : detail::Guarded, std::enable_shared_from_this<DiLoCo::Impl> {
  World replicas;
  std::vector<std::vector<at::Tensor>> fragments;
  torch::optim::Optimizer& inner;
  std::vector<torch::optim::Optimizer*> outer; // one per fragment
  DiLoCoOptions options;
  std::vector<std::vector<at::Tensor>> global; // saved, per fragment
  int64_t local_step = 0;
  int64_t syncs = 0;
  /// A fragment's pseudo-gradient in flight: its values, then this
  /// replica's share of the divisor (1, or 0 for a replica that has just
  /// received the live state and trained nothing of its own).
  struct Pending {
    size_t fragment = 0;
    at::Tensor flat;
    std::optional<PendingCollective> work;
  };
  std::optional<Pending> pending;
  int64_t sent = 0;
  // Under fault tolerance.
  FaultTolerance* fault_tolerance = nullptr;
  bool tolerating = false;
  std::string failure;
  /// False on a replica restarted alone until its first step brings it the
  /// live state.
  bool joined = true;
  /// Set where the live state is loaded (a replica restarted, or stopped
  /// and dropped, that rejoins): what it would send is its sender's.
  bool received_state = false;

  Impl(World replicas_in, std::vector<std::vector<at::Tensor>> fragments_in,
       torch::optim::Optimizer& inner_in, std::vector<torch::optim::Optimizer*> outer_in,
       DiLoCoOptions options_in)
      : replicas(std::move(replicas_in)),
        fragments(std::move(fragments_in)),
        inner(inner_in),
        outer(std::move(outer_in)),
        options(options_in) {}

  int64_t interval() const {
    return options.sync_every() / static_cast<int64_t>(fragments.size());
  }
  bool send_due() const {
    int64_t delay = options.fragment_sync_delay();
    return (local_step + delay) % interval() == 0;
  }
  /// Begins the step of fault tolerance, if any, and sends the next
  /// fragment's pseudo-gradient.
  void begin_sync();
  /// Waits for it; applies it if the step counts, else only restores the
  /// fragment's global parameters.
  void end_sync();
  /// Runs a collective; under fault tolerance, a failure is kept for
  /// take_failure() instead of raised.
  template <typename Collective>
  void tolerated(Collective&& collective);
  /// Every distinct outer optimizer, once.
  std::vector<torch::optim::Optimizer*> distinct_outer() const;

  // detail::Guarded
  World world() const override {
    return replicas;
  }
  void tolerate_failures() override {
    tolerating = true;
  }
  std::string take_failure() override {
    return std::exchange(failure, std::string());
  }
  int64_t synchronisations() const override {
    return sent;
  }
  void adopt_world(World next) override {
    replicas = std::move(next);
  }
  std::vector<at::Tensor> replica_tensors(bool buffers_only) const override;
};

} // namespace lockstep
