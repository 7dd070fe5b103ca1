#pragma once

// mnist_train --diloco H / --local-sgd H: replicas of --replica-ranks ranks
// each, DDP inside a replica every step, and across the replicas DiLoCo
// (outer SGD with Nesterov momentum, as in the paper) or LocalSGD.

#include <memory>
#include <optional>
#include <vector>

#include <torch/torch.h>

#include <lockstep/diloco.h>
#include <lockstep/lockstep.h>

#include "flags.h"

namespace mnist {

class AcrossReplicas {
 public:
  /// Collective over the replicas.
  AcrossReplicas(const Flags& flags, lockstep::World across, torch::nn::Module& model,
                 torch::optim::Optimizer& inner) {
    auto parameters = model.parameters();
    if (flags.local_sgd > 0) {
      local_sgd_.emplace(across, parameters, inner, flags.local_sgd);
      return;
    }
    // F layer groups: consecutive parameters, in the module's order.
    std::vector<std::vector<torch::Tensor>> fragments(static_cast<size_t>(flags.fragments));
    for (size_t i = 0; i < parameters.size(); ++i) {
      fragments[i * fragments.size() / parameters.size()].push_back(parameters[i]);
    }
    std::vector<torch::optim::Optimizer*> outer;
    for (const auto& fragment : fragments) {
      outer_.push_back(std::make_unique<torch::optim::SGD>(
          fragment, torch::optim::SGDOptions(flags.outer_lr).momentum(0.9).nesterov(true)));
      outer.push_back(outer_.back().get());
    }
    auto options = lockstep::DiLoCoOptions()
                       .sync_every(flags.diloco)
                       .fragment_sync_delay(flags.fragment_sync_delay);
    if (!flags.diloco_wire.empty()) {
      options.wire_dtype(flags.diloco_wire == "bf16" ? torch::kBFloat16 : torch::kHalf);
    }
    diloco_.emplace(across, fragments, inner, outer, options);
  }

  /// In place of inner.step().
  void step() {
    if (diloco_) {
      diloco_->step();
    } else {
      local_sgd_->step();
    }
  }

 private:
  std::vector<std::unique_ptr<torch::optim::SGD>> outer_;
  std::optional<lockstep::DiLoCo> diloco_;
  std::optional<lockstep::LocalSGD> local_sgd_;
};

/// For scoring: every rank's parameters replaced by the mean over all ranks
/// (the replicas' consensus; within a replica they are equal) until it goes.
class AveragedParameters {
 public:
  AveragedParameters(lockstep::World& world, torch::nn::Module& model)
      : parameters_(model.parameters()) {
    torch::NoGradGuard no_grad;
    for (auto& parameter : parameters_) {
      kept_.push_back(parameter.detach().clone());
      auto sum = parameter.detach().clone();
      world.all_reduce(sum);
      parameter.copy_(sum.div_(world.size()));
    }
  }
  ~AveragedParameters() {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < parameters_.size(); ++i) {
      parameters_[i].copy_(kept_[i]);
    }
  }
  AveragedParameters(const AveragedParameters&) = delete;
  AveragedParameters& operator=(const AveragedParameters&) = delete;

 private:
  std::vector<torch::Tensor> parameters_;
  std::vector<torch::Tensor> kept_;
};

} // namespace mnist
