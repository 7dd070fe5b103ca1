#include "reducer/model_state.h"

#include <map>
#include <unordered_set>
#include <sstream>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>

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
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    out += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  }
  return out;
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

void broadcast_from_rank0(World& world, const std::vector<at::Tensor>& tensors) {
  at::NoGradGuard no_grad;
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> groups;
  for (const auto& tensor : tensors) {
    groups[{static_cast<int>(tensor.scalar_type()), tensor.device().str()}]
        .push_back(tensor);
  }
  for (auto& [kind, group] : groups) {
    std::vector<at::Tensor> flat_parts;
    for (const auto& tensor : group) {
      flat_parts.push_back(tensor.detach().reshape({-1}));
    }
    auto flat = at::cat(flat_parts);
    world.broadcast(flat, 0);
    if (world.rank() == 0) {
      continue;
    }
    int64_t offset = 0;
    for (auto& tensor : group) {
      tensor.detach().copy_(
          flat.narrow(0, offset, tensor.numel()).view(tensor.sizes()));
      offset += tensor.numel();
    }
  }
}

} // namespace lockstep::detail
