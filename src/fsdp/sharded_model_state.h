#pragma once

// FullyShardedDataParallel's state, shared by sharded_model.cpp (the life
// of a step) and sharded_state.cpp (the state as checkpoints see it).

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <lockstep/fsdp.h>

#include "fsdp/buffer_pool.h"
#include "fsdp/flat_unit.h"
#include "timeline/recorder.h"

namespace lockstep::detail {

struct ShardedModel::State : std::enable_shared_from_this<State> {
  State(World world_in, FsdpOptions options_in)
      : world(std::move(world_in)), options(options_in), pool(options.prefetch() ? 3 : 2) {}

  World world;
  FsdpOptions options;
  // Unit 0 is the root (what no declared unit holds); the others in the
  // order of the module tree. A unit without parameters has none here.
  std::vector<std::string> unit_names;
  std::vector<std::unique_ptr<FlatUnit>> units;
  std::vector<std::shared_ptr<torch::nn::Module>> unit_modules; // the declared ones sharded
  std::vector<std::shared_ptr<UnitHooks>> hooks;
  // Held: a parameter only keeps a weak reference to its accumulator.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  // A unit's parameters and gradients, and with prefetch the next unit's
  // parameters.
  BufferPool pool;
  // A unit's gradients end to end on their way to the shards.
  at::Tensor gradient_scratch;

  // The step in progress.
  std::vector<std::vector<char>> arrived; // per unit, per member
  std::vector<size_t> pending;            // per unit: gradients still to come
  std::vector<char> keep_gathered;        // outputs that no hook could reach
  size_t unreduced = 0;                   // units [0, unreduced) still to reduce
  bool backward_open = false;
  bool in_forward = false; // the wrapper's forward runs
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
      timed("prefetch", next, [&] { units[next]->prefetch(world, pool); });
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
  void reset_step();
  // The SyncBatchNorms declared without a world, bound to this one for as
  // long as the wrapper lives (as DistributedDataParallel binds them).
  std::vector<std::weak_ptr<torch::nn::Module>> bound_norms;

  void gather(size_t unit) {
    if (!units[unit]->gathered()) {
      timed("gather", unit, [&] { units[unit]->gather(world, pool); });
    }
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
  void on_gradient(size_t unit, size_t member);
  void open_backward();
  /// Reduces the units from the last unreduced one down while their
  /// gradients are complete (all of them, with `to_the_end`).
  void reduce_in_order(bool to_the_end);
  void finish_backward();
};

} // namespace lockstep::detail
