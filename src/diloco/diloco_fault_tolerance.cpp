// DiLoCo under lockstep::FaultTolerance: each fragment's synchronisation is
// a step that the replicas agree on. A replica that fails costs the one in
// flight (every replica restores the fragment's global parameters and
// merges its local ones, as torchft does when a quorum does not commit),
// and the survivors go on over those present. A replica restarted alone
// receives, at the others' next synchronisation, the parameters and the
// global ones (as the replica's tensors), the inner optimizer's state (as
// the optimizer's), and the outer optimizers' states with the local step
// and the syncs (as state of its own); it sends zeros that time and counts
// for nothing in the divisor, then trains as any replica.

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <lockstep/error.h>

#include "diloco/diloco_impl.h"
#include "fault/loop_state.h"
#include "optim/optimizer_bytes.h"
#include "world/epoch_world.h"

namespace lockstep {

std::vector<at::Tensor> DiLoCo::Impl::replica_tensors(bool buffers_only) const {
  std::vector<at::Tensor> tensors;
  if (buffers_only) {
    return tensors; // what a dropped synchronisation touched, end_sync puts back itself
  }
  for (const auto& fragment : fragments) {
    tensors.insert(tensors.end(), fragment.begin(), fragment.end());
  }
  for (const auto& fragment : global) {
    tensors.insert(tensors.end(), fragment.begin(), fragment.end());
  }
  return tensors;
}

namespace {

// Before anything collective: what FaultTolerance(diloco, inner) cannot take.
std::shared_ptr<detail::Guarded> checked(DiLoCo::Impl& impl, torch::optim::Optimizer& inner) {
  LOCKSTEP_ENFORCE(&inner == &impl.inner, UsageError, "FaultTolerance(diloco, inner): `inner` "
                   "must be the inner optimizer that the DiLoCo was built with.");
  LOCKSTEP_ENFORCE(impl.fault_tolerance == nullptr, UsageError, "a DiLoCo takes one "
                   "FaultTolerance.");
  LOCKSTEP_ENFORCE(impl.local_step == 0 && !impl.pending, UsageError, "build the "
                   "FaultTolerance of a DiLoCo before its first step.");
  LOCKSTEP_ENFORCE(
      detail::WorldAccess::standby(impl.replicas) ||
          impl.replicas.size() == detail::WorldAccess::slots(impl.replicas),
      UsageError, "FaultTolerance(diloco, ...) takes a DiLoCo over the job's world (one rank "
      "per replica); this one runs over ", impl.replicas.size(), " of the job's ",
      detail::WorldAccess::slots(impl.replicas), " ranks (replicas of several ranks running "
      "DDP inside are not fault tolerant yet: a rank that dies breaks its replica's world).");
  return std::shared_ptr<detail::Guarded>(impl.shared_from_this());
}

} // namespace

FaultTolerance::FaultTolerance(DiLoCo& diloco, torch::optim::Optimizer& inner,
                               FaultToleranceOptions options)
    : FaultTolerance(checked(*diloco.impl_, inner), inner, options) {
  auto& impl = *diloco.impl_;
  // Between two synchronisations the replicas are not in step: only the
  // agreement at a commit may move them to a new world (loop_state.h).
  impl_->reform_only_when_decided = true;
  register_state(
      "lockstep::DiLoCo",
      [&impl](torch::serialize::OutputArchive& archive) {
        archive.write("local_step", at::scalar_tensor(impl.local_step, at::kLong));
        archive.write("syncs", at::scalar_tensor(impl.syncs, at::kLong));
        auto outer = impl.distinct_outer();
        for (size_t k = 0; k < outer.size(); ++k) {
          archive.write("outer " + std::to_string(k),
                        c10::IValue(detail::optimizer_bytes(*outer[k])));
        }
      },
      [&impl](torch::serialize::InputArchive& archive) {
        at::Tensor local_step;
        at::Tensor syncs;
        archive.read("local_step", local_step);
        archive.read("syncs", syncs);
        impl.local_step = local_step.item<int64_t>();
        impl.syncs = syncs.item<int64_t>();
        auto outer = impl.distinct_outer();
        for (size_t k = 0; k < outer.size(); ++k) {
          c10::IValue bytes;
          archive.read("outer " + std::to_string(k), bytes);
          detail::load_optimizer_bytes(*outer[k], bytes.toStringRef());
        }
        impl.received_state = true;
      });
  impl.fault_tolerance = this;
}

} // namespace lockstep
