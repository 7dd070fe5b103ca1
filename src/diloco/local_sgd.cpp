// LocalSGD (diloco.h): every sync_every inner steps, the replicas' mean.

#include <lockstep/diloco.h>

#include <lockstep/grad_scaler.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/optimizer.h>

#include <lockstep/error.h>

#include "reducer/model_state.h"

namespace lockstep {

LocalSGD::LocalSGD(World replicas, std::vector<at::Tensor> parameters,
                   torch::optim::Optimizer& inner, int64_t sync_every)
    : replicas_(std::move(replicas)),
      parameters_(std::move(parameters)),
      inner_(inner),
      sync_every_(sync_every) {
  LOCKSTEP_ENFORCE(sync_every_ >= 1, ConfigError, "LocalSGD's sync_every must be 1 or more, "
                   "not ", sync_every_, ".");
  detail::broadcast_from(replicas_, 0, parameters_, "the replicas' first parameters");
}

void LocalSGD::step() {
  inner_.step();
  average_when_due();
}

void LocalSGD::step(amp::GradScaler& scaler) {
  // A skipped step counts, as in DiLoCo::step(scaler).
  scaler.step(inner_);
  average_when_due();
}

void LocalSGD::average_when_due() {
  if (++local_step_ % sync_every_ != 0) {
    return;
  }
  at::NoGradGuard no_grad;
  for (auto& parameter : parameters_) {
    auto sum = parameter.detach().clone();
    replicas_.all_reduce(sum, ReduceOp::Sum);
    parameter.copy_(sum.div_(replicas_.size()));
  }
}

} // namespace lockstep
