#pragma once

// Training across slow links: each replica takes sync_every (H) steps with
// its own (inner) optimizer, then the replicas average their
// pseudo-gradients (the global parameters they started from, minus their
// local ones) and an outer optimizer steps the global parameters: DiLoCo
// (Douillard et al., arXiv 2311.08105). With the parameters cut into F
// fragments, one fragment is synchronised every H / F steps, its
// all-reduce running in the background for fragment_sync_delay inner steps:
// Streaming DiLoCo (arXiv 2501.18512). The schedule and the arithmetic are
// torchft's (torchft/local_sgd.py), so that a program moved from it gets the
// same numbers. With one rank per replica, a lockstep::FaultTolerance built
// over the DiLoCo (fault_tolerance.h) makes each synchronisation a step that
// the replicas agree on: a replica that dies costs one (the one in flight,
// or the next), and a restarted one rejoins with the live state. See
// docs/diloco.md.
//
//   auto groups = lockstep::replica_groups(world);
//   lockstep::DDP<Net> ddp(model, groups.replica);          // inside a replica
//   torch::optim::AdamW inner(model->parameters(), ...);
//   torch::optim::SGD outer(model->parameters(),
//                           torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
//   lockstep::DiLoCo diloco(groups.across, {model->parameters()}, inner, {&outer},
//                           lockstep::DiLoCoOptions().sync_every(100));
//   for (auto& batch : *loader) {
//     inner.zero_grad();
//     loss(ddp(batch.data), batch.target).backward();
//     diloco.step();                                         // not inner.step()
//   }

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <lockstep/world.h>

namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace lockstep {
namespace amp {
class GradScaler;
} // namespace amp

struct DiLoCoOptions {
  /// H: inner steps between two synchronisations of the same fragment; a
  /// multiple of the number of fragments, which are synchronised in turn,
  /// one every H / F steps.
  TORCH_ARG(int64_t, sync_every) = 100;
  /// Inner steps that a fragment's pseudo-gradient travels before it is
  /// applied (Streaming DiLoCo's tau); less than H / F. 0: it is sent and
  /// applied at the same step, and the step waits for it.
  TORCH_ARG(int64_t, fragment_sync_delay) = 0;
  /// Once the outer optimizer has stepped a fragment's global parameters,
  /// the local ones become global + alpha x (local kept aside - global):
  /// 0 takes the global parameters, 1 keeps the local ones.
  TORCH_ARG(double, fragment_update_alpha) = 0.0;
  /// The type the pseudo-gradients travel in: at::kBFloat16 or at::kHalf
  /// halve the bytes of float32 ones; they are summed in float32 and
  /// rounded once, as the 16-bit hooks do. Unset: the parameters' type.
  TORCH_ARG(std::optional<at::ScalarType>, wire_dtype) = std::nullopt;
};

class DiLoCo {
 public:
  /// Collective over `replicas` (one rank per replica, each holding the
  /// same part of the model: DiLoCo's world, the `across` of
  /// replica_groups). Rank 0's parameters become everyone's, and the first
  /// global ones. `fragments` lists each fragment's parameters (one list:
  /// plain DiLoCo); `outer` holds one optimizer per fragment, over exactly
  /// that fragment's parameters, or one over all of them.
  DiLoCo(World replicas, std::vector<std::vector<at::Tensor>> fragments,
         torch::optim::Optimizer& inner, std::vector<torch::optim::Optimizer*> outer,
         DiLoCoOptions options = {});
  ~DiLoCo();
  DiLoCo(const DiLoCo&) = delete;
  DiLoCo& operator=(const DiLoCo&) = delete;

  /// In place of inner.step(): the inner step, then, when due, sends the
  /// next fragment's pseudo-gradient or applies it. Collective over the
  /// replicas at those steps. Under fault tolerance it begins a step where
  /// it sends and commits it where it applies; on a replica restarted
  /// alone, the first call takes no inner step but receives the live state
  /// at the others' next synchronisation.
  void step();
  /// The same with the inner step through `scaler` (scaler.step(inner),
  /// skipped on inf or NaN); call scaler.update() after it, as after
  /// scaler.step(). A skipped step counts as one of the H: replicas skip
  /// apart, each by its own scale, and counting calls keeps their
  /// synchronisations at the same calls (torchft counts steps taken).
  void step(amp::GradScaler& scaler);
  /// Inner steps taken.
  int64_t local_step() const;
  /// Fragment synchronisations applied; the next is fragment syncs() % F.
  int64_t syncs() const;

  struct Impl;

 private:
  friend class FaultTolerance;
  void step_with(const std::function<void()>& inner_step);
  std::shared_ptr<Impl> impl_;
};

/// Averages the parameters across the replicas every sync_every inner
/// steps (Lin et al., arXiv 1805.09767; torchft's LocalSGD).
class LocalSGD {
 public:
  /// Collective over `replicas`: rank 0's parameters become everyone's.
  LocalSGD(World replicas, std::vector<at::Tensor> parameters, torch::optim::Optimizer& inner,
           int64_t sync_every);
  /// In place of inner.step().
  void step();
  /// The same through `scaler`, as DiLoCo::step(scaler).
  void step(amp::GradScaler& scaler);
  int64_t local_step() const {
    return local_step_;
  }

 private:
  World replicas_;
  std::vector<at::Tensor> parameters_;
  torch::optim::Optimizer& inner_;
  int64_t sync_every_;
  int64_t local_step_ = 0;
  void average_when_due();
};

} // namespace lockstep
