#pragma once

// DistributedDataParallel for LibTorch: wraps a module so that N processes
// keep N identical replicas, averaging gradients across ranks during
// backward, bucketed and overlapped with it.

#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <lockstep/ddp_options.h>
#include <lockstep/ddp_stats.h>
#include <lockstep/join.h>
#include <lockstep/step_in_backward.h>
#include <lockstep/detail/reducer.h>
#include <lockstep/world.h>

namespace lockstep {
namespace detail {

template <typename T>
struct is_shared_module_ptr : std::false_type {};
template <typename T>
struct is_shared_module_ptr<std::shared_ptr<T>>
    : std::is_base_of<torch::nn::Module, T> {};

template <typename ModuleType>
torch::nn::Module& module_of(ModuleType& module) {
  if constexpr (std::is_same_v<ModuleType, torch::nn::AnyModule>) {
    return *module.ptr();
  } else {
    static_assert(
        torch::detail::is_module_holder<ModuleType>::value ||
            is_shared_module_ptr<ModuleType>::value,
        "DistributedDataParallel wraps a torch::nn::ModuleHolder (as made "
        "by TORCH_MODULE), a std::shared_ptr to a torch::nn::Module, or a "
        "torch::nn::AnyModule");
    return *module;
  }
}

template <typename ModuleType, typename... Args>
auto call_forward(ModuleType& module, Args&&... args) {
  if constexpr (std::is_same_v<ModuleType, torch::nn::AnyModule>) {
    return module.forward(std::forward<Args>(args)...);
  } else {
    return module->forward(std::forward<Args>(args)...);
  }
}

// An argument of forward as the module receives it: a floating tensor in
// the mixed-precision policy's dtype when there is one, anything else as
// given.
template <typename T>
decltype(auto) cast_input(T&& arg, const std::optional<at::ScalarType>& dtype) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    if (dtype && arg.defined() && arg.is_floating_point() && arg.scalar_type() != *dtype) {
      return at::Tensor(arg.to(*dtype));
    }
    return at::Tensor(std::forward<T>(arg));
  } else {
    return std::forward<T>(arg);
  }
}

// The tensors in a forward's output, for the graph walk of
// find_unused_parameters. An output of another type yields none, and the
// walk is then skipped: unused parameters are still found at the end of
// backward.
inline void collect_tensors(const at::Tensor& tensor, std::vector<at::Tensor>& out) {
  out.push_back(tensor);
}
inline void collect_tensors(const std::vector<at::Tensor>& tensors, std::vector<at::Tensor>& out) {
  out.insert(out.end(), tensors.begin(), tensors.end());
}
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& tuple, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... item) { (collect_tensors(item, out), ...); }, tuple);
}
template <typename A, typename B>
void collect_tensors(const std::pair<A, B>& pair, std::vector<at::Tensor>& out) {
  collect_tensors(pair.first, out);
  collect_tensors(pair.second, out);
}
template <typename T>
void collect_tensors(const T&, std::vector<at::Tensor>& out) {
  out.push_back(at::Tensor()); // marks the output as not walkable
}

} // namespace detail

/// Keeps gradients local while alive: backward passes accumulate, and the
/// next backward outside the guard averages the accumulated sum.
class NoSyncGuard {
 public:
  explicit NoSyncGuard(std::shared_ptr<detail::Reducer> reducer)
      : reducer_(std::move(reducer)), previous_(reducer_->sync_enabled()) {
    reducer_->set_sync_enabled(false);
  }
  NoSyncGuard(NoSyncGuard&& other) noexcept
      : reducer_(std::move(other.reducer_)), previous_(other.previous_) {}
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;
  ~NoSyncGuard() {
    if (reducer_) {
      reducer_->set_sync_enabled(previous_);
    }
  }

 private:
  std::shared_ptr<detail::Reducer> reducer_;
  bool previous_;
};

/// Wraps `module` so that its replicas on all ranks of `world` stay
/// identical. Construction is collective: every rank must construct it, with
/// the same model. See docs/ddp.md.
///
///   auto ddp = lockstep::DDP<Net>(Net(), world);
///   torch::optim::SGD optimizer(ddp.module()->parameters(), 0.1);
///   auto loss = torch::nll_loss(ddp(x), y);
///   loss.backward();   // gradients are averaged across ranks here
///   optimizer.step();
template <typename ModuleType>
class DistributedDataParallel {
 public:
  DistributedDataParallel(ModuleType module, World world, DdpOptions options = {})
      : module_(std::move(module)),
        reducer_(std::make_shared<detail::Reducer>(
            detail::module_of(module_), std::move(world), options)) {}

  /// Runs the module's forward, with what must happen before it (buffer
  /// broadcast when needed).
  template <typename... Args>
  auto forward(Args&&... args) {
    reducer_->before_forward();
    auto dtype = reducer_->input_dtype();
    auto output = [&] {
      try {
        return detail::call_forward(module_,
                                    detail::cast_input(std::forward<Args>(args), dtype)...);
      } catch (...) {
        reducer_->forward_failed();
        throw;
      }
    }();
    std::vector<at::Tensor> tensors;
    detail::collect_tensors(output, tensors);
    reducer_->after_forward(tensors);
    return output;
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }
  /// For the `ddp->forward(x)` spelling of torch::nn modules.
  DistributedDataParallel* operator->() {
    return this;
  }

  ModuleType& module() {
    return module_;
  }
  const ModuleType& module() const {
    return module_;
  }

  /// `auto guard = ddp.no_sync();` keeps gradients local while it lives.
  [[nodiscard]] NoSyncGuard no_sync() {
    return NoSyncGuard(reducer_);
  }

  /// Before the first forward, on every rank: each bucket's gradients
  /// travel through `hook` (comm_hook.h), for example
  /// lockstep::hooks::fp16_compress().
  void register_comm_hook(CommHook hook) {
    reducer_->register_comm_hook(std::move(hook));
  }

  /// Before the first forward, on every rank: `optimizer` steps each
  /// bucket's parameters as soon as that bucket's average is written back,
  /// on synchronised backward passes, instead of optimizer.step() after
  /// backward (which then must not be called: the next forward raises
  /// UsageError if the parameters changed in place since). A
  /// ZeroRedundancyOptimizer steps its shard and brings the new parameters
  /// to every rank there. See step_in_backward.h.
  void step_in_backward(torch::optim::Optimizer& optimizer,
                        const StepInBackwardOptions& options = {}) {
    reducer_->step_in_backward(optimizer, options);
  }
  /// The same through the per-parameter seam, for any other way to step.
  void step_in_backward(ParameterStep step, const StepInBackwardOptions& options = {}) {
    reducer_->step_in_backward(std::move(step), options);
  }

  /// Before the first forward, on every rank, with
  /// DdpOptions().shard_gradients(true) (ZeRO-2): `optimizer`, a
  /// ZeroRedundancyOptimizer over the module's trainable parameters in
  /// ZeroPartition::Elements, shards them by the buckets; after each
  /// synchronised backward its pieces' gradients hold this rank's slice of
  /// the average, and optimizer.step() steps them and all-gathers the new
  /// parameters. step_in_backward(optimizer) registers it as well.
  void shard_gradients_with(torch::optim::Optimizer& optimizer) {
    reducer_->shard_gradients_with(optimizer);
  }

  /// `auto join = ddp.join();` around the training loop lets ranks hold
  /// different numbers of batches (see join.h).
  [[nodiscard]] JoinGuard join(const JoinOptions& options = {}) {
    return JoinGuard(reducer_, options);
  }

  DdpStats stats() const {
    return reducer_->stats();
  }

  /// Collective: checks, with one small all-gather of per-tensor checksums,
  /// that every rank holds bit-identical parameters and the buffers that
  /// should be equal now (see ReplicaCheck); raises lockstep::UsageError
  /// naming the first tensor that differs and the ranks that hold other
  /// values. Passes at any point between steps of a healthy model, BatchNorm
  /// included. DdpOptions::verify_every runs it periodically.
  void check_replicas(ReplicaCheck what = ReplicaCheck::All) {
    reducer_->check_replicas(what);
  }

  /// Collective: every rank takes rank 0's buffers now (before an
  /// evaluation on every rank, or a check of all buffers), as the next
  /// forward would do for those that changed.
  void sync_buffers() {
    reducer_->sync_buffers();
  }

  /// The reducer, for the parts of lockstep that extend the wrapper
  /// (lockstep::FaultTolerance).
  const std::shared_ptr<detail::Reducer>& reducer() const {
    return reducer_;
  }

 private:
  ModuleType module_;
  std::shared_ptr<detail::Reducer> reducer_;
};

template <typename ModuleType>
using DDP = DistributedDataParallel<ModuleType>;

} // namespace lockstep
