// convert_sync_batchnorm: PyTorch rebinds an attribute of the parent; in
// C++ a parent's field cannot be re-pointed from outside, so only the
// containers whose entries can be replaced (Sequential, ModuleList,
// ModuleDict) are converted, and any other place is refused before anything
// changes.

#include <lockstep/sync_batch_norm.h>

#include <string>
#include <vector>

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <lockstep/error.h>

namespace lockstep {
namespace {

struct Place {
  torch::nn::Module* parent = nullptr;
  std::string key; // the child's name in its parent
  size_t position = 0; // among its parent's children
  std::string path; // from the root, for messages
  std::shared_ptr<torch::nn::Module> batch_norm;
};

bool replaceable(const torch::nn::Module& parent) {
  return dynamic_cast<const torch::nn::SequentialImpl*>(&parent) != nullptr ||
      dynamic_cast<const torch::nn::ModuleListImpl*>(&parent) != nullptr ||
      dynamic_cast<const torch::nn::ModuleDictImpl*>(&parent) != nullptr;
}

void find_batch_norms(torch::nn::Module& module, const std::string& prefix,
                      std::vector<Place>& found) {
  size_t position = 0;
  for (const auto& child : module.named_children()) {
    if (is_batch_norm(*child.value())) {
      found.push_back({&module, child.key(), position, prefix + child.key(), child.value()});
    } else {
      find_batch_norms(*child.value(), prefix + child.key() + ".", found);
    }
    ++position;
  }
}

void replace(const Place& place, const std::shared_ptr<SyncBatchNormImpl>& sync) {
  auto& parent = *place.parent;
  auto offset = static_cast<std::ptrdiff_t>(place.position);
  if (auto* sequential = dynamic_cast<torch::nn::SequentialImpl*>(&parent)) {
    // Sequential's forward runs its own list, registered in the same order
    // as its children.
    *(sequential->begin() + offset) = torch::nn::AnyModule(sync);
    parent.replace_module(place.key, sync);
  } else if (auto* list = dynamic_cast<torch::nn::ModuleListImpl*>(&parent)) {
    *(list->begin() + offset) = sync;
    parent.replace_module(place.key, sync);
  } else if (auto* dict = dynamic_cast<torch::nn::ModuleDictImpl*>(&parent)) {
    dict->update({{place.key, sync}}); // replaces both the entry and the child
  }
}

} // namespace

int convert_sync_batchnorm(torch::nn::Module& module, const World& world) {
  LOCKSTEP_ENFORCE(!is_batch_norm(module), UsageError, "convert_sync_batchnorm replaces the "
                   "BatchNorms inside a module; for a BatchNorm alone, construct "
                   "lockstep::SyncBatchNorm(batch_norm, world) in its place.");
  std::vector<Place> found;
  find_batch_norms(module, "", found);
  std::string fields;
  for (const auto& place : found) {
    if (!replaceable(*place.parent)) {
      fields += (fields.empty() ? "'" : ", '") + place.path + "'";
    }
  }
  LOCKSTEP_ENFORCE(
      fields.empty(), UsageError, "convert_sync_batchnorm cannot replace the BatchNorm at ",
      fields, ": a field of its parent module points to it, and would keep running it. Hold "
      "it in a torch::nn::Sequential, ModuleList or ModuleDict, or declare it as "
      "lockstep::SyncBatchNorm(options, world) in the model. Nothing was replaced.");
  for (const auto& place : found) {
    replace(place, std::make_shared<SyncBatchNormImpl>(*place.batch_norm, world));
  }
  return static_cast<int>(found.size());
}

} // namespace lockstep
