// DdpOptions::shard_gradients (ZeRO-2): each bucket is reduce-scattered, so
// that a rank keeps the sum of its own slice only, and the bucket's memory
// goes once its slice is in. The used flags and the extras, which every
// rank needs whole and exact, travel in a small all-reduce of their own
// beside it. What keeps the slices, steps them and brings the new
// parameters back is a GradientShardOwner (the ZeroRedundancyOptimizer);
// the buckets' layout, fixed from construction, is its partition.

#include <algorithm>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/optimizer.h>

#include "reducer/reducer_state.h"
#include "world/epoch_world.h"

namespace lockstep::detail {
namespace {

// Buckets that may hold their whole gradients at once: one travelling
// while the next fills, and one more so that the wait for the oldest
// overlaps the newest's launch.
constexpr size_t kBucketsHeld = 2;
// Buffers kept for reuse: those in flight and the one filling.
constexpr size_t kSpareBuckets = kBucketsHeld + 1;

} // namespace

void Reducer::shard_gradients_with(torch::optim::Optimizer& optimizer) {
  auto& state = *state_;
  std::lock_guard<std::mutex> lock(state.mutex);
  LOCKSTEP_ENFORCE(state.options.shard_gradients(), UsageError, "shard_gradients_with needs "
                   "a wrapper built with DdpOptions().shard_gradients(true): without it, every "
                   "rank keeps every averaged gradient, and a ZeroRedundancyOptimizer steps "
                   "its shard of them with optimizer.step() alone (ZeRO-1).");
  state.require_before_first_forward(
      "shard_gradients_with", "every rank must reduce-scatter its buckets from the first "
      "iteration on");
  LOCKSTEP_ENFORCE(!state.gradient_shards, UsageError, "an optimizer already keeps this "
                   "wrapper's gradient shards; register it once.");
  auto* owner = dynamic_cast<GradientShardOwner*>(&optimizer);
  LOCKSTEP_ENFORCE(owner != nullptr, UsageError, "DdpOptions::shard_gradients keeps each "
                   "rank's slice of the averages for a lockstep::ZeroRedundancyOptimizer, "
                   "which steps it; the optimizer given to shard_gradients_with is not one.");
  std::vector<std::vector<at::Tensor>> buckets;
  std::vector<int64_t> slices;
  std::vector<at::Tensor> averages;
  for (const auto& bucket : state.layout.buckets) {
    std::vector<at::Tensor> members;
    for (size_t index : bucket.members()) {
      members.push_back(state.params[index]);
    }
    slices.push_back(bucket.shard_numel());
    averages.push_back(at::zeros({bucket.shard_numel()}, members.front().options()
                                                             .requires_grad(false)));
    buckets.push_back(std::move(members));
  }
  owner->shard_by_buckets(buckets, slices, state.world.rank(), state.world.size());
  state.gradient_shards = State::GradientShards{};
  state.gradient_shards->owner = owner;
  state.gradient_shards->averages = std::move(averages);
}

at::Tensor Reducer::State::take_spare_bucket(int64_t numel, const at::TensorOptions& options) {
  for (auto spare = spare_buckets.begin(); spare != spare_buckets.end(); ++spare) {
    if (spare->numel() >= numel && spare->dtype() == options.dtype() &&
        spare->device() == options.device()) {
      auto taken = std::move(*spare);
      spare_buckets.erase(spare);
      return taken.narrow(0, 0, numel);
    }
  }
  return at::empty({numel}, options);
}

void Reducer::State::allocate_sharded(size_t b) {
  auto& shards = *gradient_shards;
  auto& bucket = layout.buckets[b];
  bucket.allocate_buffer();
  shards.bytes_held += bucket.bytes();
  shards.peak_bytes_held = std::max(shards.peak_bytes_held, shards.bytes_held);
}

void Reducer::State::launch_sharded(size_t b) {
  auto& shards = *gradient_shards;
  auto& bucket = layout.buckets[b];
  TORCH_INTERNAL_ASSERT(bucket.allocated(), "every member was marked, and the first made it");
  // The flags travel in a copy: the reduce-scatter may sum them in place
  // (a transport without one all-reduces the bucket, as DDP does).
  shards.flags_sent[b] = bucket.flags_and_extras().clone();
  backward.in_flight[b] = WorldAccess::reduce_scatter_async(
      world, shards.averages[b], bucket.buffer(), bucket.unpadded_numel(),
      backward.in_flight_what[b]);
  shards.flags_work[b] = world.all_reduce_async(
      shards.flags_sent[b], ReduceOp::Sum,
      str("the used flags of ", describe_bucket(b), " (beside its reduce_scatter)"));
  stats.last.bytes_reduced += bucket.bytes();
  while (shards.next_harvest + kBucketsHeld <= b) {
    sharded_flags(shards.next_harvest);
  }
}

const std::vector<double>& Reducer::State::sharded_flags(size_t b) {
  auto& shards = *gradient_shards;
  for (size_t& next = shards.next_harvest; next <= b; ++next) {
    backward.in_flight[next]->wait();
    shards.flags_work[next]->wait();
    auto host = shards.flags_sent[next].to(at::kDouble).to(at::kCPU).contiguous();
    shards.flags[next].assign(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
    // The collectives hold the bucket's memory too: let go of all of it.
    shards.completed[next] = backward.in_flight[next]->completed_at();
    backward.in_flight[next].reset();
    shards.flags_work[next].reset();
    shards.flags_sent[next] = at::Tensor();
    auto& bucket = layout.buckets[next];
    auto buffer = bucket.release_buffer();
    shards.bytes_held -= bucket.bytes();
    // Whole: the narrowing of an earlier reuse is undone.
    auto whole = static_cast<int64_t>(buffer.storage().nbytes() / buffer.element_size());
    spare_buckets.push_back(
        at::empty({0}, buffer.options()).set_(buffer.storage(), 0, {whole}, {1}));
    if (spare_buckets.size() > kSpareBuckets) {
      auto smallest = std::min_element(spare_buckets.begin(), spare_buckets.end(),
                                       [](const at::Tensor& a, const at::Tensor& b) {
                                         return a.numel() < b.numel();
                                       });
      spare_buckets.erase(smallest);
    }
  }
  return shards.flags[b];
}

void Reducer::State::hand_over_average(size_t b, const double* flags) {
  auto& shards = *gradient_shards;
  const auto& members = layout.buckets[b].members();
  std::vector<char> used(members.size(), 0);
  for (size_t k = 0; k < members.size(); ++k) {
    used[k] = flags[k] > 0 ? 1 : 0;
  }
  {
    at::NoGradGuard no_grad;
    shards.averages[b].div_(gradient_divisor());
  }
  shards.owner->take_average(b, shards.averages[b], used);
}

} // namespace lockstep::detail
