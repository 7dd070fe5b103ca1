// The backward half of the reducer: a parameter's gradient is ready, its
// bucket leaves when full, and the end of backward completes the iteration.

#include <algorithm>
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "reducer/bucket_cap.h"
#include "reducer/reducer_state.h"
#include "timeline/recorder.h"

namespace lockstep::detail {

void Reducer::State::on_forward_reached(int64_t forward, bool sync) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!backward.open) {
    open_iteration(forward, sync);
  }
}

void Reducer::State::on_gradient(size_t index) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!backward.open) {
    int64_t forward = std::exchange(unhooked_forward, 0);
    open_iteration(forward, forward > 0 ? unhooked_sync : sync_enabled);
  }
  backward.used_now[index] = 1;
  if (!backward.sync) {
    used_since_sync[index] = 1;
    return;
  }
  if (static_used && !(*static_used)[index]) {
    backward.problems.push_back(str(
        "parameter '", names[index], "' got a gradient in iteration ",
        iteration, " but not in the first one, which static_graph froze."));
  }
  if (backward.ready[index]) {
    // The graph walk of find_unused_parameters judged it unused, yet the
    // loss reached it. While its bucket has not left, the gradient still
    // gets in; once it has, that is a problem to report.
    if (backward.next_launch > layout.bucket_of[index]) {
      backward.problems.push_back(str(
          "parameter '", names[index], "' got a gradient after "
          "find_unused_parameters judged it unused: the loss reaches it "
          "through a tensor that is not among the forward's outputs. Return "
          "that tensor from forward, or turn find_unused_parameters off."));
      return;
    }
    backward.ready[index] = 0;
    ++backward.pending[layout.bucket_of[index]];
  }
  backward.ready_order.push_back(index);
  if (!sparse[index]) {
    tolerate([&] { mark_ready(index, /*used=*/true); });
  }
}

void Reducer::State::open_iteration(int64_t forward, bool sync) {
  bool bypassed = forward == 0;
  LOCKSTEP_ENFORCE(!options.shard_gradients() || gradient_shards, UsageError, "rank ",
                   world.rank(), ": a backward reached the parameters of a wrapper built "
                   "with DdpOptions::shard_gradients before its ZeroRedundancyOptimizer was "
                   "registered: call ddp.shard_gradients_with(optimizer) first, on every rank.");
  if (bypassed && options.bypass() == Bypass::Error) {
    LOCKSTEP_FAIL(
        UsageError, "rank ", world.rank(), ": backward reached the "
        "parameters of the module wrapped in DistributedDataParallel "
        "without a forward through the wrapper: the loss was computed on "
        "ddp.module() (or another path to the same module). Call ddp(input) "
        "instead, or choose DdpOptions().bypass(Bypass::SyncAndWarn) to "
        "average such gradients anyway.");
  }
  if (bypassed && options.bypass() == Bypass::SyncAndWarn && !warned_bypass) {
    warned_bypass = true;
    TORCH_WARN(
        "lockstep: rank ", world.rank(), ": backward reached the parameters "
        "of the module wrapped in DistributedDataParallel without a forward "
        "through the wrapper (the loss was computed on ddp.module()?). The "
        "gradients are averaged across ranks anyway. Call ddp(input) "
        "instead, or set DdpOptions().bypass(Bypass::Ignore) to keep such "
        "gradients local or Bypass::Error to make this an error. Shown once.");
  }
  backward.open = true;
  backward.sync = bypassed ? options.bypass() != Bypass::Ignore && sync : sync;
  // Queued on the graph task that runs now: the backward of the loss, which
  // reached the forward's outputs before any parameter; a nested backward
  // (a reentrant checkpoint) inside it ends before it, and is part of it.
  // A shadowed iteration has no backward: join.cpp finalizes it.
  if (!backward.shadowing) {
    std::weak_ptr<State> weak = shared_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto state = weak.lock()) {
        state->finalize();
      }
    });
  }
  backward.used_now.assign(params.size(), 0);
  backward.first_gradient = Clock::now();
  if (!backward.sync) {
    return;
  }
  ++iteration;
  backward.of_forward = forward;
  // The first backward of the forward just timed counts from its end; any
  // other from its first gradient, with figures of its own.
  backward.from_forward_end = forward > 0 && forward == forwards && forward != timed_forward;
  timed_forward = forward;
  if (!backward.from_forward_end) {
    stats.last = IterationStats{};
  }
  backward.ready.assign(params.size(), 0);
  backward.ready_order.clear();
  backward.problems.clear();
  backward.pending.clear();
  for (const auto& bucket : layout.buckets) {
    backward.pending.push_back(bucket.members().size());
  }
  backward.next_launch = 0;
  backward.in_flight.assign(layout.buckets.size(), std::nullopt);
  backward.hooked.assign(layout.buckets.size(), nullptr);
  backward.in_flight_what.assign(layout.buckets.size(), "");
  if (gradient_shards) {
    auto& shards = *gradient_shards;
    shards.flags_sent.assign(layout.buckets.size(), at::Tensor());
    shards.flags_work.assign(layout.buckets.size(), std::nullopt);
    shards.flags.assign(layout.buckets.size(), {});
    shards.completed.assign(layout.buckets.size(), Clock::time_point{});
    shards.next_harvest = 0;
    shards.peak_bytes_held = shards.bytes_held;
    if (shards.owner->holds_unstepped_averages()) {
      // Every rank's program steps alike: every rank finds this, and the
      // end of backward raises it everywhere.
      backward.problems.push_back(str(
          "a synchronised backward began while the averages of the last one were not "
          "stepped: under DdpOptions::shard_gradients each synchronised backward's averages "
          "are written over by the next one. Call optimizer.step() (or, to skip the step, "
          "discard_gradients() on the ZeroRedundancyOptimizer) after each synchronised "
          "backward, and accumulate micro-batches under ddp.no_sync()."));
    }
  }
  times.launch_ms.assign(layout.buckets.size(), 0.0);
  times.bucket_first.assign(layout.buckets.size(), Clock::time_point{});
  times.bucket_ready.assign(layout.buckets.size(), Clock::time_point{});
  times.bucket_launch.assign(layout.buckets.size(), Clock::time_point{});
  if (unused_at_forward && unused_forward == forward && !bypassed) {
    tolerate([&] {
      for (size_t index : dense_only(*unused_at_forward)) {
        mark_ready(index, /*used=*/false);
      }
    });
  }
}

void Reducer::State::mark_ready(size_t index, bool used) {
  backward.ready[index] = 1;
  auto& bucket = layout.buckets[layout.bucket_of[index]];
  size_t k = layout.slot_of[index];
  auto& grad = params[index].mutable_grad();
  // A rank that ran out of batches adds zeros, whatever it accumulated; a
  // gradient hook that brought no gradient (an undefined one flowed back,
  // as through autograd::UndefinedGrad) adds nothing either, so that where
  // no rank has one, .grad stays undefined as in local training.
  bool contributes = !backward.shadowing && grad.defined() && (used || used_since_sync[index]);
  at::NoGradGuard no_grad;
  size_t b = layout.bucket_of[index];
  if (gradient_shards && !bucket.allocated()) {
    allocate_sharded(b); // at its first gradient (or, unused, its first mark)
  }
  if (!grad.defined() || backward.shadowing) {
    bucket.slot(k).zero_();
  } else if (grad.is_sparse()) {
    // A sparse gradient of a parameter in a bucket (a functional sparse
    // embedding, unknown at construction): averaged dense, the same values.
    bucket.slot(k).copy_(grad.to_dense());
  } else if (!bucket.holds(k, grad)) {
    bucket.slot(k).copy_(grad);
  } else if (!contributes) {
    // The slot will hold the sum over ranks; if no rank used the parameter,
    // its gradient must stay exactly as it was, so it leaves the bucket.
    grad = grad.clone();
  }
  bucket.flags()[static_cast<int64_t>(k)].fill_(contributes ? 1 : 0);
  if (gradient_shards && grad.defined()) {
    // Copied into the bucket, it goes: this rank keeps only the average of
    // its own slice, which comes back from the reduce-scatter.
    if (grad.requires_grad()) {
      backward.problems.push_back(str(
          "parameter '", names[index], "' has a gradient that requires grad "
          "(backward(create_graph=true)): DdpOptions::shard_gradients keeps no whole "
          "gradient to differentiate. Leave shard_gradients off for such a model."));
    } else {
      grad.reset();
    }
  }
  bool tracing = timeline::enabled();
  if (tracing && times.bucket_first[b] == Clock::time_point{}) {
    times.bucket_first[b] = Clock::now();
  }
  if (--backward.pending[b] == 0) {
    if (tracing) {
      times.bucket_ready[b] = Clock::now();
    }
    launch_ready_buckets(/*include_last=*/false);
  }
}

void Reducer::State::launch_ready_buckets(bool include_last) {
  // Strictly in bucket order, so that every rank issues the same sequence
  // of collectives. The last bucket waits for the end of backward, when this
  // rank's extras (problems, buffer changes) are known.
  size_t count = layout.buckets.size();
  for (size_t& b = backward.next_launch;
       b < count && backward.pending[b] == 0 && (include_last || b + 1 < count); ++b) {
    if (b + 1 == count) {
      auto extras = layout.buckets[b].extras();
      extras[kProblems].fill_(backward.problems.empty() ? 0 : 1);
      extras[kTrainableChanged].fill_(trainable_changed_locally() ? 1 : 0);
    }
    times.bucket_launch[b] = Clock::now();
    times.launch_ms[b] = ms_between(backward.first_gradient, times.bucket_launch[b]);
    backward.in_flight_what[b] = str(
        comm_hook ? "" : gradient_shards ? "reduce_scatter of " : "all_reduce of ",
        describe_bucket(b),
        backward.of_forward > 0 ? str(" in the backward of forward ", backward.of_forward)
                                : std::string(" in a backward that bypassed the wrapper"));
    launch_bucket(b);
  }
}

void Reducer::State::finalize() {
  std::lock_guard<std::mutex> lock(mutex);
  restore_masters(); // before any step, and before the gradients are read
  struct CloseIteration {
    State& state;
    ~CloseIteration() {
      state.backward.open = false;
      state.backward.shadowing = false;
    }
  } close{*this};
  if (!backward.sync) {
    if (timeline::enabled()) {
      timeline::record(timeline::kLoopTrack, "backward (no_sync: gradients stay local)",
                       backward.first_gradient, Clock::now());
    }
    return;
  }
  tolerate([&] { finish_backward(); });
}

void Reducer::State::finish_backward() {
  auto backward_end = Clock::now();

  for (size_t index = 0; index < params.size(); ++index) {
    if (backward.ready[index] || sparse[index]) {
      continue;
    }
    if (static_used && (*static_used)[index] && !backward.shadowing) {
      backward.problems.push_back(str(
          "parameter '", names[index], "' got no gradient in iteration ",
          iteration, " but did in the first one, which static_graph froze."));
    }
    mark_ready(index, /*used=*/false);
  }
  launch_ready_buckets(/*include_last=*/true);
  TORCH_INTERNAL_ASSERT(backward.next_launch == layout.buckets.size(), "a bucket was not launched");
  reduce_sparse_gradients();

  auto wait_start = Clock::now();
  bool per_bucket = steps_each_bucket();
  std::vector<double> global_flags =
      per_bucket ? wait_writing_back_and_stepping() : wait_for_buckets();
  auto wait_end = Clock::now();
  // The steps of each bucket's parameters happen while waiting: not waiting.
  double stepped_while_waiting = stats.last.step_ms;

  int64_t ranks_with_problems = 0;
  bool trainable_changed = false;
  if (!layout.buckets.empty()) {
    const double* extras = global_flags.data() + global_flags.size() - kExtraCount;
    ranks_with_problems = static_cast<int64_t>(extras[kProblems]);
    trainable_changed = extras[kTrainableChanged] > 0;
  }
  if (ranks_with_problems > 0) {
    raise_problems_everywhere(ranks_with_problems);
  }
  // A rank that ran out keeps its gradients, unless it steps along.
  if (!per_bucket && (!backward.shadowing || steps_when_shadowing())) {
    write_back(global_flags);
  }
  used_since_sync.assign(params.size(), 0);

  stats.unused_parameters.clear();
  for (size_t index = 0; index < params.size(); ++index) {
    if (!backward.used_now[index]) {
      stats.unused_parameters.push_back(names[index]);
    }
  }
  if (info && !backward.shadowing && (iteration == 1 || stats.unused_parameters != last_unused)) {
    std::string list;
    for (const auto& name : stats.unused_parameters) {
      list += (list.empty() ? "" : ", ") + name;
    }
    log(str("iteration ", iteration, ": parameters without a gradient here: ",
            list.empty() ? "none" : list));
    last_unused = stats.unused_parameters;
  }
  if (!layout.rebuilt) {
    rebuild_buckets();
    log_layout("rebuilt in the order gradients became ready");
  }
  if (options.static_graph() && !static_used && !backward.shadowing) {
    static_used = backward.used_now;
  }
  if (trainable_changed) {
    take_in_unfrozen();
  }
  if (in_backward_step) {
    finish_steps();
  }
  if (backward.of_forward == 0) {
    // No forward went through the wrapper to sync the buffers: the
    // bypassing backward does, so that they stay in step all the same.
    sync_buffers_as_configured();
  }

  stats.iterations += 1;
  auto backward_start = backward.from_forward_end ? forward_end : backward.first_gradient;
  stats.last.backward_ms = ms_between(backward_start, Clock::now());
  stats.last.comm_wait_ms = ms_between(wait_start, wait_end) - stepped_while_waiting;
  stats.total.backward_ms += stats.last.backward_ms;
  stats.total.comm_wait_ms += stats.last.comm_wait_ms;
  stats.total.step_ms += stats.last.step_ms;
  if (world.size() == 1) {
    stats.last.bytes_reduced = 0; // a world of one sends nothing
  }
  stats.total.bytes_reduced += stats.last.bytes_reduced;
  stats.bucket_launch_ms = times.launch_ms;
  stats.backward_end_ms = ms_between(backward.first_gradient, backward_end);
  if (gradient_shards) {
    stats.last.bucket_bytes_held = gradient_shards->peak_bytes_held;
  } else {
    int64_t held = 0;
    for (const auto& bucket : layout.buckets) {
      held += bucket.bytes();
    }
    stats.last.bucket_bytes_held = held;
  }
  if (timeline::enabled()) {
    record_timeline(wait_start, wait_end);
  }
}

void Reducer::State::record_timeline(Clock::time_point wait_start,
                                     Clock::time_point wait_end) const {
  // Recorded once the iteration is over, when every all-reduce's completion
  // time is known.
  const auto& loop = timeline::kLoopTrack;
  auto it = str(iteration);
  timeline::record(loop, "backward", backward.first_gradient, Clock::now(), {{"iteration", it}});
  timeline::record(loop, "waiting for buckets", wait_start, wait_end, {{"iteration", it}});
  for (size_t b = 0; b < backward.in_flight.size(); ++b) {
    auto track = str("bucket ", b);
    timeline::Args args{{"iteration", it}, {"collective", backward.in_flight_what[b]}};
    timeline::record(track, "gradients", times.bucket_first[b], times.bucket_ready[b], args);
    // A bucket launched as it filled is queued only for the launch call
    // itself, which is not worth a span.
    if (times.bucket_launch[b] - times.bucket_ready[b] > std::chrono::microseconds(50)) {
      timeline::record(track, "queued", times.bucket_ready[b], times.bucket_launch[b], args);
    }
    auto done = backward.in_flight[b]  ? backward.in_flight[b]->completed_at()
                : gradient_shards     ? gradient_shards->completed[b]
                                      : wait_end;
    timeline::record(track, comm_hook ? "hook" : gradient_shards ? "reduce_scatter" : "all_reduce",
                     times.bucket_launch[b], done, args);
  }
  timeline::flush();
}

void Reducer::State::raise_problems_everywhere(int64_t ranks_with_problems) {
  // Every rank learned the count from the same all-reduce, so every rank
  // is here: gathering the texts is safe, and every rank raises the same.
  std::string mine;
  for (const auto& problem : backward.problems) {
    mine += (mine.empty() ? "" : "\n    ") + problem;
  }
  auto texts = world.all_gather_strings(mine);
  std::ostringstream message;
  message << "iteration " << iteration << " broke a rule on "
          << ranks_with_problems << " rank(s):";
  bool static_graph_broken = false;
  for (size_t rank = 0; rank < texts.size(); ++rank) {
    if (!texts[rank].empty()) {
      message << "\n  rank " << rank << ": " << texts[rank];
      static_graph_broken |= texts[rank].find("static_graph froze") != std::string::npos;
    }
  }
  if (static_graph_broken) {
    message << "\nstatic_graph(true) promises that every iteration uses the "
               "parameters of the first; turn it off for a model whose used "
               "parameters change between iterations or ranks.";
  }
  LOCKSTEP_FAIL(UsageError, message.str());
}

void Reducer::State::write_back(const std::vector<double>& global_flags) {
  size_t flag = 0;
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    write_back_bucket(b, global_flags.data() + flag);
    flag += layout.buckets[b].members().size();
  }
}

void Reducer::State::write_back_bucket(size_t b, const double* flags) {
  if (gradient_shards) {
    hand_over_average(b, flags);
    return;
  }
  at::NoGradGuard no_grad;
  auto& bucket = layout.buckets[b];
  if (!comm_hook) {
    bucket.gradients().div_(gradient_divisor()); // a hook returns the average
  }
  for (size_t k = 0; k < bucket.members().size(); ++k) {
    size_t index = bucket.members()[k];
    bool zeroed = index < layout.zeroed_by_world_change.size() &&
        layout.zeroed_by_world_change[index];
    if (zeroed) {
      layout.zeroed_by_world_change[index] = 0;
    }
    if (flags[k] == 0) {
      if (zeroed) {
        params[index].mutable_grad() = at::Tensor(); // as on a rank that joined
      }
      continue; // used by no rank: its gradient stays as it was
    }
    auto& grad = params[index].mutable_grad();
    auto slot = bucket.slot(k);
    bool as_view = options.gradient_as_bucket_view() &&
        params[index].is_contiguous();
    if (bucket.holds(k, grad)) {
      continue;
    } else if (grad.defined() && grad.requires_grad()) {
      // backward(create_graph=true): the average, still differentiable
      // through this rank's own gradient, with its derivative: each
      // rank's contribution to a penalty on it is then averaged by the
      // next backward, as one process differentiates its whole batch's.
      at::AutoGradMode enable(true);
      grad = grad + (slot - grad).detach();
    } else if (grad.defined() && grad.is_sparse()) {
      grad = slot.clone();
    } else if (as_view) {
      grad = slot;
    } else if (grad.defined()) {
      grad.copy_(slot);
    } else {
      grad = slot.clone();
    }
  }
}

void Reducer::State::rebuild_buckets() {
  // Rank 0's ready order, so that every rank lays out the same buckets;
  // parameters that were not ready there go last.
  layout.rebuilt = true;
  stats.buckets_rebuilt = true;
  // The last entry: rank 0's bucket cap in bytes, where it is automatic.
  auto order = at::empty({static_cast<int64_t>(params.size()) + 1}, at::kLong);
  if (world.rank() == 0) {
    // The last bucket launches when backward's computation ends.
    double backward_ms = 0;
    for (double launch_ms : times.launch_ms) {
      backward_ms = std::max(backward_ms, launch_ms);
    }
    int64_t gradient_bytes = 0;
    for (const auto& bucket : layout.buckets) {
      gradient_bytes += bucket.bytes();
    }
    double cap_mb = automatic_cap ? automatic_bucket_cap_mb(static_cast<double>(gradient_bytes),
                                                            link_bytes_per_second,
                                                            backward_ms / 1e3)
                                  : *options.bucket_cap_mb();
    order.data_ptr<int64_t>()[params.size()] = static_cast<int64_t>(cap_mb * (1 << 20));
    std::vector<char> placed(params.size(), 0);
    int64_t position = 0;
    auto* data = order.data_ptr<int64_t>();
    for (size_t index : backward.ready_order) {
      if (!placed[index]) {
        placed[index] = 1;
        data[position++] = static_cast<int64_t>(index);
      }
    }
    for (size_t index : reverse_registration_order()) {
      if (!placed[index]) {
        data[position++] = static_cast<int64_t>(index);
      }
    }
  }
  lay_out_agreed_order(order, 0);
  if (automatic_cap) {
    log(str("buckets of ", *options.bucket_cap_mb(), " MiB from now on: the link carries ",
            link_bytes_per_second / (1 << 20), " MiB/s (a 4 MiB all-reduce, timed when the "
            "wrapper was built)"));
  }
}

void Reducer::State::lay_out_agreed_order(at::Tensor order, int source) {
  world.broadcast(order, source);
  const auto* data = order.data_ptr<int64_t>();
  layout.learned.assign(data, data + params.size());
  if (automatic_cap) {
    options.bucket_cap_mb(static_cast<double>(data[params.size()]) / (1 << 20));
  }
  layout.rebuilt = true;
  stats.buckets_rebuilt = true;
  layout_buckets(dense_only(layout.learned));
}

} // namespace lockstep::detail
