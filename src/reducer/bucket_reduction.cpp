// How the buckets of an iteration are reduced: the one place where the
// reducer hands a bucket to communication. Without a hook, each bucket
// is all-reduced whole, its "used" flags (and, in the last one, the extras)
// riding after the gradients: no collective of their own. With a hook, the
// hook gets the gradients alone, which it may compress; the flags and the
// extras, which must stay exact, travel in one small float64 all-reduce
// (the exact lane), started once the last bucket has left so that it runs
// while the hooks' communication completes. With a step inside backward
// and no hook, each bucket is awaited, written back and stepped in turn,
// while later buckets are still on their way.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "reducer/reducer_state.h"

namespace lockstep::detail {

void Reducer::State::launch_bucket(size_t b) {
  if (gradient_shards) {
    launch_sharded(b);
    return;
  }
  if (comm_hook) {
    launch_through_hook(b);
    return;
  }
  const auto& bucket = layout.buckets[b];
  backward.in_flight[b] =
      world.all_reduce_async(bucket.buffer(), ReduceOp::Sum, backward.in_flight_what[b]);
  stats.last.bytes_reduced += bucket.bytes();
}

void Reducer::State::launch_through_hook(size_t b) {
  const auto& bucket = layout.buckets[b];
  GradBucket view{b, b + 1 == layout.buckets.size(), bucket.gradients(), {}, {}, {}, world,
                  describe_bucket(b)};
  int64_t offset = 0;
  for (size_t index : bucket.members()) {
    view.parameters.push_back(params[index]);
    view.offsets.push_back(offset);
    view.parameter_indices.push_back(static_cast<int64_t>(index));
    offset += params[index].numel();
  }
  try {
    backward.hooked[b] = comm_hook(view);
    stats.last.bytes_reduced +=
        view.bytes_sent >= 0 ? view.bytes_sent : bucket.gradients().nbytes();
  } catch (const std::exception& e) {
    LOCKSTEP_FAIL(UsageError, "rank ", world.rank(), ": the communication hook failed on ",
                  backward.in_flight_what[b], ": ", e.what());
  }
  LOCKSTEP_ENFORCE(backward.hooked[b] != nullptr, UsageError, "rank ", world.rank(),
                   ": the communication hook returned no future for ",
                   backward.in_flight_what[b], ".");
}

namespace {

// The values of `parts`, wherever they live, as float64 on the host.
std::vector<double> host_values(const std::vector<at::Tensor>& parts) {
  if (parts.empty()) {
    return {};
  }
  std::vector<at::Tensor> doubles;
  for (const auto& part : parts) {
    doubles.push_back(part.to(at::kDouble));
  }
  auto host = at::cat(doubles).to(at::kCPU).contiguous();
  return {host.data_ptr<double>(), host.data_ptr<double>() + host.numel()};
}

} // namespace

std::vector<double> Reducer::State::wait_for_buckets() {
  if (gradient_shards) {
    std::vector<double> all;
    for (size_t b = 0; b < layout.buckets.size(); ++b) {
      const auto& flags = sharded_flags(b);
      all.insert(all.end(), flags.begin(), flags.end());
    }
    return all;
  }
  if (!comm_hook) {
    for (auto& work : backward.in_flight) {
      work->wait();
    }
    // The flags ride in the buckets, on the parameters' device: read once,
    // from a host copy.
    std::vector<at::Tensor> parts;
    for (const auto& bucket : layout.buckets) {
      parts.push_back(bucket.flags());
    }
    if (!layout.buckets.empty()) {
      parts.push_back(layout.buckets.back().extras());
    }
    return host_values(parts);
  }
  std::vector<at::Tensor> parts;
  for (const auto& bucket : layout.buckets) {
    parts.push_back(bucket.flags().to(at::kDouble));
  }
  if (!layout.buckets.empty()) {
    parts.push_back(layout.buckets.back().extras().to(at::kDouble));
  }
  auto lane = at::cat(parts);
  auto lane_work = world.all_reduce_async(
      lane, ReduceOp::Sum, str("the used flags of iteration ", iteration, " (", lane.numel(),
                              " values beside the hook's buckets)"));
  at::NoGradGuard no_grad;
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    at::Tensor average;
    try {
      average = backward.hooked[b]();
    } catch (const std::exception& e) {
      LOCKSTEP_FAIL(UsageError, "rank ", world.rank(), ": the communication hook's future "
                    "failed for ", backward.in_flight_what[b], ": ", e.what());
    }
    auto gradients = layout.buckets[b].gradients();
    LOCKSTEP_ENFORCE(average.defined() && average.numel() == gradients.numel(), UsageError,
                     "rank ", world.rank(), ": the communication hook returned ",
                     average.defined() ? str(average.numel(), " values") : "nothing", " for ",
                     backward.in_flight_what[b], ", which holds ", gradients.numel(), ".");
    if (!average.is_same(gradients)) {
      gradients.copy_(average.reshape({-1}));
    }
  }
  lane_work.wait();
  return host_values({lane});
}

std::vector<double> Reducer::State::wait_writing_back_and_stepping() {
  std::vector<double> global_flags;
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    const auto& bucket = layout.buckets[b];
    bool last = b + 1 == layout.buckets.size();
    std::vector<double> flags;
    if (gradient_shards) {
      flags = sharded_flags(b);
    } else {
      backward.in_flight[b]->wait();
      flags = host_values(last ? std::vector<at::Tensor>{bucket.flags(), bucket.extras()}
                               : std::vector<at::Tensor>{bucket.flags()});
    }
    global_flags.insert(global_flags.end(), flags.begin(), flags.end());
    if (last && flags[flags.size() - kExtraCount + kProblems] > 0) {
      break; // the iteration raises: its last bucket does not step
    }
    write_back_bucket(b, flags.data());
    step_parameters_of(bucket.members());
  }
  return global_flags;
}

} // namespace lockstep::detail
