// The built-in communication hooks: plain all-reduce, and the 16-bit
// compressions. A 16-bit tensor travels as 16 bits and is summed in float32
// by every transport on the CPU (the shared-memory transport in place, Gloo
// by sending each rank's 16-bit tensor to the others:
// process_group_transport.cpp), started at once so that it crosses while
// backward goes on.

#include <lockstep/comm_hook.h>

#include <map>
#include <memory>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <lockstep/error.h>

#include "hooks/compress_hooks.h"

namespace lockstep::detail {

CommHook compress_to(at::ScalarType wire) {
  // Per bucket, the 16-bit tensor that travels, made by World::allocate
  // (once per bucket and size, on every rank alike): with shared memory,
  // in the segment, so that it is reduced in place.
  auto wires = std::make_shared<std::map<size_t, at::Tensor>>();
  return [wire, wires](GradBucket& bucket) -> BucketFuture {
    at::NoGradGuard no_grad;
    World world = bucket.world;
    int n = world.size();
    auto gradients = bucket.gradients;
    // On a GPU the 16-bit tensor stays on the device and NCCL sums it in
    // its format, as PyTorch's hook does (each part already divided).
    bool on_device = !gradients.device().is_cpu();
    auto& compressed = (*wires)[bucket.index];
    if (!compressed.defined() || compressed.numel() != gradients.numel()) {
      compressed = on_device ? at::empty({gradients.numel()}, gradients.options().dtype(wire))
                             : world.allocate(gradients.numel(), wire);
    }
    // Divided first, as PyTorch's hook does: the sum of n averages cannot
    // overflow where the sum of n gradients might. One pass, rounded once.
    at::div_out(compressed, gradients, at::scalar_tensor(n, gradients.options()));
    bucket.bytes_sent = compressed.nbytes();
    std::string what = detail::str(c10::toString(wire), " all-reduce of ", bucket.description);
    auto work = world.all_reduce_async(compressed, ReduceOp::Sum, what);
    return [work, compressed, gradients]() mutable {
      work.wait();
      return gradients.copy_(compressed);
    };
  };
}

CommHook wrap_in(at::ScalarType wire, CommHook inner) {
  LOCKSTEP_ENFORCE(inner != nullptr, UsageError, "a compression wrapper needs a hook to wrap.");
  return [wire, inner = std::move(inner)](GradBucket& bucket) -> BucketFuture {
    at::NoGradGuard no_grad;
    auto gradients = bucket.gradients;
    GradBucket compressed = bucket;
    compressed.gradients = gradients.to(wire);
    auto future = inner(compressed);
    bucket.bytes_sent = compressed.bytes_sent >= 0 ? compressed.bytes_sent
                                                   : compressed.gradients.nbytes();
    return [future, gradients]() mutable {
      at::NoGradGuard no_grad;
      return gradients.copy_(future().reshape({-1}));
    };
  };
}

} // namespace lockstep::detail

namespace lockstep::hooks {

using detail::compress_to;
using detail::wrap_in;

CommHook fp16_wrapper(CommHook inner) {
  return wrap_in(at::kHalf, std::move(inner));
}

CommHook bf16_wrapper(CommHook inner) {
  return wrap_in(at::kBFloat16, std::move(inner));
}

CommHook allreduce() {
  return [](GradBucket& bucket) -> BucketFuture {
    auto gradients = bucket.gradients;
    bucket.bytes_sent = gradients.nbytes();
    // World's average: 16-bit gradients (inside fp16_wrapper) are divided
    // before they are summed, so that a sum above the format's range does
    // not become inf.
    auto work = bucket.world.all_reduce_async(gradients, ReduceOp::Average,
                                              "all_reduce of " + bucket.description);
    return [work, gradients]() mutable {
      work.wait();
      return gradients;
    };
  };
}

CommHook fp16_compress() {
  return compress_to(at::kHalf);
}

CommHook bf16_compress() {
  return compress_to(at::kBFloat16);
}

} // namespace lockstep::hooks
