#pragma once

// The reducer's state, shared by its two halves: reducer.cpp (construction,
// bucket layout, forward) and backward.cpp (hooks, launches, the end of
// backward).

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include <lockstep/comm_hook.h>
#include <lockstep/error.h>
#include <lockstep/detail/gradient_shard_owner.h>
#include <lockstep/detail/reducer.h>
#include <lockstep/step_in_backward.h>

#include "amp/sixteen_bit_support.h"
#include "reducer/bucket.h"
#include "reducer/model_state.h"

namespace torch::autograd {
struct Node;
} // namespace torch::autograd
namespace torch::nn {
class Module;
} // namespace torch::nn

namespace lockstep::detail {

using Clock = std::chrono::steady_clock;

inline double ms_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

/// Raises ConfigError for a policy that names a dtype that is not floating
/// (before any collective).
void check_mixed_precision(const MixedPrecision& policy);

struct Reducer::State : std::enable_shared_from_this<State> {
  State(World world_in, DdpOptions options_in)
      : world(std::move(world_in)), options(options_in) {}

  World world;
  DdpOptions options;
  bool info = false; // DebugLevel Info or Detail
  // bucket_cap_mb unset across hosts: the rebuild after the first
  // iteration chooses it from the link (bucket_cap.h).
  bool automatic_cap = false;
  double link_bytes_per_second = 0;

  // Trainable parameters, each once, in registration order (then those
  // taken in later).
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  // Parameters of embeddings built with sparse(true): averaged as sparse
  // tensors at the end of backward (sparse_gradients.cpp), not in buckets.
  std::vector<char> sparse;
  // Parameters that did not require grad when last looked at: one that
  // starts to is taken in (late_parameters.cpp).
  std::vector<NamedTensor> frozen;
  // Kept alive: a parameter only holds a weak reference to its accumulator,
  // and a new one, without our hook, would replace it.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::vector<at::Tensor> buffers;
  std::vector<int64_t> buffer_versions; // as of the last broadcast
  // Buffers that every rank updates alike (SyncBatchNorm's statistics of
  // the global batch): never broadcast after construction, always compared.
  std::vector<char> buffer_in_step;
  // Whether the module holds a SyncBatchNorm, which communicates in forward
  // and backward by itself.
  bool communicates_in_forward = false;
  // The SyncBatchNorms declared without a world that this wrapper bound to
  // its own: unbound when it goes, so that they do not outlive it there.
  std::vector<std::weak_ptr<torch::nn::Module>> bound_norms;
  // Every parameter (trainable or not) and every buffer, by name, for
  // check_replicas.
  std::vector<NamedTensor> all_params;
  std::vector<NamedTensor> named_buffers;
  int64_t forwards = 0;

  // The bucket layout, one owner: layout_buckets() (at construction, at the
  // rebuild after the first iteration, when a parameter is taken in).
  struct Layout {
    std::vector<Bucket> buckets;
    std::vector<size_t> bucket_of; // per parameter
    std::vector<size_t> slot_of;   // per parameter, in its bucket
    bool rebuilt = false;          // in the order of the first backward
    // That order, agreed among the ranks, once learned: a new world (fault
    // tolerance's) lays its buckets out in it at once. Cleared when a
    // parameter is taken in late (the order no longer covers it).
    std::vector<size_t> learned;
    // Per parameter: its gradient is a zeroed view that a change of world
    // made, not yet written by a backward. One that no rank uses in the
    // next backward then has none, as on a rank that joined (which has no
    // gradients): the replicas' optimizers step the same parameters.
    std::vector<char> zeroed_by_world_change;
  };
  Layout layout;

  mutable std::mutex mutex;
  bool sync_enabled = true;

  // The forward in progress, or the last one.
  bool sync_at_forward = true;
  Clock::time_point forward_start;
  Clock::time_point forward_end;
  // find_unused_parameters' verdict on forward `unused_forward`.
  std::optional<std::vector<size_t>> unused_at_forward;
  int64_t unused_forward = 0;
  // A forward whose outputs carried no hook (not tensors): the next backward
  // is taken to be its.
  int64_t unhooked_forward = 0;
  bool unhooked_sync = true;

  // The backward in progress, one owner: open_iteration() starts it,
  // finalize() ends it.
  struct Backward {
    bool open = false;
    bool sync = false;
    // This rank ran out of batches (join.cpp) and runs the others'
    // iteration with zero gradients.
    bool shadowing = false;
    // The forward whose backward this is (0: one that bypassed the
    // wrapper); in each bucket's description, so that DETAIL tells a rank
    // that skipped a backward from one at the same iteration count.
    int64_t of_forward = 0;
    bool from_forward_end = false;
    Clock::time_point first_gradient;
    std::vector<char> ready;    // per parameter
    std::vector<char> used_now; // per parameter
    std::vector<size_t> ready_order;
    std::vector<size_t> pending; // per bucket: gradients still to come
    size_t next_launch = 0;
    std::vector<std::optional<PendingCollective>> in_flight;
    // With a communication hook: each bucket's future.
    std::vector<BucketFuture> hooked;
    // What each bucket's reduction is, as named in errors and the timeline
    // (kept: the first iteration ends by relaying the buckets).
    std::vector<std::string> in_flight_what;
    std::vector<std::string> problems;
  };
  Backward backward;
  int64_t timed_forward = 0;
  // How buckets travel besides the built-in all-reduce (comm_hook.h).
  CommHook comm_hook;
  // Whether comm_hook is the mixed-precision policy's cast to reduce_dtype
  // alone (a user's hook may still be registered: it is then wrapped).
  bool comm_hook_is_policys = false;
  // DdpOptions::mixed_precision (mixed_precision.cpp): from a forward to the
  // end of its backward, the floating parameters hold 16-bit copies, and
  // `masters` their own data.
  struct MixedPrecisionCopies {
    at::ScalarType compute = at::kBFloat16;
    std::optional<at::ScalarType> reduce; // unset: the masters' own dtype
    std::vector<at::Tensor> params;       // floating, trainable or not
    std::vector<at::Tensor> masters;
    std::vector<at::Tensor> copies;
    bool swapped = false;
    int64_t swapped_at_forward = 0; // the forward that swapped them in
  };
  std::optional<MixedPrecisionCopies> mixed_precision;
  // What 16-bit work the model does on CPU: a 16-bit forward (autocast, the
  // policy) is first checked to run here (amp/sixteen_bit_support.h).
  std::vector<CpuWork> cpu_work;
  // ddp.step_in_backward (in_backward_step.cpp).
  struct InBackwardStep {
    ParameterStep step;
    StepInBackwardOptions options;
    std::vector<char> stepped;     // per parameter, in this iteration
    std::vector<int64_t> versions; // per parameter, after the last step
    // The parameters whose gradients go once stepped: the optimizer's
    // (empty: every parameter handed to a ParameterStep).
    std::unordered_set<const c10::TensorImpl*> freed;
  };
  std::optional<InBackwardStep> in_backward_step;
  // DdpOptions::shard_gradients (sharded_gradients.cpp), once its owner is
  // registered.
  struct GradientShards {
    GradientShardOwner* owner = nullptr;
    std::vector<at::Tensor> averages; // per bucket: this rank's slice
    // Per bucket, in this backward: a copy of its flags (and extras), their
    // all-reduce, and their sums on the host once harvested.
    std::vector<at::Tensor> flags_sent;
    std::vector<std::optional<PendingCollective>> flags_work;
    std::vector<std::vector<double>> flags;
    // When each bucket's reduce-scatter completed (for the timeline, once
    // harvested: the collective is let go of with the bucket's memory).
    std::vector<Clock::time_point> completed;
    size_t next_harvest = 0;
    int64_t bytes_held = 0; // bucket buffers allocated now
    int64_t peak_bytes_held = 0; // in this backward
  };
  // Sharded buckets' buffers let go of, for the next ones to reuse: a
  // buffer freed to the system and made again costs a page fault per page
  // every iteration. At most kSpareBuckets, the largest kept.
  std::vector<at::Tensor> spare_buckets;
  /// Memory for a sharded bucket of `numel` elements (not zeroed).
  at::Tensor take_spare_bucket(int64_t numel, const at::TensorOptions& options);
  std::optional<GradientShards> gradient_shards;

  // For the timeline and DdpStats, per bucket of the last backward: when it
  // launched (ms after the first gradient), its first gradient, its last,
  // its launch.
  struct BucketTimes {
    std::vector<double> launch_ms;
    std::vector<Clock::time_point> bucket_first;
    std::vector<Clock::time_point> bucket_ready;
    std::vector<Clock::time_point> bucket_launch;
  };
  BucketTimes times;

  // Uneven inputs (join.cpp), inside a join guard.
  struct Joining {
    JoinOptions options;
    // Who trained at the last agreement that found anyone training.
    std::vector<int> last_active;
    bool backward_follows = false;
  };
  std::optional<Joining> joining;
  // Ranks that had a batch in this iteration; the lowest of them is where
  // the buffers come from.
  int active_ranks = 0;
  int buffer_root = 0;
  // Across iterations.
  std::vector<char> used_since_sync;
  std::optional<std::vector<char>> static_used;
  bool warned_bypass = false;
  // Fault tolerance (fault_tolerance.h): a collective that fails inside an
  // iteration ends it quietly, and the loop's commit() learns why here.
  bool tolerating = false;
  std::string failure;
  /// Runs `body`; while tolerating, a collective's failure in it is noted
  /// instead of raised, and once one failed, the iteration's later
  /// collectives are skipped (the world they would run in is given up).
  template <typename Body>
  void tolerate(Body&& body) {
    if (!tolerating) {
      body();
      return;
    }
    if (!failure.empty()) {
      return;
    }
    try {
      body();
    } catch (const CollectiveError& e) {
      failure = e.what();
    } catch (const TimeoutError& e) {
      failure = e.what();
    }
  }
  int64_t iteration = 0; // synchronised backward passes begun
  // A world adopted (FaultTolerance re-formed it) and not checked since:
  // the next check_replicas that fails names the likely cause.
  bool adopted_unchecked = false;
  DdpStats stats;

  /// Raises UsageError unless no forward and no synchronised backward ran
  /// yet: what every rank must set up alike from the first iteration on.
  /// "`call` must come before the first forward, ...: `why`."
  void require_before_first_forward(const char* call, const char* why) const;
  /// Reducer::step_in_backward, once the step is known.
  void set_step_in_backward(ParameterStep step, const StepInBackwardOptions& options);
  /// Checks and sets up the mixed-precision policy (casts the buffers).
  void set_up_mixed_precision(const MixedPrecision& policy, torch::nn::Module& module);
  /// Before a forward: the parameters take their 16-bit copies, cast from
  /// the masters.
  void compute_in_copies();
  /// At the end of backward (and after a forward without autograd): the
  /// parameters take their masters back, and 16-bit gradients become
  /// float32.
  void restore_masters();
  /// restore_masters where the current forward swapped the copies in: its
  /// module raised, or it ran without autograd.
  void restore_masters_of_this_forward();
  /// Hooks the accumulators of params[first...].
  void install_hooks(size_t first);
  /// Hooks the gradient accumulator of params[index]; returns it (held, or
  /// autograd makes a new one without the hook).
  std::shared_ptr<torch::autograd::Node> hook_accumulator(size_t index);
  /// Hooks again the parameters that were given a new accumulator since
  /// (a module loaded with torch::load).
  void rehook_replaced_accumulators();
  void layout_buckets(const std::vector<size_t>& order);
  /// In a world just adopted: the order of the first backward, from a rank
  /// that learned it (a restarted rank has not), laid out on every rank;
  /// false (nothing laid out) where no rank knows it. Collective.
  bool adopt_learned_order();
  /// `order` (filled on `source`: the parameters' order, then the bucket
  /// cap in bytes) from `source` to every rank, which lays its buckets out
  /// in it: the same layout on every rank. Collective.
  void lay_out_agreed_order(at::Tensor order, int source);
  /// The parameters of `order` that go in buckets (the dense ones).
  std::vector<size_t> dense_only(const std::vector<size_t>& order) const;
  /// Marks the parameters of sparse embeddings.
  void find_sparse_parameters(torch::nn::Module& module);
  /// Averages every sparse parameter's gradient across ranks.
  void reduce_sparse_gradients();
  bool trainable_changed_locally() const;
  /// Collective: takes in the parameters that began to require grad on
  /// every rank, averages this backward's gradients of them, and lays out
  /// the buckets again.
  void take_in_unfrozen();
  std::vector<size_t> reverse_registration_order() const;

  void on_gradient(size_t index);
  /// A backward reached an output of forward `forward`: the iteration is
  /// that forward's, however many backwards (nested or repeated) run.
  void on_forward_reached(int64_t forward, bool sync);
  /// `forward` 0: a backward that bypassed the wrapper.
  void open_iteration(int64_t forward, bool sync);
  void mark_ready(size_t index, bool used);
  void launch_ready_buckets(bool include_last);
  /// Starts bucket `b`'s reduction: the built-in all-reduce, or the hook.
  void launch_bucket(size_t b);
  void launch_through_hook(size_t b);
  /// DdpOptions::shard_gradients: bucket `b`'s reduce-scatter into this
  /// rank's slice, and the all-reduce of its flags; at most two buckets are
  /// held at once, the older ones harvested.
  void launch_sharded(size_t b);
  /// Sharded: bucket `b`'s flags (then, in the last, the extras) summed
  /// over ranks, its buckets and those before it harvested: awaited, and
  /// their memory let go of.
  const std::vector<double>& sharded_flags(size_t b);
  /// Sharded: bucket `b`'s buffer, zeros, made now (at its first gradient,
  /// or its launch when none came).
  void allocate_sharded(size_t b);
  /// Sharded write-back: bucket `b`'s slice becomes the average, which the
  /// owner takes as its pieces' gradients.
  void hand_over_average(size_t b, const double* flags);
  /// Waits for the buckets' reductions; returns every bucket's flags and
  /// then the extras, summed over ranks.
  std::vector<double> wait_for_buckets();
  void finalize();
  /// finalize() of a synchronised backward: launch what is left, wait,
  /// write back.
  void finish_backward();
  void raise_problems_everywhere(int64_t ranks_with_problems);
  void write_back(const std::vector<double>& global_flags);
  /// Bucket `b`'s average into the gradients; `flags` are its used flags
  /// summed over ranks.
  void write_back_bucket(size_t b, const double* flags);
  /// Whether each bucket is awaited, written back and stepped in turn:
  /// step_in_backward without clipping or a communication hook.
  bool steps_each_bucket() const;
  /// wait_for_buckets, writing back and stepping each bucket once its
  /// reduction is done; the last bucket is left alone when a rank found a
  /// problem (the iteration then raises).
  std::vector<double> wait_writing_back_and_stepping();
  void step_parameters_of(const std::vector<size_t>& indices);
  /// After write-back: steps what has not stepped in this iteration
  /// (unscaling and clipping first when asked), then notes each
  /// parameter's version.
  void finish_steps();
  void step_all_parameters();
  /// StepInBackwardOptions::grad_scaler: unscales the optimizer's
  /// gradients; true (and those gradients freed) where one is inf or NaN.
  bool unscale_found_inf(amp::GradScaler& scaler);
  /// Before a forward: raises if a parameter changed in place since the
  /// last step inside backward (optimizer.step() called as well).
  void check_no_step_outside() const;
  void note_parameter_versions();
  /// Whether a rank that ran out of batches writes the average back, to step
  /// along with the others.
  bool steps_when_shadowing() const;
  void rebuild_buckets();
  bool buffers_changed_locally() const;
  /// Collective: whether any rank's buffers changed since the last broadcast.
  bool buffers_changed_anywhere();
  /// Puts ForwardReached hooks on the outputs of the forward just run.
  void hook_outputs(const std::vector<at::Tensor>& outputs);
  void broadcast_buffers();
  /// Marks the buffers of SyncBatchNorm modules as in step, notes that the
  /// module communicates in forward, and binds those declared without a
  /// world to this one.
  void find_buffers_in_step(torch::nn::Module& module);
  /// Collective, before every forward inside a join guard: which ranks
  /// still train, and whether a synchronised backward follows. False once
  /// no rank trains.
  bool agree_on_join(bool training_here, bool backward_follows);
  /// What a bucket's sum is divided by.
  int gradient_divisor() const;
  void check_replicas(ReplicaCheck what);
  /// Collective: the buffers as BufferSync says, after a forward or a
  /// bypassing backward (an agreement, then a broadcast if needed).
  void sync_buffers_as_configured();
  void record_timeline(Clock::time_point wait_start, Clock::time_point wait_end) const;
  std::string describe_bucket(size_t bucket) const;
  void log_layout(const std::string& when) const;
  void log(const std::string& message) const;
  std::vector<std::string> last_unused; // for Info: log only changes
};

} // namespace lockstep::detail
