// DiLoCo's schedule and arithmetic (diloco.h), as torchft's: fragment
// syncs() % F is sent fragment_sync_delay steps before each multiple of
// H / F and applied at it. Its pseudo-gradient (the saved global parameters
// minus the local ones) travels as one flat tensor of the parameters' type,
// summed across the replicas and divided by their number once.

#include <lockstep/diloco.h>

#include <algorithm>
#include <optional>
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/optimizer.h>

#include <lockstep/error.h>

#include "common/wording.h"
#include "reducer/model_state.h"

namespace lockstep {
namespace {

bool among(const std::vector<at::Tensor>& tensors, const at::Tensor& tensor) {
  return std::any_of(tensors.begin(), tensors.end(),
                     [&](const at::Tensor& t) { return t.is_same(tensor); });
}

// Steps `optimizer` on `fragment` alone: an optimizer that holds other
// parameters (one outer optimizer for every fragment) would step them too
// with whatever gradient they hold (the inner one), so theirs are put
// aside for the step.
void step_only(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& fragment) {
  std::vector<std::pair<at::Tensor, at::Tensor>> set_aside;
  for (auto& group : optimizer.param_groups()) {
    for (auto& parameter : group.params()) {
      if (parameter.grad().defined() && !among(fragment, parameter)) {
        set_aside.emplace_back(parameter, parameter.grad());
        parameter.mutable_grad().reset();
      }
    }
  }
  optimizer.step();
  for (auto& [parameter, grad] : set_aside) {
    parameter.mutable_grad() = grad;
  }
}

bool holds(const torch::optim::Optimizer& optimizer, const at::Tensor& parameter) {
  const auto& groups = optimizer.param_groups();
  return std::any_of(groups.begin(), groups.end(),
                     [&](const auto& group) { return among(group.params(), parameter); });
}

} // namespace

struct DiLoCo::Impl {
  World replicas;
  std::vector<std::vector<at::Tensor>> fragments;
  torch::optim::Optimizer& inner;
  std::vector<torch::optim::Optimizer*> outer; // one per fragment
  DiLoCoOptions options;
  std::vector<std::vector<at::Tensor>> global; // saved, per fragment
  int64_t local_step = 0;
  int64_t syncs = 0;
  struct Pending {
    size_t fragment = 0;
    at::Tensor flat;
    PendingCollective work;
  };
  std::optional<Pending> pending;

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

  void send(size_t fragment) {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> pieces;
    for (size_t i = 0; i < fragments[fragment].size(); ++i) {
      pieces.push_back((global[fragment][i] - fragments[fragment][i]).reshape(-1));
    }
    auto flat = at::cat(pieces);
    auto work = replicas.all_reduce_async(
        flat, ReduceOp::Sum,
        detail::str("DiLoCo pseudo-gradient of fragment ", fragment, " (", flat.numel(),
                    " values)"));
    pending = Pending{fragment, flat, std::move(work)};
  }

  void apply() {
    TORCH_INTERNAL_ASSERT(pending.has_value(), "a fragment is applied after it was sent");
    auto sent = std::move(*pending);
    pending.reset();
    sent.work.wait();
    at::NoGradGuard no_grad;
    auto average = sent.flat.div_(replicas.size());
    auto& parameters = fragments[sent.fragment];
    auto& saved = global[sent.fragment];
    double alpha = options.fragment_update_alpha();
    std::vector<at::Tensor> local;
    int64_t offset = 0;
    for (size_t i = 0; i < parameters.size(); ++i) {
      auto& parameter = parameters[i];
      if (alpha > 0) {
        local.push_back(parameter.clone());
      }
      parameter.copy_(saved[i]);
      parameter.mutable_grad() =
          average.narrow(0, offset, parameter.numel()).view_as(parameter);
      offset += parameter.numel();
    }
    step_only(*outer[sent.fragment], parameters);
    for (size_t i = 0; i < parameters.size(); ++i) {
      auto& parameter = parameters[i];
      saved[i].copy_(parameter);
      if (alpha > 0) {
        parameter.lerp_(local[i], alpha);
      }
      parameter.mutable_grad().reset();
    }
    ++syncs;
  }
};

DiLoCo::DiLoCo(World replicas, std::vector<std::vector<at::Tensor>> fragments,
               torch::optim::Optimizer& inner, std::vector<torch::optim::Optimizer*> outer,
               DiLoCoOptions options)
    : impl_(std::make_unique<Impl>(std::move(replicas), std::move(fragments), inner,
                                   std::move(outer), options)) {
  auto& impl = *impl_;
  auto count = static_cast<int64_t>(impl.fragments.size());
  LOCKSTEP_ENFORCE(count > 0, ConfigError, "DiLoCo needs at least one fragment of parameters.");
  LOCKSTEP_ENFORCE(options.sync_every() >= 1 && options.sync_every() % count == 0, ConfigError,
                   "DiLoCoOptions::sync_every (", options.sync_every(), ") must be a positive "
                   "multiple of the number of fragments (", count, "): one fragment is "
                   "synchronised every sync_every / fragments steps.");
  LOCKSTEP_ENFORCE(options.fragment_sync_delay() >= 0 &&
                       options.fragment_sync_delay() < impl.interval(),
                   ConfigError, "DiLoCoOptions::fragment_sync_delay (",
                   options.fragment_sync_delay(), ") must be at least 0 and less than "
                   "sync_every / fragments (", impl.interval(), "): a fragment is applied "
                   "before the next one is sent.");
  LOCKSTEP_ENFORCE(options.fragment_update_alpha() >= 0 && options.fragment_update_alpha() <= 1,
                   ConfigError, "DiLoCoOptions::fragment_update_alpha must be within [0, 1], "
                   "not ", options.fragment_update_alpha(), ".");
  LOCKSTEP_ENFORCE(impl.outer.size() == 1 || static_cast<int64_t>(impl.outer.size()) == count,
                   ConfigError, "DiLoCo takes one outer optimizer per fragment (", count,
                   ") or one for all, not ", impl.outer.size(), ".");
  if (impl.outer.size() == 1) {
    impl.outer.assign(impl.fragments.size(), impl.outer.front());
  }
  for (size_t k = 0; k < impl.fragments.size(); ++k) {
    const auto& fragment = impl.fragments[k];
    LOCKSTEP_ENFORCE(!fragment.empty(), ConfigError, "DiLoCo: fragment ", k,
                     " holds no parameter.");
    LOCKSTEP_ENFORCE(impl.outer[k] != nullptr, ConfigError, "DiLoCo: the outer optimizer of "
                     "fragment ", k, " is null.");
    for (const auto& parameter : fragment) {
      LOCKSTEP_ENFORCE(
          parameter.defined() && parameter.scalar_type() == fragment.front().scalar_type() &&
              parameter.device() == fragment.front().device(),
          ConfigError, "DiLoCo: the parameters of fragment ", k, " must be of one type and "
          "on one device (its pseudo-gradient travels as one tensor).");
      LOCKSTEP_ENFORCE(holds(*impl.outer[k], parameter), ConfigError, "DiLoCo: the outer "
                       "optimizer of fragment ", k, " does not hold its parameter of shape ",
                       parameter.sizes(), ".");
    }
  }
  // Every replica must run the same schedule over the same shapes, or an
  // all-reduce would be skipped by some or sized differently: one
  // exchange, then the same error on every rank.
  std::ostringstream signature;
  signature << "sync_every " << options.sync_every() << ", fragment_sync_delay "
            << options.fragment_sync_delay() << ", fragment_update_alpha "
            << options.fragment_update_alpha() << ", fragments of";
  for (const auto& fragment : impl.fragments) {
    int64_t values = 0;
    for (const auto& parameter : fragment) {
      values += parameter.numel();
    }
    signature << " " << values << " " << fragment.front().scalar_type();
  }
  auto signatures = impl.replicas.all_gather_strings(signature.str());
  for (size_t r = 1; r < signatures.size(); ++r) {
    LOCKSTEP_ENFORCE(signatures[r] == signatures[0], ConfigError, "DiLoCo: the replicas "
                     "differ: rank 0 has ", signatures[0], "; rank ", r, " has ",
                     signatures[r], ".");
  }
  for (const auto& fragment : impl.fragments) {
    detail::broadcast_from(impl.replicas, 0, fragment, "the replicas' first parameters");
    std::vector<at::Tensor> saved;
    for (const auto& parameter : fragment) {
      saved.push_back(parameter.detach().clone());
    }
    impl.global.push_back(std::move(saved));
  }
}

DiLoCo::~DiLoCo() {
  // A fragment sent in the last fragment_sync_delay steps is not applied,
  // but its all-reduce is not left running either (the others wait for it).
  if (impl_->pending) {
    try {
      impl_->pending->work.wait();
    } catch (const std::exception&) {
      // A peer that failed: nothing to apply, nothing to report.
    }
  }
}

void DiLoCo::step() {
  auto& impl = *impl_;
  impl.inner.step();
  ++impl.local_step;
  auto next = static_cast<size_t>(impl.syncs % static_cast<int64_t>(impl.fragments.size()));
  int64_t delay = impl.options.fragment_sync_delay();
  if (delay > 0 && (impl.local_step + delay) % impl.interval() == 0) {
    impl.send(next);
  }
  if (impl.local_step % impl.interval() == 0) {
    if (delay == 0) {
      impl.send(next);
    }
    impl.apply();
  }
}

int64_t DiLoCo::local_step() const {
  return impl_->local_step;
}

int64_t DiLoCo::syncs() const {
  return impl_->syncs;
}

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
