// A parameter that starts to require grad after the wrapper was built (a
// sub-module unfrozen at some step of a fine-tuning schedule): PyTorch never
// averages its gradient and the replicas drift apart. Here every rank tells
// in the last bucket whether one of its frozen parameters began to require
// grad; if any did, all ranks check that it is the same parameters
// everywhere, take them in (hooks, buckets), and average the gradient this
// backward gave them, so that training stays equivalent to one process.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "reducer/reducer_state.h"

namespace lockstep::detail {

bool Reducer::State::trainable_changed_locally() const {
  for (const auto& entry : frozen) {
    if (entry.tensor.requires_grad()) {
      return true;
    }
  }
  return false;
}

void Reducer::State::take_in_unfrozen() {
  // Every rank learned of it from the same extras: every rank raises.
  LOCKSTEP_ENFORCE(!options.shard_gradients(), UsageError, "a parameter began to require "
                   "grad in iteration ", iteration, ", and DdpOptions::shard_gradients lays "
                   "the optimizer's shards over the buckets of the construction, for good. "
                   "Set requires_grad before wrapping the module.");
  std::string mine;
  std::vector<NamedTensor> still_frozen;
  std::vector<NamedTensor> unfrozen;
  for (const auto& entry : frozen) {
    (entry.tensor.requires_grad() ? unfrozen : still_frozen).push_back(entry);
    if (entry.tensor.requires_grad()) {
      mine += (mine.empty() ? "" : ", ") + entry.name;
    }
  }
  auto everyone = world.all_gather_strings(mine);
  for (size_t rank = 1; rank < everyone.size(); ++rank) {
    LOCKSTEP_ENFORCE(
        everyone[rank] == everyone[0], UsageError, "parameters began to require grad on some "
        "ranks only, in iteration ", iteration, ": rank 0: ",
        everyone[0].empty() ? "none" : everyone[0], "; rank ", rank, ": ",
        everyone[rank].empty() ? "none" : everyone[rank], ". Unfreeze the same parameters "
        "on every rank, at the same step.");
  }
  size_t first_new = params.size();
  for (const auto& entry : unfrozen) {
    names.push_back(entry.name);
    params.push_back(entry.tensor);
    sparse.push_back(0);
    used_since_sync.push_back(0);
  }
  frozen = std::move(still_frozen);
  install_hooks(first_new);

  // This backward reached them before they had hooks: average what it gave
  // them now, each rank's gradient or zeros, with a flag for "had one".
  {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> parts;
    for (size_t index = first_new; index < params.size(); ++index) {
      const auto& grad = params[index].grad();
      parts.push_back(grad.defined() ? grad.reshape({-1}) : at::zeros({params[index].numel()},
                                                                      params[index].options()));
      parts.push_back(at::full({1}, grad.defined() ? 1 : 0, params[index].options()));
    }
    auto flat = at::cat(parts).to(at::kDouble);
    world.all_reduce(flat);
    int64_t offset = 0;
    for (size_t index = first_new; index < params.size(); ++index) {
      int64_t numel = params[index].numel();
      bool anywhere = flat[offset + numel].item<double>() > 0;
      if (anywhere) {
        auto average = (flat.narrow(0, offset, numel) / world.size())
                           .to(params[index].scalar_type())
                           .view(params[index].sizes());
        auto& grad = params[index].mutable_grad();
        grad = grad.defined() ? grad.copy_(average) : average;
      }
      offset += numel + 1;
    }
  }

  // The buckets as they are, the new parameters last (their gradients come
  // late in backward: they were frozen layers, usually the first ones).
  std::vector<size_t> order;
  for (const auto& bucket : layout.buckets) {
    order.insert(order.end(), bucket.members().begin(), bucket.members().end());
  }
  for (size_t index = first_new; index < params.size(); ++index) {
    order.push_back(index);
  }
  layout_buckets(order);
  layout.learned.clear(); // it covers them not: a new world learns again
  static_used.reset(); // a static graph is learned again, with them
  log_layout(str("after taking in ", mine, ", which began to require grad"));
}

} // namespace lockstep::detail
