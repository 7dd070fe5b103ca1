#pragma once

// FullyShardedDataParallel's state, shared by sharded_model.cpp (the life
// of a step) and sharded_state.cpp (the state as checkpoints see it).

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include <lockstep/fsdp.h>

#include "amp/sixteen_bit_support.h"
#include "fsdp/buffer_pool.h"
#include "fsdp/flat_unit.h"
#include "timeline/recorder.h"

namespace lockstep::detail {

struct ShardedModel::State : std::enable_shared_from_this<State> {
  State(World world_in, FsdpOptions options_in)
      : world(std::move(world_in)),
        shard_world(world),
        options(options_in),
        pool(options.prefetch() ? 3 : 2) {}

  // Every rank: the start's values, the buffers, the order of reductions,
  // the flags of unused parameters, a GradScaler's agreement.
  World world;
  // The ranks that share each unit's shards: the world, or under hybrid
  // sharding (FsdpOptions::shard_group_size) this rank's group, whose
  // gathers and reduce-scatters stay inside it; and then the same place in
  // every group, across which each shard's gradients are averaged.
  World shard_world;
  std::optional<World> replicas;
  FsdpOptions options;
  // What 16-bit work the model does on CPU (amp/sixteen_bit_support.h).
  std::vector<CpuWork> cpu_work;
  // Unit 0 is the root (what no declared unit holds); the others in the
  // order of the module tree. A unit without parameters has none here.
  std::vector<std::string> unit_names;
  std::vector<std::unique_ptr<FlatUnit>> units;
  std::vector<std::shared_ptr<torch::nn::Module>> unit_modules; // the declared ones sharded
  std::vector<std::shared_ptr<UnitHooks>> hooks;
  // Per unit and member (null for a frozen one). Held: a parameter only
  // keeps a weak reference to its accumulator. A gather in another dtype
  // (FsdpOptions::param_dtype) replaces a parameter's accumulator, and the
  // new one is hooked then.
  std::vector<std::vector<std::shared_ptr<torch::autograd::Node>>> accumulators;
  // A unit's parameters and gradients, and with prefetch the next unit's
  // parameters.
  BufferPool pool;

  // The step in progress.
  // Per unit and member: kPending, kArrived, or kPresumed (no forward's
  // graph reached it: not waited for).
  std::vector<std::vector<char>> arrived;
  static constexpr char kPending = 0, kArrived = 1, kPresumed = 2;
  std::vector<size_t> pending;            // per unit: gradients still to come
  std::vector<char> keep_gathered;        // outputs that no hook could reach
  // Per unit and member: the accumulator was reachable from the outputs of
  // a forward since the last backward. One that was not gets no gradient in
  // this backward: it is not waited for (DDP's find_unused_parameters).
  std::vector<std::vector<char>> reached;
  // Per unit: its calls in the wrapper's forwards since the last backward,
  // the inputs of those calls that require grad (each seen through a view
  // with a hook), and those whose gradient came. Once all have, nothing of
  // this backward reads the unit's parameters any more (FSDP2's
  // post-backward), unless `read_late`: a call's graph reaches beyond the
  // call other than through those views and the unit's own accumulators (a
  // tensor in a struct argument or captured from elsewhere, whose gradient
  // may come after the unit's), or a call ran without autograd inside a
  // forward with it, or again inside backward (activation checkpointing:
  // the recomputed graph's inputs are not seen). A unit with frozen
  // parameters may be freed then; one read late, at the end of backward.
  std::vector<size_t> calls;
  std::vector<size_t> inputs_marked;
  std::vector<size_t> inputs_arrived;
  std::vector<char> read_late;
  // The call in progress, per unit: this thread's first autograd sequence
  // number in it, and the nodes of its inputs' views (what the graph walk
  // stops at; held, so that no other node takes a freed one's address).
  std::vector<uint64_t> call_first_node;
  std::vector<std::vector<std::shared_ptr<torch::autograd::Node>>> call_marked_views;
  bool forward_with_grad = true; // the wrapper's forward runs with autograd
  std::vector<char> holds_frozen; // per unit: a member that requires no grad
  // The order backward reduces the units in, the same on every rank: last
  // registered first until the first forward has run, then the reverse of
  // rank 0's forward order (agree_on_order); the root last.
  std::vector<size_t> reduce_order;
  bool order_agreed = false;
  size_t reduced = 0;             // reduce_order[0, reduced) done in this backward
  std::vector<char> reduced_unit; // per unit, the same
  bool backward_open = false;
  bool in_forward = false; // the wrapper's forward runs
  // FsdpNoSyncGuard: whether backward reduces, and whether this one does.
  bool sync_enabled = true;
  bool sync_this_backward = true;
  // The gradients of a backward under the guard await the next one's
  // reduction: a forward that fails in between keeps them.
  bool accumulating = false;
  // Per unit and member: a gradient came since the last reduction (a member
  // that no rank used gets no gradient).
  std::vector<std::vector<char>> used_since_sync;
  // The units in the order their forwards ran, in this step and the last
  // (what prefetch follows); each unit's place in the last.
  std::vector<size_t> forward_order;
  std::vector<size_t> last_forward_order;
  std::vector<std::optional<size_t>> place_in_last;

  /// With FsdpOptions::prefetch, starts gathering the unit `step` places
  /// from `unit` in the last step's forward order.
  void prefetch_from(size_t unit, int step) {
    if (!options.prefetch() || unit >= place_in_last.size() || !place_in_last[unit]) {
      return;
    }
    auto target = static_cast<int64_t>(*place_in_last[unit]) + step;
    if (target >= 0 && target < static_cast<int64_t>(last_forward_order.size())) {
      size_t next = last_forward_order[static_cast<size_t>(target)];
      timed("prefetch", next, [&] { units[next]->prefetch(shard_world, pool); });
    }
  }

  /// A member of a unit, with its unit.
  struct NumberedMember {
    const FlatUnit* unit;
    const FlatUnit::Member* member;
  };
  /// Every unit's members, unit by unit: a member's place here is its
  /// number in checkpoints, consolidated and sharded alike.
  std::vector<NumberedMember> members_in_order() const {
    std::vector<NumberedMember> numbered;
    for (const auto& unit : units) {
      for (const auto& member : unit->members()) {
        numbered.push_back({unit.get(), &member});
      }
    }
    return numbered;
  }

  void shard(torch::nn::Module& module);
  std::shared_ptr<torch::autograd::Node> hook_accumulator(const at::Tensor& param, size_t unit,
                                                          size_t member);
  /// Hooks the accumulators that a gather in another dtype replaced.
  void rehook(size_t unit);
  /// Drops what the step held; a step whose backward accumulated without
  /// reducing (FsdpNoSyncGuard) keeps its gradients.
  void reset_step(bool keep_gradients = false);
  /// Whether nothing left of this backward reads `unit`'s parameters once
  /// its gradients are in: with every parameter trainable, at once (the
  /// node that reads a weight computes its gradient); with one frozen, once
  /// the gradient of every input that requires grad has come (at once
  /// where none does: every node of the unit's backward then leads to a
  /// trainable parameter of its own, and has run before its gradient
  /// came), unless it is read late.
  bool parameters_read_out(size_t unit) const {
    return holds_frozen[unit] == 0 ||
        (calls[unit] > 0 && read_late[unit] == 0 && inputs_arrived[unit] >= inputs_marked[unit]);
  }
  /// Frees `unit` once it is reduced and nothing else reads it.
  void free_if_done(size_t unit) {
    if (reduced_unit[unit] != 0 && keep_gathered[unit] == 0 && parameters_read_out(unit)) {
      free(unit);
    }
  }
  /// After a forward: notes the accumulators that `nodes` (what its
  /// outputs reach) hold.
  void note_reached(const std::unordered_set<const torch::autograd::Node*>& nodes);
  /// Collective, once, at the first forward that follows one that ran
  /// units: the reduction order from rank 0's forward order.
  void agree_on_order();
  /// Collective, after a reducing backward: a trainable member that no
  /// rank used since the last reduction keeps the gradient it had (none).
  void settle_unused();
  /// The declared units with parameters that `forward_order` lacks.
  std::vector<size_t> units_not_run() const;
  /// Raises UsageError, before any backward, where `outputs` were computed
  /// from a unit's parameters that its holder did not gather (a unit held
  /// in a container that calls the block, or called through ->forward()).
  void refuse_bypassed_units(const std::unordered_set<const torch::autograd::Node*>& nodes) const;
  // The SyncBatchNorms declared without a world, bound to this one for as
  // long as the wrapper lives (as DistributedDataParallel binds them).
  std::vector<std::weak_ptr<torch::nn::Module>> bound_norms;

  /// Gathers `unit` to compute with (in FsdpOptions::param_dtype).
  void gather(size_t unit) {
    timed("gather", unit, [&] { units[unit]->gather(shard_world, pool); });
    rehook(unit);
  }
  /// Gathers `unit` in its shards' own dtype, for checkpoints and loads.
  void gather_in_full_precision(size_t unit) {
    units[unit]->gather(shard_world, pool, /*full_precision=*/true);
  }
  void free(size_t unit) {
    units[unit]->free(pool);
  }
  /// Runs `body`, a span "`what` UNIT" on the timeline's FSDP track.
  template <typename Body>
  void timed(const char* what, size_t unit, Body&& body) {
    if (!timeline::enabled()) {
      body();
      return;
    }
    auto begin = timeline::Clock::now();
    body();
    timeline::record(kTimelineTrack,
                     str(what, " ", unit_names[unit].empty() ? "root" : unit_names[unit]),
                     begin, timeline::Clock::now());
  }
  static inline const std::string kTimelineTrack = "FSDP units";
  void free_all() {
    for (auto& unit : units) {
      unit->free(pool);
    }
  }
  /// Hooks `outputs` so that a backward reaching them gathers `unit` first;
  /// false where an output is not a tensor (no hook can reach it).
  bool hook_outputs(size_t unit, const std::vector<at::Tensor>& outputs);
  void on_output_gradient(size_t unit);
  void on_input_gradient(size_t unit);
  void on_gradient(size_t unit, size_t member);
  void open_backward();
  /// Reduces the units from the last unreduced one down while their
  /// gradients are complete (all of them, with `to_the_end`).
  void reduce_in_order(bool to_the_end);
  void finish_backward();
};

/// The hooks that unit `unit`'s Sharded holder calls (sharded_model.cpp).
std::shared_ptr<UnitHooks> make_unit_hooks(std::weak_ptr<ShardedModel::State> state, size_t unit);

/// Raises ConfigError where a torch::nn::Sequential among `modules` holds a
/// declared unit: it calls the block, not the holder that gathers it.
void refuse_units_in_sequentials(
    const torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>& modules);

} // namespace lockstep::detail
