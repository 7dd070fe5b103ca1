// FullyShardedDataParallel's life of one step: the root unit is gathered at
// the wrapper's forward, each unit by its holder around its own forward and
// again (from a hook on its outputs' gradients) before its backward. Once
// every trainable parameter of a unit has its gradient, the unit's
// gradients are averaged into the shards and its parameters freed. Units
// reduce in one order on every rank, the last of the module tree first
// (the order of a backward), whatever order their gradients complete in:
// a unit that completes early waits for those after it, and the end of
// backward reduces what is left, with zeros for parameters that took no
// part. So every rank runs the same collectives in the same order.

#include <lockstep/fsdp.h>

#include <algorithm>
#include <optional>
#include <unordered_map>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <lockstep/error.h>
#include <lockstep/sync_batch_norm.h>

#include "fsdp/sharded_model_state.h"
#include "fsdp/unit_registry.h"

namespace lockstep::detail {

namespace {

class UnitHooksOf : public UnitHooks {
 public:
  UnitHooksOf(std::weak_ptr<ShardedModel::State> state, size_t unit)
      : state_(std::move(state)), unit_(unit) {}

  void before_forward() override {
    if (auto state = state_.lock()) {
      // Inside a backward, a unit may run again (activation checkpointing).
      LOCKSTEP_ENFORCE(state->in_forward || state->backward_open, UsageError,
                       "FullyShardedDataParallel: unit ",
                       state->unit_names[unit_],
                       " ran outside the wrapper's forward, where the parameters around it "
                       "are not gathered. Call the wrapper (fsdp(input)), not the module's "
                       "forward.");
      state->gather(unit_);
      if (std::find(state->forward_order.begin(), state->forward_order.end(), unit_) ==
          state->forward_order.end()) {
        state->forward_order.push_back(unit_);
      }
      state->prefetch_from(unit_, +1);
    }
  }
  void forward_failed() override {
    if (auto state = state_.lock()) {
      state->free(unit_);
    }
  }
  void after_forward(const std::vector<at::Tensor>& outputs) override {
    auto state = state_.lock();
    if (!state) {
      return;
    }
    // An output that is a view of the unit's own parameters would be read
    // after they are freed; one that no hook reaches would be needed in a
    // backward that nothing gathers for. Either keeps the unit gathered.
    bool keep = false;
    for (const auto& output : outputs) {
      keep = keep || state->units[unit_]->holds(output);
    }
    if (!torch::autograd::GradMode::is_enabled()) {
      state->keep_gathered[unit_] = state->keep_gathered[unit_] || keep;
      if (state->keep_gathered[unit_] == 0) {
        state->free(unit_); // no backward follows
      }
      return;
    }
    keep = !state->hook_outputs(unit_, outputs) || keep;
    state->keep_gathered[unit_] = state->keep_gathered[unit_] || keep;
    if (state->options.reshard_after_forward() && state->keep_gathered[unit_] == 0) {
      state->free(unit_);
    }
  }

 private:
  std::weak_ptr<ShardedModel::State> state_;
  size_t unit_;
};

bool within(const std::string& module_name, const std::string& unit_name) {
  return unit_name.empty() || module_name == unit_name ||
      module_name.rfind(unit_name + ".", 0) == 0;
}

std::string joined(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

} // namespace

void ShardedModel::State::shard(torch::nn::Module& module) {
  auto wire = options.reduce_dtype();
  LOCKSTEP_ENFORCE(!wire || at::isFloatingType(*wire), ConfigError,
                   "FsdpOptions::reduce_dtype takes a floating dtype (Half, BFloat16, Float, "
                   "Double), not ", *wire, ".");
  auto modules = module.named_modules("", /*include_self=*/true);
  std::vector<std::string> names{""};
  std::vector<std::shared_ptr<torch::nn::Module>> declared{nullptr};
  for (const auto& item : modules) {
    if (!item.key().empty() && is_declared_unit(*item.value())) {
      names.push_back(item.key());
      declared.push_back(item.value());
    }
  }
  // Each parameter to the innermost unit that holds it; a parameter that
  // two units hold (tied weights) would be gathered by the one and
  // reduced by the other.
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> members(names.size());
  std::unordered_map<const c10::TensorImpl*, std::pair<size_t, std::string>> owner_of;
  for (const auto& item : modules) {
    size_t owner = 0;
    for (size_t u = 1; u < names.size(); ++u) {
      if (within(item.key(), names[u]) && names[u].size() >= names[owner].size()) {
        owner = u;
      }
    }
    for (const auto& param : item.value()->named_parameters(/*recurse=*/false)) {
      auto name = joined(item.key(), param.key());
      auto [found, fresh] = owner_of.emplace(param.value().unsafeGetTensorImpl(),
                                             std::make_pair(owner, name));
      if (!fresh) {
        LOCKSTEP_ENFORCE(found->second.first == owner, ConfigError,
                         "FullyShardedDataParallel: ", found->second.second, " and ", name,
                         " are one parameter (tied weights) in two units, ",
                         names[found->second.first].empty() ? "the root"
                                                            : names[found->second.first],
                         " and ", names[owner].empty() ? "the root" : names[owner],
                         ". Tied weights must live in one unit: declare a unit that "
                         "holds both modules, or leave both to the root.");
        continue;
      }
      members[owner].emplace_back(name, param.value());
    }
  }
  // Every unit is checked and claimed before any is sharded: a refusal
  // leaves the module as it was.
  std::optional<std::pair<std::string, at::Device>> device;
  for (size_t u = 0; u < names.size(); ++u) {
    if (members[u].empty()) {
      continue;
    }
    FlatUnit::check(names[u], members[u]);
    const auto& [name, first] = members[u].front();
    if (!device) {
      device.emplace(name, first.device());
    }
    // CPU and CUDA units would run their backward on two threads at once.
    LOCKSTEP_ENFORCE(first.device() == device->second, ConfigError,
                     "FullyShardedDataParallel: the units live on one device, and ",
                     device->first, " is on ", device->second, " while ", name, " is on ",
                     first.device(), ".");
  }
  size_t index = members[0].empty() ? 0 : 1;
  for (size_t u = 1; u < names.size(); ++u) {
    if (members[u].empty()) {
      continue; // nothing to gather: the block runs as it is
    }
    auto unit_hooks = std::make_shared<UnitHooksOf>(weak_from_this(), index++);
    LOCKSTEP_ENFORCE(attach_unit_hooks(*declared[u], unit_hooks), ConfigError,
                     "FullyShardedDataParallel: unit ", names[u],
                     " is already sharded by another FullyShardedDataParallel that "
                     "is still alive.");
    hooks.push_back(unit_hooks);
    unit_modules.push_back(declared[u]);
  }
  for (size_t u = 0; u < names.size(); ++u) {
    if (members[u].empty()) {
      continue;
    }
    // Before the parameters are freed: autograd checks each gradient
    // against the shape that its accumulator saw when it was made.
    for (size_t k = 0; k < members[u].size(); ++k) {
      if (members[u][k].second.requires_grad()) {
        accumulators.push_back(hook_accumulator(members[u][k].second, units.size(), k));
      }
    }
    unit_names.push_back(names[u]);
    units.push_back(std::make_unique<FlatUnit>(names[u], std::move(members[u]), world));
  }
  for (const auto& buffer : module.named_buffers()) {
    auto tensor = buffer.value();
    world.broadcast(tensor, 0, str(buffer.key(), " from rank 0"));
  }
  for (const auto& item : modules) {
    auto* norm = dynamic_cast<SyncBatchNormImpl*>(item.value().get());
    if (norm != nullptr && !norm->world) {
      norm->world = world;
      bound_norms.push_back(item.value());
    }
  }
  reset_step();
}

std::shared_ptr<torch::autograd::Node> ShardedModel::State::hook_accumulator(
    const at::Tensor& param, size_t unit, size_t member) {
  std::weak_ptr<State> weak = weak_from_this();
  auto accumulator = torch::autograd::impl::grad_accumulator(param);
  accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [weak, unit, member](const torch::autograd::variable_list& outputs,
                           const torch::autograd::variable_list& /*inputs*/) {
        if (auto state = weak.lock()) {
          state->on_gradient(unit, member);
        }
        return outputs;
      }));
  return accumulator;
}

void ShardedModel::State::reset_step() {
  arrived.clear();
  pending.clear();
  for (const auto& unit : units) {
    unit->drop_gradients(pool);
    arrived.emplace_back(unit->members().size(), 0);
    size_t trainable = 0;
    for (const auto& member : unit->members()) {
      trainable += member.param.requires_grad() ? 1 : 0;
    }
    pending.push_back(trainable);
  }
  keep_gathered.assign(units.size(), 0);
  unreduced = units.size();
  backward_open = false;
}

bool ShardedModel::State::hook_outputs(size_t unit, const std::vector<at::Tensor>& outputs) {
  bool reachable = true;
  std::weak_ptr<State> weak = weak_from_this();
  for (const auto& output : outputs) {
    if (!output.defined()) {
      reachable = false;
    } else if (output.requires_grad()) {
      output.register_hook([weak, unit](const at::Tensor& /*grad*/) {
        if (auto state = weak.lock()) {
          state->on_output_gradient(unit);
        }
      });
    }
  }
  return reachable;
}

void ShardedModel::State::on_output_gradient(size_t unit) {
  open_backward();
  gather(unit);
  units[unit]->attach_gradients(pool);
  prefetch_from(unit, -1);
}

void ShardedModel::State::on_gradient(size_t unit, size_t member) {
  open_backward();
  auto& seen = arrived[unit][member];
  if (seen != 0) {
    return; // a second backward through a retained graph: reduced at its end
  }
  seen = 1;
  if (--pending[unit] == 0) {
    reduce_in_order(/*to_the_end=*/false);
  }
}

void ShardedModel::State::open_backward() {
  if (backward_open) {
    return;
  }
  backward_open = true;
  std::weak_ptr<State> weak = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto state = weak.lock()) {
      state->finish_backward();
    }
  });
}

void ShardedModel::State::reduce_in_order(bool to_the_end) {
  while (unreduced > 0) {
    size_t unit = unreduced - 1;
    // The root holds what the wrapper's forward used around the units: it
    // stays gathered to the end of backward.
    if (!to_the_end && (unit_names[unit].empty() || pending[unit] > 0)) {
      return;
    }
    timed("reduce-scatter", unit,
          [&] { units[unit]->reduce_gradients(world, gradient_scratch, pool,
                                                    options.reduce_dtype()); });
    // A frozen parameter may still be needed by a later part of this
    // backward: such a unit is freed at its end.
    if (!to_the_end && units[unit]->all_trainable() && keep_gathered[unit] == 0) {
      free(unit);
    }
    --unreduced;
  }
}

void ShardedModel::State::finish_backward() {
  reduce_in_order(/*to_the_end=*/true);
  free_all();
  reset_step();
}

ShardedModel::ShardedModel(torch::nn::Module& module, World world, FsdpOptions options)
    : state_(std::make_shared<State>(std::move(world), options)) {
  state_->shard(module);
}

ShardedModel::~ShardedModel() {
  for (const auto& module : state_->unit_modules) {
    detach_unit_hooks(*module);
  }
  for (const auto& held : state_->bound_norms) {
    if (auto module = held.lock()) {
      dynamic_cast<SyncBatchNormImpl&>(*module).world.reset();
    }
  }
}

void ShardedModel::before_forward() {
  // A backward still open here never finished (it raised): its step is
  // over, and so is the callback it queued.
  if (state_->backward_open) {
    state_->reset_step();
  }
  // What an earlier forward left gathered (one whose backward has not
  // come, or one without autograd) holds the parameters from before any
  // step since: freed, or gathered afresh where a unit must stay gathered
  // for that forward's backward. A backward's hooks gather the rest again.
  for (size_t u = 0; u < state_->units.size(); ++u) {
    bool kept = state_->keep_gathered[u] != 0 && state_->units[u]->gathered();
    state_->free(u);
    if (kept) {
      state_->gather(u);
    }
  }
  if (!state_->units.empty() && state_->unit_names[0].empty()) {
    state_->gather(0);
  }
  // What prefetch follows: the order of the last forward that ran units.
  if (!state_->forward_order.empty()) {
    state_->last_forward_order = std::move(state_->forward_order);
    state_->forward_order.clear();
    state_->place_in_last.assign(state_->units.size(), std::nullopt);
    for (size_t i = 0; i < state_->last_forward_order.size(); ++i) {
      state_->place_in_last[state_->last_forward_order[i]] = i;
    }
  }
  state_->in_forward = true;
}

void ShardedModel::forward_failed() {
  state_->in_forward = false;
  state_->free_all();
  state_->reset_step();
}

void ShardedModel::after_forward(const std::vector<at::Tensor>& outputs) {
  state_->in_forward = false;
  if (!torch::autograd::GradMode::is_enabled()) {
    for (size_t u = 0; u < state_->units.size(); ++u) {
      if (state_->keep_gathered[u] == 0) {
        state_->free(u);
      }
    }
    return;
  }
  if (!state_->units.empty() && state_->unit_names[0].empty()) {
    state_->hook_outputs(0, outputs);
  }
}

std::vector<at::Tensor> ShardedModel::parameters() const {
  std::vector<at::Tensor> pieces;
  for (const auto& unit : state_->units) {
    for (const auto& member : unit->members()) {
      if (member.piece.defined()) {
        pieces.push_back(member.piece);
      }
    }
  }
  return pieces;
}

torch::OrderedDict<std::string, at::Tensor> ShardedModel::named_parameters() const {
  torch::OrderedDict<std::string, at::Tensor> pieces;
  for (const auto& unit : state_->units) {
    for (const auto& member : unit->members()) {
      if (member.piece.defined()) {
        pieces.insert(member.name, member.piece);
      }
    }
  }
  return pieces;
}

torch::OrderedDict<std::string, at::Tensor> ShardedModel::full_parameters() {
  torch::OrderedDict<std::string, at::Tensor> full;
  at::NoGradGuard no_grad;
  for (size_t u = 0; u < state_->units.size(); ++u) {
    auto& unit = *state_->units[u];
    bool was_gathered = unit.gathered();
    // Gathered afresh: what an earlier forward gathered may predate a step.
    state_->free(u);
    state_->gather(u);
    for (const auto& member : unit.members()) {
      full.insert(member.name, member.param.detach().clone());
    }
    if (!was_gathered) {
      state_->free(u);
    }
  }
  return full;
}

std::vector<std::string> ShardedModel::unit_names() const {
  return state_->unit_names;
}

} // namespace lockstep::detail
