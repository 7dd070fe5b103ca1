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
#include <lockstep/replica_groups.h>

#include <algorithm>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <lockstep/error.h>
#include <lockstep/sync_batch_norm.h>

#include "compat/autocast.h"
#include "fsdp/constructed_shard.h"
#include "fsdp/sharded_model_state.h"
#include "fsdp/unit_registry.h"
#include "world/epoch_world.h"
#include "optim/gradient_placement.h"
#include "reducer/graph_walk.h"

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
      if (state->in_forward) {
        ++state->calls[unit_];
        state->call_first_node[unit_] = at::sequence_number::peek();
        state->call_marked_views[unit_].clear();
        // Without autograd inside a forward with it: a checkpoint that
        // recomputes the call inside backward, where its gradients come,
        // though no graph of this forward reaches its parameters. They are
        // waited for (or reduced at the end, where no recomputation came).
        if (!torch::autograd::GradMode::is_enabled() && state->forward_with_grad) {
          state->read_late[unit_] = 1;
          for (size_t k = 0; k < state->accumulators[unit_].size(); ++k) {
            if (state->accumulators[unit_][k]) {
              state->reached[unit_][k] = 1;
            }
          }
        }
      } else {
        state->read_late[unit_] = 1; // a recomputation inside backward
      }
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
  at::Tensor mark_input(const at::Tensor& input) override {
    auto state = state_.lock();
    // Not in a recomputation inside backward (activation checkpointing):
    // its inputs' gradients belong to the backward in progress.
    if (!state || !state->in_forward || !input.defined() || !input.requires_grad() ||
        !torch::autograd::GradMode::is_enabled()) {
      return input;
    }
    // A view of its own, so that the hook sees this unit's use of the input
    // alone: its gradient is complete once the unit's backward is over.
    auto marked = input.view_as(input);
    ++state->inputs_marked[unit_];
    state->call_marked_views[unit_].push_back(marked.grad_fn());
    std::weak_ptr<ShardedModel::State> weak = state_;
    size_t unit = unit_;
    marked.register_hook([weak, unit](const at::Tensor& /*grad*/) {
      if (auto held = weak.lock()) {
        held->on_input_gradient(unit);
      }
    });
    return marked;
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
    if (state->in_forward && state->holds_frozen[unit_] != 0 && state->read_late[unit_] == 0) {
      std::unordered_set<const torch::autograd::Node*> stops;
      for (const auto& view : state->call_marked_views[unit_]) {
        stops.insert(view.get());
      }
      for (const auto& accumulator : state->accumulators[unit_]) {
        stops.insert(accumulator.get());
      }
      if (reaches_beyond_call(outputs, state->call_first_node[unit_], stops)) {
        state->read_late[unit_] = 1;
      }
    }
    state->call_marked_views[unit_].clear();
    if (state->options.reshard_after_forward() && state->keep_gathered[unit_] == 0) {
      state->free(unit_);
    }
  }

 private:
  std::weak_ptr<ShardedModel::State> state_;
  size_t unit_;
};

} // namespace

std::shared_ptr<UnitHooks> make_unit_hooks(std::weak_ptr<ShardedModel::State> state,
                                           size_t unit) {
  return std::make_shared<UnitHooksOf>(std::move(state), unit);
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

void ShardedModel::State::rehook(size_t unit) {
  const auto& members = units[unit]->members();
  for (size_t k = 0; k < members.size(); ++k) {
    auto& held = accumulators[unit][k];
    if (held && torch::autograd::impl::try_get_grad_accumulator(members[k].param) != held) {
      held = hook_accumulator(members[k].param, unit, k);
    }
  }
}

void ShardedModel::State::reset_step(bool keep_gradients) {
  arrived.clear();
  pending.clear();
  reached.clear();
  holds_frozen.clear();
  for (const auto& unit : units) {
    if (!keep_gradients) {
      unit->drop_gradients(pool);
    }
    arrived.emplace_back(unit->members().size(), 0);
    reached.emplace_back(unit->members().size(), 0);
    size_t trainable = 0;
    for (const auto& member : unit->members()) {
      trainable += member.param.requires_grad() ? 1 : 0;
    }
    pending.push_back(trainable);
    holds_frozen.push_back(trainable < unit->members().size() ? 1 : 0);
  }
  if (used_since_sync.size() != units.size()) {
    for (const auto& unit : units) {
      used_since_sync.emplace_back(unit->members().size(), 0);
    }
  }
  keep_gathered.assign(units.size(), 0);
  calls.assign(units.size(), 0);
  read_late.assign(units.size(), 0);
  call_first_node.assign(units.size(), 0);
  call_marked_views.assign(units.size(), {});
  inputs_marked.assign(units.size(), 0);
  inputs_arrived.assign(units.size(), 0);
  reduced = 0;
  reduced_unit.assign(units.size(), 0);
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

void ShardedModel::State::on_input_gradient(size_t unit) {
  open_backward();
  ++inputs_arrived[unit];
  free_if_done(unit);
}

void ShardedModel::State::note_reached(
    const std::unordered_set<const torch::autograd::Node*>& nodes) {
  for (size_t u = 0; u < units.size(); ++u) {
    for (size_t k = 0; k < accumulators[u].size(); ++k) {
      const auto& accumulator = accumulators[u][k];
      if (accumulator && nodes.count(accumulator.get()) != 0) {
        reached[u][k] = 1;
      }
    }
  }
}

void ShardedModel::State::on_gradient(size_t unit, size_t member) {
  open_backward();
  auto& seen = arrived[unit][member];
  // Autograd accumulates a parameter's gradient before it runs what the
  // same node sent to the unit's input, so that none comes after the
  // input's. One that comes after the unit's reduction anyway (a block
  // recomputed twice in one backward, or a parameter that a checkpoint
  // reads around its unit's holder, which no forward's graph reached)
  // would be lost: that is named.
  LOCKSTEP_ENFORCE(reduced_unit[unit] == 0, UsageError, "FullyShardedDataParallel: the "
                   "gradient of ", units[unit]->members()[member].name, " came after ",
                   FlatUnit::describe(unit_names[unit]), " was reduced, its backward over. A "
                   "unit recomputed more than once in one backward (checkpointed twice, or "
                   "checkpointed and also called with autograd), or a parameter that a "
                   "checkpoint reads outside its unit's holder, brings its gradient too late: "
                   "checkpoint each unit once, through its holder.");
  used_since_sync[unit][member] = 1;
  if (seen == kPending) {
    seen = kArrived;
    if (--pending[unit] == 0) {
      reduce_in_order(/*to_the_end=*/false);
    }
  } else {
    // A second gradient (it accumulates where the first did), or one not
    // waited for: reduced with the rest.
    seen = kArrived;
  }
}

void ShardedModel::State::open_backward() {
  if (backward_open) {
    return;
  }
  backward_open = true;
  sync_this_backward = sync_enabled;
  // What no forward's outputs reach gets no gradient: not waited for, so
  // that a unit with an unused parameter reduces (and frees) as soon as
  // its used ones are in.
  for (size_t u = 0; u < units.size(); ++u) {
    for (size_t k = 0; k < accumulators[u].size(); ++k) {
      // (A parameter frozen since the wrapper was made keeps its
      // accumulator, but was never counted as pending.)
      if (accumulators[u][k] && units[u]->members()[k].param.requires_grad() &&
          reached[u][k] == 0 && arrived[u][k] == kPending) {
        arrived[u][k] = kPresumed;
        --pending[u];
      }
    }
  }
  std::weak_ptr<State> weak = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto state = weak.lock()) {
      state->finish_backward();
    }
  });
}

void ShardedModel::State::reduce_in_order(bool to_the_end) {
  while (reduced < reduce_order.size()) {
    size_t unit = reduce_order[reduced];
    // The root holds what the wrapper's forward used around the units: it
    // stays gathered to the end of backward. A unit is reduced once every
    // gradient that this backward brings it is in.
    if (!to_the_end && (unit_names[unit].empty() || pending[unit] != 0)) {
      return;
    }
    if (sync_this_backward) {
      timed("reduce-scatter", unit,
            [&] {
              units[unit]->reduce_gradients(shard_world, pool, options.reduce_dtype(),
                                            replicas ? &*replicas : nullptr);
            });
    }
    ++reduced;
    reduced_unit[unit] = 1;
    // A frozen parameter may still be read by a later part of this
    // backward: such a unit is freed once its inputs' gradients are in.
    if (!to_the_end) {
      free_if_done(unit);
    }
  }
}

void ShardedModel::State::finish_backward() {
  reduce_in_order(/*to_the_end=*/true);
  if (sync_this_backward) {
    settle_unused();
  }
  free_all();
  accumulating = !sync_this_backward;
  reset_step(/*keep_gradients=*/accumulating);
}

ShardedModel::ShardedModel(torch::nn::Module& module, World world, FsdpOptions options)
    : state_(std::make_shared<State>(std::move(world), options)) {
  LOCKSTEP_ENFORCE(!options.param_dtype() || at::isFloatingType(*options.param_dtype()),
                   ConfigError, "FsdpOptions::param_dtype takes a floating dtype (Half, "
                   "BFloat16, Float, Double), not ", *options.param_dtype(), ".");
  // Before any collective, so that every rank raises the same error alone.
  if (!module.parameters().empty() && module.parameters().front().is_cpu()) {
    state_->cpu_work = cpu_work_of(module);
  }
  if (options.param_dtype()) {
    require_cpu_work_in(state_->cpu_work, *options.param_dtype(), "FsdpOptions::param_dtype");
  }
  if (options.shard_group_size()) {
    LOCKSTEP_ENFORCE(!WorldAccess::standby(state_->world), ConfigError,
                     "FsdpOptions::shard_group_size on a rank that lockstep-run restarted "
                     "alone: under fault tolerance, shard inside the replica groups of "
                     "FaultTolerance(groups, ...) (FSDP over groups.replica) instead.");
    // A fixed size is checked here alike on every rank; 0 (a host's ranks)
    // is agreed by replica_groups, since hosts may hold different counts.
    if (*options.shard_group_size() != 0) {
      shard_group_size(state_->world, options);
    }
    auto groups = replica_groups(state_->world, *options.shard_group_size());
    if (groups.replica.size() < state_->world.size()) {
      state_->shard_world = groups.replica;
      state_->replicas = groups.across;
    }
  }
  state_->shard(module);
  // An optimizer over the pieces steps shards: a GradScaler's found-inf must
  // agree across the ranks.
  register_pieces(this, parameters(), state_->world);
}

World ShardedModel::shard_world() const {
  return state_->shard_world;
}

ShardedModel::~ShardedModel() {
  unregister_pieces(this);
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
  if (!state_->cpu_work.empty() && autocast_enabled(c10::DeviceType::CPU)) {
    require_cpu_work_in(state_->cpu_work, autocast_dtype(c10::DeviceType::CPU),
                        "autocast (lockstep::amp::Autocast)");
  }
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
    if (!state_->order_agreed) {
      state_->agree_on_order();
    }
  }
  state_->in_forward = true;
  state_->forward_with_grad = torch::autograd::GradMode::is_enabled();
}

void ShardedModel::forward_failed(const std::exception_ptr& error) {
  std::string not_gathered;
  for (size_t unit : state_->units_not_run()) {
    not_gathered += (not_gathered.empty() ? "" : ", ") + state_->unit_names[unit];
  }
  state_->in_forward = false;
  state_->free_all();
  // What backward passes under FsdpNoSyncGuard accumulated stays for the
  // reduction to come (a program may skip the batch that raised).
  state_->reset_step(/*keep_gradients=*/state_->accumulating);
  if (not_gathered.empty()) {
    return;
  }
  try {
    std::rethrow_exception(error);
  } catch (const Error&) {
    return; // lockstep's own says what happened
  } catch (const c10::Error& raised) {
    // ATen's errors only (a shape or size that the empty parameters
    // broke); not running out of memory, which a program may catch to
    // retry with a smaller batch.
    std::string what = raised.what();
    if (what.find("out of memory") != std::string::npos ||
        what.find("can't allocate memory") != std::string::npos) {
      return;
    }
    LOCKSTEP_ENFORCE(false, UsageError, "FullyShardedDataParallel: the forward raised while "
                     "these units had not been gathered in it: ", not_gathered, ". If the model "
                     "called one of them around its lockstep::Sharded holder (the block's "
                     "->forward(x), a Sequential or an AnyModule that holds it), it computed "
                     "on freed, empty parameters, which raises: call the holder (unit(x)). "
                     "Otherwise the error is the model's own: ", raised.what());
  } catch (...) {
    return;
  }
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
  } else {
    // The backward opens at the wrapper's outputs, where it begins: not at
    // a first gradient inside a checkpoint's nested backward, whose end
    // would then end this one (the callback attaches to the innermost).
    std::weak_ptr<State> weak = state_;
    for (const auto& output : outputs) {
      if (output.defined() && output.requires_grad()) {
        output.register_hook([weak](const at::Tensor& /*grad*/) {
          if (auto state = weak.lock()) {
            state->open_backward();
          }
        });
      }
    }
  }
  // One walk of the graph: which parameters this forward used, and whether
  // a unit took part without its holder.
  auto nodes = reachable_nodes(outputs);
  state_->note_reached(nodes);
  state_->refuse_bypassed_units(nodes);
}

std::optional<at::ScalarType> ShardedModel::input_dtype() const {
  return state_->options.param_dtype();
}

void ShardedModel::set_sync_enabled(bool enabled) {
  state_->sync_enabled = enabled;
}

bool ShardedModel::sync_enabled() const {
  return state_->sync_enabled;
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
    state_->gather_in_full_precision(u);
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
