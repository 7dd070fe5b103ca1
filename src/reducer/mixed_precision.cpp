// DdpOptions::mixed_precision, as PyTorch's DDP(mixed_precision=...): the
// floating parameters hold 16-bit copies from a forward to the end of its
// backward (set_data: the same tensors, so that the optimizer, the buckets
// and every reference a program holds stay valid), and their float32 data,
// the masters, the rest of the time. Gradients arrive in 16 bits and are
// copied into the float32 buckets exactly; they are averaged there, or in
// reduce_dtype through the 16-bit hooks' cast, and the optimizer steps the
// masters.

#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>

#include <lockstep/sync_batch_norm.h>

#include "hooks/compress_hooks.h"
#include "reducer/reducer_state.h"

namespace lockstep::detail {
namespace {

// A BatchNorm of torch::nn's (lockstep::is_batch_norm) or a SyncBatchNorm.
bool is_any_batch_norm(const torch::nn::Module& module) {
  return lockstep::is_batch_norm(module) ||
      dynamic_cast<const SyncBatchNormImpl*>(&module) != nullptr;
}

bool is_floating(at::ScalarType dtype) {
  return dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat ||
         dtype == at::kDouble;
}

} // namespace

void check_mixed_precision(const MixedPrecision& policy) {
  for (auto dtype : {std::optional<at::ScalarType>(policy.param_dtype()),
                     policy.reduce_dtype(), policy.buffer_dtype()}) {
    LOCKSTEP_ENFORCE(!dtype || is_floating(*dtype), ConfigError, "MixedPrecision takes "
                     "floating dtypes (Half, BFloat16, Float, Double), not ", *dtype, ".");
  }
}

void Reducer::State::set_up_mixed_precision(const MixedPrecision& policy,
                                            torch::nn::Module& module) {
  MixedPrecisionCopies copies;
  copies.compute = policy.param_dtype();
  at::ScalarType reduce = policy.reduce_dtype().value_or(policy.param_dtype());
  // What BatchNorm holds stays as it is (batch_norm_in_full_precision).
  std::unordered_set<const c10::TensorImpl*> kept;
  for (const auto& item : module.named_modules("", /*include_self=*/true)) {
    const auto& norm = *item.value();
    if (!is_any_batch_norm(norm)) {
      continue;
    }
    if (policy.batch_norm_in_full_precision()) {
      for (const auto& tensor : norm.parameters(/*recurse=*/false)) {
        kept.insert(tensor.unsafeGetTensorImpl());
      }
      for (const auto& tensor : norm.buffers(/*recurse=*/false)) {
        kept.insert(tensor.unsafeGetTensorImpl());
      }
      continue;
    }
    // ATen's BatchNorm takes statistics of its weight's dtype.
    bool synchronised = dynamic_cast<const SyncBatchNormImpl*>(&norm) != nullptr;
    LOCKSTEP_ENFORCE(synchronised || policy.buffer_dtype() == policy.param_dtype(), ConfigError,
                     "MixedPrecision::batch_norm_in_full_precision(false) computes '",
                     item.key(), "' (a BatchNorm) in ", policy.param_dtype(), ", whose running "
                     "statistics must then be ", policy.param_dtype(), " too: set buffer_dtype(",
                     policy.param_dtype(), "), or keep BatchNorm in full precision (the "
                     "default).");
  }
  for (const auto& entry : all_params) {
    if (!entry.tensor.is_floating_point() || kept.count(entry.tensor.unsafeGetTensorImpl())) {
      continue;
    }
    LOCKSTEP_ENFORCE(!entry.tensor.requires_grad() || entry.tensor.scalar_type() == at::kFloat ||
                         entry.tensor.scalar_type() == at::kDouble,
                     UsageError, "DdpOptions::mixed_precision keeps the parameters as the "
                     "optimizer's masters, which must be float32 or float64: '", entry.name,
                     "' is ", entry.tensor.scalar_type(), ". Build the model in float32.");
    if (entry.tensor.requires_grad() && reduce != entry.tensor.scalar_type()) {
      copies.reduce = reduce;
    }
    copies.params.push_back(entry.tensor);
  }
  copies.masters.resize(copies.params.size());
  copies.copies.resize(copies.params.size());
  if (copies.reduce) {
    comm_hook = compress_to(*copies.reduce);
    comm_hook_is_policys = true;
  }
  if (policy.buffer_dtype()) {
    at::NoGradGuard no_grad;
    for (auto& buffer : buffers) {
      if (buffer.is_floating_point() && !kept.count(buffer.unsafeGetTensorImpl())) {
        buffer.set_data(buffer.to(*policy.buffer_dtype()));
      }
    }
  }
  mixed_precision = std::move(copies);
}

void Reducer::State::compute_in_copies() {
  auto& mp = *mixed_precision;
  if (mp.swapped) {
    return; // a forward again before the backward (nesting, a retry)
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < mp.params.size(); ++i) {
    auto& param = mp.params[i];
    // The masters are taken afresh: a checkpoint's load may have given the
    // parameter other storage. Cast at every forward, as PyTorch's DDP
    // does: writes that bump no version (ZeRO's broadcast of the owners'
    // new values, through the transport) must reach the copy too.
    mp.masters[i] = param.detach();
    auto& copy = mp.copies[i];
    if (!copy.defined() || !copy.sizes().equals(param.sizes()) ||
        copy.device() != param.device() || copy.is_inference()) {
      // A normal tensor even when the first forward ran under
      // InferenceMode: a later training forward writes it in place.
      c10::InferenceMode normal(false);
      copy = at::empty_like(param, param.options().dtype(mp.compute));
    }
    copy.copy_(mp.masters[i]);
    // A new dtype drops the parameter's gradient accumulator; before_forward
    // hooks the new one.
    param.set_data(copy);
  }
  mp.swapped = true;
  mp.swapped_at_forward = forwards;
}

void Reducer::State::restore_masters() {
  if (!mixed_precision || !mixed_precision->swapped) {
    return;
  }
  auto& mp = *mixed_precision;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < mp.params.size(); ++i) {
    auto& param = mp.params[i];
    param.set_data(mp.masters[i]);
    mp.masters[i] = at::Tensor();
    // A gradient that autograd made in 16 bits (before any bucket held it:
    // under no_sync, or a sparse one) is kept in the master's dtype, so that
    // accumulation goes on in float32.
    auto& grad = param.mutable_grad();
    if (grad.defined() && grad.scalar_type() != param.scalar_type()) {
      // Differentiable still after backward(create_graph=true).
      at::AutoGradMode keep_graph(grad.requires_grad());
      grad = grad.to(param.scalar_type());
    }
  }
  mp.swapped = false;
  // Now, not at the next forward: a backward that bypasses the wrapper must
  // still find the hooks.
  rehook_replaced_accumulators();
}

void Reducer::State::restore_masters_of_this_forward() {
  // A copy swapped in by an earlier forward whose backward is pending stays:
  // that backward computes with it.
  if (mixed_precision && mixed_precision->swapped_at_forward == forwards) {
    restore_masters();
  }
}

} // namespace lockstep::detail
