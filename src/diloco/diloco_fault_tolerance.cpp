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
#include "optim/optimizer_bytes.h"

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

FaultTolerance::FaultTolerance(DiLoCo& diloco, torch::optim::Optimizer& inner,
                               FaultToleranceOptions options)
    : FaultTolerance(std::static_pointer_cast<detail::Guarded>(diloco.impl_), inner, options) {
  auto& impl = *diloco.impl_;
  LOCKSTEP_ENFORCE(&inner == &impl.inner, UsageError, "FaultTolerance(diloco, inner): `inner` "
                   "must be the inner optimizer that the DiLoCo was built with.");
  LOCKSTEP_ENFORCE(impl.fault_tolerance == nullptr, UsageError, "a DiLoCo takes one "
                   "FaultTolerance.");
  LOCKSTEP_ENFORCE(impl.local_step == 0 && !impl.pending, UsageError, "build the "
                   "FaultTolerance of a DiLoCo before its first step.");
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
        at::Tensor value;
        archive.read("local_step", value);
        impl.local_step = value.item<int64_t>();
        archive.read("syncs", value);
        impl.syncs = value.item<int64_t>();
        auto outer = impl.distinct_outer();
        for (size_t k = 0; k < outer.size(); ++k) {
          c10::IValue bytes;
          archive.read("outer " + std::to_string(k), bytes);
          detail::load_optimizer_bytes(*outer[k], bytes.toStringRef());
        }
      });
  impl.fault_tolerance = this;
}

} // namespace lockstep
