#include <lockstep/detail/reducer.h>

#include <algorithm>
#include <iostream>
#include <sstream>
#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>

#include <lockstep/sync_batch_norm.h>

#include "amp/sixteen_bit_support.h"
#include "compat/autocast.h"
#include "hooks/compress_hooks.h"
#include "reducer/bucket_cap.h"
#include "reducer/graph_walk.h"
#include "reducer/model_state.h"
#include "reducer/reducer_state.h"
#include "timeline/recorder.h"

namespace lockstep::detail {
namespace {

std::string mib(int64_t bytes) {
  std::ostringstream out;
  out.precision(bytes < (1 << 20) ? 3 : 1);
  out << std::fixed << static_cast<double>(bytes) / (1 << 20) << " MiB";
  return out.str();
}

} // namespace

Reducer::Reducer(torch::nn::Module& module, World world, DdpOptions options)
    : state_(std::make_shared<State>(std::move(world), options)) {
  auto& state = *state_;
  LOCKSTEP_ENFORCE(
      options.bucket_cap_mb().value_or(0) >= 0 && options.first_bucket_cap_mb() >= 0,
      ConfigError, "bucket caps must not be negative (bucket_cap_mb=",
      options.bucket_cap_mb().value_or(0), ", first_bucket_cap_mb=",
      options.first_bucket_cap_mb(), ").");
  if (options.mixed_precision()) {
    check_mixed_precision(*options.mixed_precision());
  }
  LOCKSTEP_ENFORCE(!options.shard_gradients() || !options.mixed_precision(), ConfigError,
                   "DdpOptions::shard_gradients does not take a mixed-precision policy yet: "
                   "the sharded averages are the masters' gradients. Choose one of the two.");
  DebugLevel level = options.debug().value_or(state.world.debug());
  state.info = level != DebugLevel::Off;
  if (level == DebugLevel::Detail) {
    state.world.set_debug(DebugLevel::Detail);
  }
  if (!options.bucket_cap_mb()) {
    state.link_bytes_per_second = measure_link(state.world);
    state.automatic_cap = state.link_bytes_per_second > 0;
    state.options.bucket_cap_mb(kDefaultBucketCapMb);
  }

  std::vector<NamedTensor> all_params;
  std::vector<NamedTensor> all_buffers;
  named_state(module, all_params, all_buffers);
  // Buckets, and the transport that carries them, belong to one device.
  for (const auto* group : {&all_params, &all_buffers}) {
    for (const auto& entry : *group) {
      const auto& first = all_params.empty() ? entry : all_params.front();
      LOCKSTEP_ENFORCE(
          entry.tensor.device() == first.tensor.device(), UsageError, "the model's tensors "
          "live on more than one device: '", first.name, "' on ", first.tensor.device(),
          " and '", entry.name, "' on ", entry.tensor.device(), ". DistributedDataParallel "
          "wraps a model on one device, one process per GPU: move it there with "
          "module->to(device) before wrapping it.");
    }
  }
  // Before any collective, so that every rank raises the same error alone.
  if (!all_params.empty() && all_params.front().tensor.is_cpu()) {
    state.cpu_work = cpu_work_of(module);
  }
  if (options.mixed_precision()) {
    require_cpu_work_in(state.cpu_work, options.mixed_precision()->param_dtype(),
                        "the mixed-precision policy (DdpOptions::mixed_precision)");
  }
  std::vector<at::Tensor> module_state;
  for (const auto& entry : all_params) {
    module_state.push_back(entry.tensor);
    if (entry.tensor.requires_grad()) {
      state.names.push_back(entry.name);
      state.params.push_back(entry.tensor);
    } else {
      state.frozen.push_back(entry);
    }
  }
  for (const auto& entry : all_buffers) {
    module_state.push_back(entry.tensor);
    state.buffers.push_back(entry.tensor);
  }
  LOCKSTEP_ENFORCE(
      !state.params.empty(), UsageError, "DistributedDataParallel is not needed for a module "
      "without any parameter that requires a gradient: there is nothing to average. Set "
      "requires_grad on the parameters to train, or leave the module unwrapped.");

  check_same_model(state.world, all_params, all_buffers);
  state.all_params = all_params;
  state.named_buffers = all_buffers;
  broadcast_from(state.world, 0, module_state, "rank 0's parameters and buffers at construction");
  for (const auto& buffer : state.buffers) {
    state.buffer_versions.push_back(buffer._version());
  }
  state.find_buffers_in_step(module);
  if (options.mixed_precision()) {
    state.set_up_mixed_precision(*options.mixed_precision(), module);
  }

  state.used_since_sync.assign(state.params.size(), 0);
  state.active_ranks = state.world.size();
  state.find_sparse_parameters(module);
  for (size_t index = 0; index < state.params.size() && options.shard_gradients(); ++index) {
    LOCKSTEP_ENFORCE(!state.sparse[index], ConfigError, "DdpOptions::shard_gradients cannot "
                     "shard the sparse gradient of '", state.names[index], "': build the "
                     "embedding without sparse(true), or do without shard_gradients.");
  }
  // Sharded, the buckets keep the construction's layout: the optimizer's
  // pieces, and their state, are laid over it.
  state.layout.rebuilt = options.shard_gradients();
  state.layout_buckets(state.dense_only(state.reverse_registration_order()));
  state.log_layout("at construction, in reverse registration order");
  state.install_hooks(0);
}

Reducer::~Reducer() {
  for (const auto& held : state_->bound_norms) {
    if (auto module = held.lock()) {
      dynamic_cast<SyncBatchNormImpl&>(*module).world.reset();
    }
  }
}

std::vector<size_t> Reducer::State::reverse_registration_order() const {
  std::vector<size_t> order(params.size());
  for (size_t i = 0; i < order.size(); ++i) {
    order[i] = order.size() - 1 - i;
  }
  return order;
}

std::vector<size_t> Reducer::State::dense_only(const std::vector<size_t>& order) const {
  std::vector<size_t> dense;
  for (size_t index : order) {
    if (!sparse[index]) {
      dense.push_back(index);
    }
  }
  return dense;
}

void Reducer::State::install_hooks(size_t first) {
  for (size_t index = first; index < params.size(); ++index) {
    accumulators.push_back(hook_accumulator(index));
  }
}

std::shared_ptr<torch::autograd::Node> Reducer::State::hook_accumulator(size_t index) {
  std::weak_ptr<State> weak = shared_from_this();
  auto accumulator = torch::autograd::impl::grad_accumulator(params[index]);
  accumulator->add_post_hook(
      std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [weak, index](
              const torch::autograd::variable_list& outputs,
              const torch::autograd::variable_list& /*inputs*/) {
            if (auto state = weak.lock()) {
              state->on_gradient(index);
            }
            return outputs;
          }));
  return accumulator;
}

void Reducer::State::rehook_replaced_accumulators() {
  // Loading a module (torch::load, which calls set_ on each parameter)
  // gives a parameter a new gradient accumulator, without this hook: its
  // gradients would never be averaged again, silently.
  for (size_t index = 0; index < accumulators.size(); ++index) {
    if (torch::autograd::impl::try_get_grad_accumulator(params[index]) != accumulators[index]) {
      accumulators[index] = hook_accumulator(index);
    }
  }
}

void Reducer::State::layout_buckets(const std::vector<size_t>& order) {
  auto plan = plan_buckets(
      params, order, options.first_bucket_cap_mb(), *options.bucket_cap_mb());
  std::vector<Bucket> fresh;
  std::vector<size_t> fresh_bucket_of(params.size(), 0);
  std::vector<size_t> fresh_slot_of(params.size(), 0);
  // A sharded bucket comes and goes every iteration: plain memory, not the
  // transport's (World::allocate is collective and kept for good).
  bool sharded = options.shard_gradients();
  Bucket::Allocate allocate = [this, sharded](int64_t numel, const at::TensorOptions& options) {
    if (sharded) {
      return take_spare_bucket(numel, options);
    }
    return options.device().is_cpu() ? world.allocate(numel, options.dtype().toScalarType())
                                      : at::zeros({numel}, options);
  };
  for (size_t b = 0; b < plan.size(); ++b) {
    fresh.emplace_back(plan[b], params, /*with_extras=*/b + 1 == plan.size(), allocate,
                       sharded ? world.size() : 0);
    for (size_t k = 0; k < plan[b].size(); ++k) {
      fresh_bucket_of[plan[b][k]] = b;
      fresh_slot_of[plan[b][k]] = k;
    }
  }
  // Gradients kept as views into the old buckets move to the new ones.
  at::NoGradGuard no_grad;
  for (size_t index = 0; index < layout.bucket_of.size() && !layout.buckets.empty(); ++index) {
    auto& grad = params[index].mutable_grad();
    const auto& bucket = layout.buckets[layout.bucket_of[index]];
    if (!sparse[index] && bucket.holds(layout.slot_of[index], grad)) {
      auto slot = fresh[fresh_bucket_of[index]].slot(fresh_slot_of[index]);
      slot.copy_(grad);
      grad = slot;
    }
  }
  layout.buckets = std::move(fresh);
  layout.bucket_of = std::move(fresh_bucket_of);
  layout.slot_of = std::move(fresh_slot_of);

  for (size_t b = 0; b < layout.buckets.size() && timeline::enabled(); ++b) {
    timeline::declare_track(str("bucket ", b));
  }
  stats.bucket_bytes.clear();
  stats.bucket_parameters.clear();
  for (const auto& bucket : layout.buckets) {
    stats.bucket_bytes.push_back(bucket.bytes());
    std::vector<std::string> members;
    for (size_t index : bucket.members()) {
      members.push_back(names[index]);
    }
    stats.bucket_parameters.push_back(std::move(members));
  }
}

void Reducer::State::log(const std::string& message) const {
  if (info) {
    std::cerr << "lockstep INFO rank " << world.rank() << ": " << message << std::endl;
  }
}

void Reducer::State::log_layout(const std::string& when) const {
  if (!info) {
    return;
  }
  std::ostringstream out;
  out << "bucket layout " << when << ": " << layout.buckets.size() << " bucket(s)";
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    out << "\n  bucket " << b << " (" << mib(layout.buckets[b].bytes()) << "):";
    for (size_t index : layout.buckets[b].members()) {
      out << " " << names[index];
    }
  }
  log(out.str());
}

std::string Reducer::State::describe_bucket(size_t b) const {
  std::ostringstream out;
  out << "bucket " << b << " of iteration " << iteration << " (";
  const auto& members = layout.buckets[b].members();
  for (size_t k = 0; k < members.size() && k < 3; ++k) {
    out << (k == 0 ? "" : ", ") << names[members[k]];
  }
  if (members.size() > 3) {
    out << " and " << members.size() - 3 << " more";
  }
  out << "; " << mib(layout.buckets[b].bytes()) << ")";
  return out.str();
}

void Reducer::before_forward() {
  auto& state = *state_;
  std::lock_guard<std::mutex> lock(state.mutex);
  if (!state.cpu_work.empty() && autocast_enabled(c10::DeviceType::CPU)) {
    require_cpu_work_in(state.cpu_work, autocast_dtype(c10::DeviceType::CPU),
                        "autocast (lockstep::amp::Autocast)");
  }
  state.stats.last = IterationStats{};
  state.forward_start = Clock::now();
  state.rehook_replaced_accumulators();
  state.sync_at_forward = state.sync_enabled;
  LOCKSTEP_ENFORCE(!state.options.shard_gradients() || state.gradient_shards, UsageError,
                   "DdpOptions::shard_gradients keeps each rank's averages for its "
                   "ZeroRedundancyOptimizer, and none is registered: call "
                   "ddp.shard_gradients_with(optimizer) (or ddp.step_in_backward(optimizer)) "
                   "before the first forward, on every rank.");
  if (state.in_backward_step) {
    state.check_no_step_outside();
  }
  if (state.joining) {
    state.agree_on_join(/*training_here=*/true,
                        at::GradMode::is_enabled() && state.sync_at_forward);
  }
  state.tolerate([&] { state.sync_buffers_as_configured(); });
  ++state.forwards;
  // Once a rank ran out of batches, its replica lags until the join ends.
  if (state.options.verify_every() > 0 && state.active_ranks == state.world.size() &&
      state.forwards % state.options.verify_every() == 0) {
    state.tolerate([&] { state.check_replicas(ReplicaCheck::All); });
  }
  // Last, once nothing here can raise: the checks above read the masters.
  if (state.mixed_precision) {
    state.compute_in_copies();
    state.rehook_replaced_accumulators();
  }
}

void Reducer::State::require_before_first_forward(const char* call, const char* why) const {
  LOCKSTEP_ENFORCE(forwards == 0 && iteration == 0, UsageError, call, " must come before the "
                   "first forward, on every rank (this one comes after ", forwards,
                   " forward(s) and ", iteration, " synchronised backward(s)): ", why, ".");
}

void Reducer::register_comm_hook(CommHook hook) {
  auto& state = *state_;
  std::lock_guard<std::mutex> lock(state.mutex);
  LOCKSTEP_ENFORCE(hook != nullptr, UsageError, "register_comm_hook needs a hook; "
                   "lockstep::hooks::allreduce() is what the wrapper does without one.");
  state.require_before_first_forward(
      "register_comm_hook", "the ranks must agree on how every bucket travels from the first "
      "iteration on");
  LOCKSTEP_ENFORCE(!state.options.shard_gradients(), UsageError, "DdpOptions::"
                   "shard_gradients does not take a communication hook yet: each bucket is "
                   "reduce-scattered by the wrapper itself.");
  LOCKSTEP_ENFORCE(!state.comm_hook || state.comm_hook_is_policys, UsageError,
                   "a communication hook is already registered; one per "
                   "DistributedDataParallel, as in PyTorch. Compose hooks in one instead.");
  LOCKSTEP_ENFORCE(
      !state.joining || state.joining->options.divide_by_initial_world_size(), UsageError,
      "a communication hook divides by the world size, and the join guard in place divides "
      "by the ranks still training (divide_by_initial_world_size(false)). Keep the join's "
      "default, or do without the hook.");
  // Under a mixed-precision policy the hook receives the bucket in
  // reduce_dtype, as PyTorch's does.
  const auto& mp = state.mixed_precision;
  state.comm_hook = mp && mp->reduce ? wrap_in(*mp->reduce, std::move(hook)) : std::move(hook);
  state.comm_hook_is_policys = false;
}

void Reducer::forward_failed() {
  auto& state = *state_;
  std::lock_guard<std::mutex> lock(state.mutex);
  state.restore_masters_of_this_forward();
}

std::optional<at::ScalarType> Reducer::input_dtype() const {
  const auto& mp = state_->mixed_precision;
  return mp ? std::optional<at::ScalarType>(mp->compute) : std::nullopt;
}

void Reducer::after_forward(const std::vector<at::Tensor>& outputs) {
  auto& state = *state_;
  std::lock_guard<std::mutex> lock(state.mutex);
  state.forward_end = Clock::now();
  if (timeline::enabled()) {
    timeline::record(timeline::kLoopTrack, "forward", state.forward_start,
                     state.forward_end, {{"forward", str(state.forwards)}});
  }
  double forward_ms = ms_between(state.forward_start, state.forward_end);
  state.stats.last.forward_ms = forward_ms;
  state.stats.total.forward_ms += forward_ms;
  if (!at::GradMode::is_enabled()) {
    // No backward follows to end this forward.
    state.restore_masters_of_this_forward();
    return;
  }
  state.hook_outputs(outputs);
  bool walkable = !outputs.empty() &&
      std::all_of(outputs.begin(), outputs.end(),
                  [](const at::Tensor& t) { return t.defined(); });
  if (!state.options.find_unused_parameters() || !state.sync_at_forward || !walkable) {
    return;
  }
  auto reachable = reachable_nodes(outputs);
  std::vector<size_t> unused;
  for (size_t index = 0; index < state.params.size(); ++index) {
    if (reachable.count(state.accumulators[index].get()) == 0) {
      unused.push_back(index);
    }
  }
  state.unused_at_forward = std::move(unused);
  state.unused_forward = state.forwards;
}

namespace {

// On the autograd node of a forward's output: a backward that reaches it
// is that forward's backward, whichever graph task runs it and however
// often (a second backward with retain_graph is another of its backwards,
// not a bypass).
class ForwardReached : public torch::autograd::FunctionPreHook {
 public:
  ForwardReached(std::weak_ptr<Reducer::State> state, int64_t forward, bool sync)
      : state_(std::move(state)), forward_(forward), sync_(sync) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& grads) override {
    if (auto state = state_.lock()) {
      state->on_forward_reached(forward_, sync_);
    }
    return grads;
  }

 private:
  std::weak_ptr<Reducer::State> state_;
  int64_t forward_;
  bool sync_;
};

} // namespace

void Reducer::State::hook_outputs(const std::vector<at::Tensor>& outputs) {
  std::unordered_set<const torch::autograd::Node*> hooked;
  for (const auto& output : outputs) {
    if (output.defined() && output.requires_grad() && output.grad_fn() &&
        hooked.insert(output.grad_fn().get()).second) {
      output.grad_fn()->add_pre_hook(
          std::make_unique<ForwardReached>(weak_from_this(), forwards, sync_at_forward));
    }
  }
  // Outputs of another type carry no hook: the next backward is taken to
  // be this forward's.
  unhooked_forward = hooked.empty() ? forwards : 0;
  unhooked_sync = sync_at_forward;
}

void Reducer::set_sync_enabled(bool enabled) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->sync_enabled = enabled;
}

bool Reducer::sync_enabled() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->sync_enabled;
}

DdpStats Reducer::stats() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->stats;
}

} // namespace lockstep::detail
