// The module's buffers across ranks: when they are synchronised (an
// agreement before forward, a broadcast only when one changed, or as
// BufferSync says), which of them need it at all (not SyncBatchNorm's, which
// every rank updates alike), and the check that the replicas agree.

#include <algorithm>
#include <set>
#include <utility>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <lockstep/sync_batch_norm.h>

#include "reducer/model_state.h"
#include "reducer/reducer_state.h"

namespace lockstep::detail {

void Reducer::State::find_buffers_in_step(torch::nn::Module& module) {
  buffer_in_step.assign(buffers.size(), 0);
  for (const auto& item : module.named_modules()) {
    auto* sync = dynamic_cast<SyncBatchNormImpl*>(item.value().get());
    if (sync == nullptr) {
      continue;
    }
    if (!sync->world) {
      sync->world = world; // declared without one: the wrapper's
      bound_norms.push_back(item.value());
    }
    communicates_in_forward = true;
    for (const auto& buffer : item.value()->buffers(/*recurse=*/false)) {
      for (size_t i = 0; i < buffers.size(); ++i) {
        buffer_in_step[i] = buffer_in_step[i] || buffers[i].is_same(buffer);
      }
    }
  }
}

void Reducer::State::sync_buffers_as_configured() {
  bool broadcast = false;
  switch (options.broadcast_buffers()) {
    case BufferSync::Always:
      broadcast = true;
      break;
    case BufferSync::Never:
      break;
    case BufferSync::WhenChanged:
      broadcast = std::count(buffer_in_step.begin(), buffer_in_step.end(), 0) > 0 &&
          buffers_changed_anywhere();
      break;
  }
  if (broadcast) {
    broadcast_buffers();
  }
}

void Reducer::check_replicas(ReplicaCheck what) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->check_replicas(what);
}

void Reducer::sync_buffers() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->broadcast_buffers();
}

void Reducer::State::check_replicas(ReplicaCheck what) {
  std::vector<ReplicaEntry> state;
  for (const auto& entry : all_params) {
    state.push_back({entry, /*buffer=*/false, /*changed_here=*/false});
  }
  if (what == ReplicaCheck::All && options.broadcast_buffers() != BufferSync::Never) {
    // A module's buffers move together, and not every kernel counts its
    // writes (BatchNorm's running statistics do not; its batch count does):
    // a buffer counts as changed when any buffer of its module changed.
    auto owner = [](const std::string& name) { return name.substr(0, name.rfind('.') + 1); };
    std::set<std::string> changed_owners;
    for (size_t i = 0; i < named_buffers.size(); ++i) {
      if (!buffer_in_step[i] && named_buffers[i].tensor._version() != buffer_versions[i]) {
        changed_owners.insert(owner(named_buffers[i].name));
      }
    }
    for (const auto& buffer : named_buffers) {
      state.push_back({buffer, /*buffer=*/true, changed_owners.count(owner(buffer.name)) > 0});
    }
  }
  std::string hint;
  if (std::exchange(adopted_unchecked, false)) {
    hint = " The world re-formed since the last check (a rank failed, or one rejoined with "
           "the live state of a survivor): if one rejoined, what that transfer does not carry "
           "is the likely cause. It carries the model, the optimizer (its state and each "
           "group's options) and the states registered with FaultTolerance::register_state; "
           "anything else the program keeps and steps by (a scheduler's counter, its own "
           "variables) must be registered.";
  }
  check_replicas_agree(world, state, hint);
}

void Reducer::State::broadcast_buffers() {
  std::vector<at::Tensor> apart;
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (!buffer_in_step[i]) {
      apart.push_back(buffers[i]);
    }
  }
  if (apart.empty()) {
    return;
  }
  // Named after their rank only inside a join guard, where it may not be 0.
  broadcast_from(world, buffer_root, apart,
                 str(buffer_root == 0 ? std::string("the") : str("rank ", buffer_root, "'s"),
                     " buffers before forward ", forwards + 1));
  for (size_t i = 0; i < buffers.size(); ++i) {
    buffer_versions[i] = buffers[i]._version();
  }
  stats.last.buffer_broadcasts += 1;
  stats.total.buffer_broadcasts += 1;
}

bool Reducer::State::buffers_changed_anywhere() {
  // A few bytes agreed by every rank, so that every rank decides alike; the
  // buffers themselves travel only when one changed, wherever that was
  // (a forward's running statistics, or an edit between forwards).
  auto changed = at::full({1}, buffers_changed_locally() ? 1 : 0, at::kInt);
  world.all_reduce_async(changed, ReduceOp::Sum,
                         str("agreement on changed buffers before forward ", forwards + 1))
      .wait();
  stats.last.buffer_agreements += 1;
  stats.total.buffer_agreements += 1;
  return changed.item<int>() > 0;
}

bool Reducer::State::buffers_changed_locally() const {
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (!buffer_in_step[i] && buffers[i]._version() != buffer_versions[i]) {
      return true;
    }
  }
  return false;
}

} // namespace lockstep::detail
