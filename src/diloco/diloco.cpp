// DiLoCo's schedule and arithmetic (diloco.h), as torchft's: fragment
// syncs() % F is sent fragment_sync_delay steps before each multiple of
// H / F and applied at it. Its pseudo-gradient (the saved global parameters
// minus the local ones) travels as one flat tensor (of the parameters' type,
// or DiLoCoOptions::wire_dtype), summed across the replicas, with each
// replica's share of the divisor as its last value: 1, or 0 for a replica
// that has just received the live state (fault_tolerance.cpp here).

#include <lockstep/diloco.h>

#include <lockstep/grad_scaler.h>

#include <algorithm>
#include <optional>
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/optimizer.h>

#include <lockstep/error.h>

#include "common/wording.h"
#include "diloco/diloco_impl.h"
#include "reducer/model_state.h"
#include "world/epoch_world.h"

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

// Every replica must run the same schedule over the same shapes, or an
// all-reduce would be skipped by some or sized differently: one exchange,
// then the same error on every rank.
void check_alike(World& replicas, const std::string& signature) {
  auto signatures = replicas.all_gather_strings(signature);
  for (size_t r = 1; r < signatures.size(); ++r) {
    LOCKSTEP_ENFORCE(signatures[r] == signatures[0], ConfigError, "DiLoCo: the replicas "
                     "differ: rank 0 has ", signatures[0], "; rank ", r, " has ",
                     signatures[r], ".");
  }
}

bool holds(const torch::optim::Optimizer& optimizer, const at::Tensor& parameter) {
  const auto& groups = optimizer.param_groups();
  return std::any_of(groups.begin(), groups.end(),
                     [&](const auto& group) { return among(group.params(), parameter); });
}

} // namespace

template <typename Collective>
void DiLoCo::Impl::tolerated(Collective&& collective) {
  // Under fault tolerance a peer's failure ends the synchronisation
  // quietly: commit() then drops it on every replica.
  try {
    collective();
  } catch (const CollectiveError& e) {
    if (!tolerating) {
      throw;
    }
    failure = e.what();
  } catch (const TimeoutError& e) {
    if (!tolerating) {
      throw;
    }
    failure = e.what();
  }
}

void DiLoCo::Impl::begin_sync() {
  bool participates = true;
  if (fault_tolerance != nullptr) {
    // A replica that rejoins receives the live state here, local step and
    // syncs included: it sends where the others send, but zeros, and its
    // share of the divisor is 0 (its parameters are its sender's).
    received_state = false;
    fault_tolerance->begin_step();
    participates = joined && !received_state;
    joined = true;
    TORCH_INTERNAL_ASSERT(send_due(), "the replicas synchronise at the same local steps");
  }
  auto fragment = static_cast<size_t>(syncs % static_cast<int64_t>(fragments.size()));
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> pieces;
  for (size_t i = 0; i < fragments[fragment].size(); ++i) {
    pieces.push_back((global[fragment][i] - fragments[fragment][i]).reshape(-1));
  }
  const auto& first = fragments[fragment].front();
  pieces.push_back(at::full({1}, participates ? 1.0 : 0.0, first.options()));
  auto flat = at::cat(pieces);
  if (!participates) {
    flat.zero_();
  }
  if (options.wire_dtype()) {
    flat = flat.to(*options.wire_dtype());
  }
  ++sent;
  pending = Pending{fragment, flat, std::nullopt};
  tolerated([&] {
    pending->work = replicas.all_reduce_async(
        flat, ReduceOp::Sum,
        detail::str("DiLoCo pseudo-gradient of fragment ", fragment, " (", flat.numel() - 1,
                    " values)"));
  });
}

void DiLoCo::Impl::end_sync() {
  TORCH_INTERNAL_ASSERT(pending.has_value(), "a fragment is applied after it was sent");
  auto sent_fragment = std::move(*pending);
  pending.reset();
  if (sent_fragment.work) {
    tolerated([&] { sent_fragment.work->wait(); });
  }
  bool counts = fault_tolerance == nullptr || fault_tolerance->commit();
  at::NoGradGuard no_grad;
  auto& parameters = fragments[sent_fragment.fragment];
  auto& saved = global[sent_fragment.fragment];
  double alpha = options.fragment_update_alpha();
  std::vector<at::Tensor> local;
  for (auto& parameter : parameters) {
    if (alpha > 0) {
      local.push_back(parameter.clone());
    }
  }
  // torchft's: the fragment goes back to its global parameters; for a
  // synchronisation that counts, the outer optimizer steps them and the
  // local ones are merged in; for one that is dropped, the fragment keeps
  // the global parameters of the last one that counted.
  for (size_t i = 0; i < parameters.size(); ++i) {
    parameters[i].copy_(saved[i]);
  }
  if (counts) {
    auto sum = sent_fragment.flat.to(parameters.front().scalar_type());
    int64_t values = sum.numel() - 1;
    auto average = sum.narrow(0, 0, values).div_(sum[values]);
    int64_t offset = 0;
    for (auto& parameter : parameters) {
      parameter.mutable_grad() =
          average.narrow(0, offset, parameter.numel()).view_as(parameter);
      offset += parameter.numel();
    }
    step_only(*outer[sent_fragment.fragment], parameters);
    for (size_t i = 0; i < parameters.size(); ++i) {
      saved[i].copy_(parameters[i]);
      parameters[i].mutable_grad().reset();
    }
    ++syncs;
    if (alpha > 0) {
      for (size_t i = 0; i < parameters.size(); ++i) {
        parameters[i].lerp_(local[i], alpha);
      }
    }
  }
}

std::vector<torch::optim::Optimizer*> DiLoCo::Impl::distinct_outer() const {
  std::vector<torch::optim::Optimizer*> distinct;
  for (auto* optimizer : outer) {
    if (std::find(distinct.begin(), distinct.end(), optimizer) == distinct.end()) {
      distinct.push_back(optimizer);
    }
  }
  return distinct;
}

DiLoCo::DiLoCo(World replicas, std::vector<std::vector<at::Tensor>> fragments,
               torch::optim::Optimizer& inner, std::vector<torch::optim::Optimizer*> outer,
               DiLoCoOptions options)
    : impl_(std::make_shared<Impl>(std::move(replicas), std::move(fragments), inner,
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
  LOCKSTEP_ENFORCE(!options.wire_dtype() || *options.wire_dtype() == at::kBFloat16 ||
                       *options.wire_dtype() == at::kHalf ||
                       at::isFloatingType(*options.wire_dtype()),
                   ConfigError, "DiLoCoOptions::wire_dtype must be a floating type (at::kBFloat16 "
                   "or at::kHalf to halve the bytes), not ", *options.wire_dtype(), ".");
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
  std::ostringstream signature;
  signature << "sync_every " << options.sync_every() << ", fragment_sync_delay "
            << options.fragment_sync_delay() << ", fragment_update_alpha "
            << options.fragment_update_alpha() << ", wire_dtype "
            << (options.wire_dtype() ? c10::toString(*options.wire_dtype()) : "as the parameters")
            << ", fragments of";
  for (const auto& fragment : impl.fragments) {
    int64_t values = 0;
    for (const auto& parameter : fragment) {
      values += parameter.numel();
    }
    signature << " " << values << " " << fragment.front().scalar_type();
  }
  // Restarted alone (lockstep-run --restart rank), a replica calls no
  // collective: the live state comes with its first step, through fault
  // tolerance.
  impl.joined = !detail::WorldAccess::standby(impl.replicas);
  if (impl.joined) {
    check_alike(impl.replicas, signature.str());
  }
  for (const auto& fragment : impl.fragments) {
    if (impl.joined) {
      detail::broadcast_from(impl.replicas, 0, fragment, "the replicas' first parameters");
    }
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
  if (impl_->pending && impl_->pending->work) {
    try {
      impl_->pending->work->wait();
    } catch (const std::exception&) {
      // A peer that failed: nothing to apply, nothing to report.
    }
  }
}

void DiLoCo::step() {
  step_with([this] { impl_->inner.step(); });
}

void DiLoCo::step(amp::GradScaler& scaler) {
  step_with([this, &scaler] { scaler.step(impl_->inner); });
}

void DiLoCo::step_with(const std::function<void()>& inner_step) {
  auto& impl = *impl_;
  LOCKSTEP_ENFORCE(impl.joined || impl.fault_tolerance != nullptr, UsageError,
                   "this DiLoCo replica was restarted alone (lockstep-run --restart rank) and "
                   "can only rejoin through a lockstep::FaultTolerance built over it.");
  // A replica restarted alone takes no step of its own: its first receives
  // the live state at the others' next synchronisation, and sends with them.
  bool joining = !impl.joined;
  if (!joining) {
    // A step that a GradScaler skipped counts too: replicas skip apart
    // (each its own scale), and counting calls keeps every replica's
    // synchronisations at the same calls, so that none waits for one that
    // another will never make. (torchft counts steps taken, from its
    // optimizer's post-step hook.)
    inner_step();
    ++impl.local_step;
  }
  if (joining || impl.send_due()) {
    impl.begin_sync();
  }
  if (impl.local_step % impl.interval() == 0) {
    impl.end_sync();
  }
}

int64_t DiLoCo::local_step() const {
  return impl_->local_step;
}

int64_t DiLoCo::syncs() const {
  return impl_->syncs;
}

} // namespace lockstep
