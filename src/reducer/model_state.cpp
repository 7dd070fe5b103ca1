#include "reducer/model_state.h"

#include <cstring>
#include <algorithm>
#include <map>
#include <tuple>
#include <unordered_set>
#include <sstream>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>

#include "world/rendezvous.h"

namespace lockstep::detail {
namespace {

std::string describe(const char* kind, const NamedTensor& entry) {
  std::ostringstream out;
  out << kind << " '" << entry.name << "': " << entry.tensor.scalar_type()
      << " " << entry.tensor.sizes();
  if (entry.tensor.requires_grad()) {
    out << ", requires_grad";
  }
  return out.str();
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    lines.push_back(line);
  }
  return lines;
}

std::string ranks_text(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + rank_list(ranks);
}

} // namespace

std::vector<std::string> describe_model(
    const std::vector<NamedTensor>& parameters,
    const std::vector<NamedTensor>& buffers) {
  std::vector<std::string> lines;
  for (const auto& entry : parameters) {
    lines.push_back(describe("parameter", entry));
  }
  for (const auto& entry : buffers) {
    lines.push_back(describe("buffer", entry));
  }
  return lines;
}

void named_state(
    torch::nn::Module& module,
    std::vector<NamedTensor>& parameters,
    std::vector<NamedTensor>& buffers) {
  // A parameter shared by two submodules appears twice; it is one tensor.
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : module.named_parameters()) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) {
      parameters.push_back({item.key(), item.value()});
    }
  }
  for (const auto& item : module.named_buffers()) {
    buffers.push_back({item.key(), item.value()});
  }
}

void check_same_model(
    World& world,
    const std::vector<NamedTensor>& parameters,
    const std::vector<NamedTensor>& buffers) {
  std::ostringstream mine;
  for (const auto& line : describe_model(parameters, buffers)) {
    mine << line << "\n";
  }
  auto texts = world.all_gather_strings(mine.str());
  std::vector<std::vector<std::string>> models;
  size_t longest = 0;
  for (const auto& text : texts) {
    models.push_back(split_lines(text));
    longest = std::max(longest, models.back().size());
  }
  for (size_t line = 0; line < longest; ++line) {
    // What each rank has at this position, grouped by value.
    std::map<std::string, std::vector<int>> views;
    for (size_t rank = 0; rank < models.size(); ++rank) {
      const auto& model = models[rank];
      views[line < model.size() ? model[line] : "nothing (fewer entries)"]
          .push_back(static_cast<int>(rank));
    }
    if (views.size() == 1) {
      continue;
    }
    std::ostringstream message;
    message << "the model differs across ranks at entry " << line
            << " of its parameters and buffers:";
    for (const auto& [view, ranks] : views) {
      message << "\n  " << ranks_text(ranks) << ": " << view;
    }
    message << "\n  (rank 0 has " << models[0].size() << " entries";
    for (size_t rank = 1; rank < models.size(); ++rank) {
      message << ", rank " << rank << " has " << models[rank].size();
    }
    message << ")\nEvery rank must build the same model (same layers, sizes, "
               "names and dtypes) before wrapping it in "
               "DistributedDataParallel.";
    LOCKSTEP_FAIL(UsageError, message.str());
  }
}

namespace {

// Two checksums of a tensor's bytes: a plain and a position-weighted sum of
// its 32-bit words (wrapping), so that a changed or moved element shows.
std::pair<int64_t, int64_t> checksum(const at::Tensor& tensor) {
  // A device tensor is read from a host copy: check_replicas is a check,
  // not a step of training.
  auto bytes = tensor.detach().to(at::kCPU).contiguous().view({-1}).view(at::kByte);
  const auto* data = bytes.data_ptr<uint8_t>();
  int64_t size = bytes.numel();
  uint64_t plain = 0;
  uint64_t weighted = 0;
  uint64_t position = 1;
  int64_t i = 0;
  for (; i + 4 <= size; i += 4, ++position) {
    uint32_t word;
    std::memcpy(&word, data + i, 4);
    plain += word;
    weighted += word * position;
  }
  for (; i < size; ++i, ++position) {
    plain += data[i];
    weighted += data[i] * position;
  }
  return {static_cast<int64_t>(plain), static_cast<int64_t>(weighted)};
}

} // namespace

void check_replicas_agree(World& world, const std::vector<ReplicaEntry>& state,
                          const std::string& hint) {
  auto mine = at::empty({static_cast<int64_t>(state.size()), 3}, at::kLong);
  auto* sums = mine.data_ptr<int64_t>();
  for (size_t i = 0; i < state.size(); ++i) {
    std::tie(sums[3 * i], sums[3 * i + 1]) = checksum(state[i].entry.tensor);
    sums[3 * i + 2] = state[i].changed_here ? 1 : 0;
  }
  auto all = world.all_gather(mine);
  for (size_t i = 0; i < state.size(); ++i) {
    auto row = static_cast<int64_t>(i);
    bool changed = false;
    for (int rank = 0; rank < world.size(); ++rank) {
      changed |= all[rank][row][2].item<int64_t>() != 0;
    }
    if (changed) {
      continue; // some rank's forward moved it: the next forward syncs it
    }
    std::vector<int> differing;
    for (int rank = 1; rank < world.size(); ++rank) {
      if (!all[rank][row].equal(all[0][row])) {
        differing.push_back(rank);
      }
    }
    const auto& name = state[i].entry.name;
    LOCKSTEP_ENFORCE(
        differing.empty() || state[i].buffer, UsageError, "the replicas diverged: '", name,
        "' on ", ranks_text(differing), " differs from rank 0's. Something changed it outside "
        "the optimizer step on some ranks (a manual edit, a rank-dependent update, a load "
        "on one rank only).", hint);
    LOCKSTEP_ENFORCE(
        differing.empty(), UsageError, "the replicas diverged: buffer '", name, "' on ",
        ranks_text(differing), " differs from rank 0's, though no rank changed it since the "
        "buffers were last synchronised. Buffers are synchronised from rank 0 before each "
        "forward after which some rank changed one, and this one was changed on some ranks "
        "in a way that does not count as a change (through raw memory, or a load). Call "
        "ddp.sync_buffers() to give every rank rank 0's buffers now, or "
        "ddp.check_replicas(ReplicaCheck::Parameters) to check the parameters alone.", hint);
  }
}

namespace {

// The tensors grouped by dtype and device, in their order of first
// appearance: each group travels as one flat tensor.
std::vector<std::vector<at::Tensor>> groups_of(const std::vector<at::Tensor>& tensors) {
  std::vector<std::pair<std::pair<int, std::string>, std::vector<at::Tensor>>> groups;
  for (const auto& tensor : tensors) {
    std::pair<int, std::string> kind{static_cast<int>(tensor.scalar_type()),
                                     tensor.device().str()};
    auto found = std::find_if(groups.begin(), groups.end(),
                              [&](const auto& group) { return group.first == kind; });
    if (found == groups.end()) {
      groups.push_back({kind, {}});
      found = groups.end() - 1;
    }
    found->second.push_back(tensor);
  }
  std::vector<std::vector<at::Tensor>> result;
  for (auto& group : groups) {
    result.push_back(std::move(group.second));
  }
  return result;
}

} // namespace

std::vector<at::Tensor> broadcast_flat(
    World& world, int root, const std::vector<at::Tensor>& tensors, const std::string& what) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> flats;
  for (const auto& group : groups_of(tensors)) {
    std::vector<at::Tensor> flat_parts;
    for (const auto& tensor : group) {
      flat_parts.push_back(tensor.detach().reshape({-1}));
    }
    auto flat = at::cat(flat_parts);
    std::ostringstream description;
    description << "broadcast of " << what << " (" << flat.scalar_type() << ", "
                << flat.numel() << " elements)";
    world.broadcast(flat, root, description.str());
    flats.push_back(flat);
  }
  return flats;
}

void unflatten_into(const std::vector<at::Tensor>& tensors, const std::vector<at::Tensor>& flats) {
  at::NoGradGuard no_grad;
  auto groups = groups_of(tensors);
  for (size_t g = 0; g < groups.size(); ++g) {
    int64_t offset = 0;
    for (auto& tensor : groups[g]) {
      tensor.detach().copy_(flats[g].narrow(0, offset, tensor.numel()).view(tensor.sizes()));
      offset += tensor.numel();
    }
  }
}

void broadcast_from(
    World& world, int root, const std::vector<at::Tensor>& tensors, const std::string& what) {
  auto flats = broadcast_flat(world, root, tensors, what);
  if (world.rank() != root) {
    unflatten_into(tensors, flats);
  }
}

} // namespace lockstep::detail
