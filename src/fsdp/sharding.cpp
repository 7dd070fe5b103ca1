// How a model becomes FullyShardedDataParallel's units: each parameter to
// the innermost Sharded holder around it (the rest to the root unit), the
// dtype each unit computes in, and the hooks each holder calls. Every unit
// is checked before any is sharded, so that a refusal leaves the module as
// it was.

#include <lockstep/fsdp.h>

#include <optional>
#include <unordered_map>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <lockstep/error.h>
#include <lockstep/sync_batch_norm.h>

#include "fsdp/constructed_shard.h"
#include "fsdp/sharded_model_state.h"
#include "fsdp/unit_registry.h"

namespace lockstep::detail {

namespace {

bool within(const std::string& module_name, const std::string& unit_name) {
  return unit_name.empty() || module_name == unit_name ||
      module_name.rfind(unit_name + ".", 0) == 0;
}

std::string joined(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

// A BatchNorm of torch::nn's (lockstep::is_batch_norm) or a SyncBatchNorm.
bool is_any_batch_norm(const torch::nn::Module& module) {
  return lockstep::is_batch_norm(module) ||
      dynamic_cast<const SyncBatchNormImpl*>(&module) != nullptr;
}

// What each unit computes in under FsdpOptions::param_dtype: that dtype,
// except a unit of BatchNorm parameters alone, which keeps its own (its
// statistics stay in theirs, and ATen's BatchNorm takes a 16-bit input with
// full-precision weights, not 16-bit weights with full-precision statistics).
std::vector<std::optional<at::ScalarType>> compute_dtypes(
    const torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>& modules,
    const std::vector<std::string>& names,
    const std::vector<std::vector<std::pair<std::string, at::Tensor>>>& members,
    std::optional<at::ScalarType> param_dtype) {
  std::vector<std::optional<at::ScalarType>> compute(names.size(), param_dtype);
  if (!param_dtype) {
    return compute;
  }
  std::unordered_map<const c10::TensorImpl*, std::string> norm_of;
  for (const auto& item : modules) {
    if (is_any_batch_norm(*item.value())) {
      for (const auto& param : item.value()->parameters(/*recurse=*/false)) {
        norm_of.emplace(param.unsafeGetTensorImpl(), item.key());
      }
    }
  }
  for (size_t u = 0; u < names.size(); ++u) {
    size_t norms = 0;
    const std::string* norm = nullptr;
    for (const auto& [name, param] : members[u]) {
      auto found = norm_of.find(param.unsafeGetTensorImpl());
      if (found != norm_of.end()) {
        ++norms;
        norm = &found->second;
      }
    }
    LOCKSTEP_ENFORCE(norms == 0 || norms == members[u].size(), ConfigError,
                     "FsdpOptions::param_dtype computes ", FlatUnit::describe(names[u]), " in ",
                     *param_dtype, ", and it holds the BatchNorm '", norm == nullptr ? "" : *norm,
                     "', which keeps full precision (its statistics stay in theirs). Declare "
                     "each BatchNorm a unit of its own (lockstep::Sharded<torch::nn::"
                     "BatchNorm2d>), which is gathered in its own dtype.");
    if (norms > 0) {
      compute[u] = std::nullopt;
    }
  }
  return compute;
}

} // namespace

void ShardedModel::State::shard(torch::nn::Module& module) {
  auto wire = options.reduce_dtype();
  LOCKSTEP_ENFORCE(!wire || at::isFloatingType(*wire), ConfigError,
                   "FsdpOptions::reduce_dtype takes a floating dtype (Half, BFloat16, Float, "
                   "Double), not ", *wire, ".");
  auto modules = module.named_modules("", /*include_self=*/true);
  std::vector<std::string> names{""};
  std::vector<std::shared_ptr<torch::nn::Module>> declared{nullptr};
  for (const auto& item : modules) {
    if (!item.key().empty() && is_declared_unit(*item.value())) {
      names.push_back(item.key());
      declared.push_back(item.value());
    }
  }
  // Each parameter to the innermost unit that holds it; a parameter that
  // two units hold (tied weights) would be gathered by the one and
  // reduced by the other.
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> members(names.size());
  std::unordered_map<const c10::TensorImpl*, std::pair<size_t, std::string>> owner_of;
  for (const auto& item : modules) {
    size_t owner = 0;
    for (size_t u = 1; u < names.size(); ++u) {
      if (within(item.key(), names[u]) && names[u].size() >= names[owner].size()) {
        owner = u;
      }
    }
    for (const auto& param : item.value()->named_parameters(/*recurse=*/false)) {
      auto name = joined(item.key(), param.key());
      auto [found, fresh] = owner_of.emplace(param.value().unsafeGetTensorImpl(),
                                             std::make_pair(owner, name));
      if (!fresh) {
        LOCKSTEP_ENFORCE(found->second.first == owner, ConfigError,
                         "FullyShardedDataParallel: ", found->second.second, " and ", name,
                         " are one parameter (tied weights) in two units, ",
                         names[found->second.first].empty() ? "the root"
                                                            : names[found->second.first],
                         " and ", names[owner].empty() ? "the root" : names[owner],
                         ". Tied weights must live in one unit: declare a unit that "
                         "holds both modules, or leave both to the root.");
        continue;
      }
      members[owner].emplace_back(name, param.value());
    }
  }
  refuse_units_in_sequentials(modules);
  // Every unit is checked and claimed before any is sharded: a refusal
  // leaves the module as it was.
  auto compute = compute_dtypes(modules, names, members, options.param_dtype());
  std::optional<std::pair<std::string, at::Device>> device;
  for (size_t u = 0; u < names.size(); ++u) {
    if (members[u].empty()) {
      continue;
    }
    FlatUnit::check(names[u], members[u]);
    const auto& [name, first] = members[u].front();
    if (!device) {
      device.emplace(name, first.device());
    }
    // CPU and CUDA units would run their backward on two threads at once.
    LOCKSTEP_ENFORCE(first.device() == device->second, ConfigError,
                     "FullyShardedDataParallel: the units live on one device, and ",
                     device->first, " is on ", device->second, " while ", name, " is on ",
                     first.device(), ".");
  }
  // Collective: what the ranks kept of units built under a
  // ShardedConstruction, checked alike on every rank.
  auto built = constructed_shards(world, shard_world, names, declared, members);
  size_t index = members[0].empty() ? 0 : 1;
  for (size_t u = 1; u < names.size(); ++u) {
    if (members[u].empty()) {
      continue; // nothing to gather: the block runs as it is
    }
    auto unit_hooks = make_unit_hooks(weak_from_this(), index++);
    LOCKSTEP_ENFORCE(attach_unit_hooks(*declared[u], unit_hooks), ConfigError,
                     "FullyShardedDataParallel: unit ", names[u],
                     " is already sharded by another FullyShardedDataParallel that "
                     "is still alive.");
    hooks.push_back(unit_hooks);
    unit_modules.push_back(declared[u]);
  }
  for (size_t u = 0; u < names.size(); ++u) {
    if (members[u].empty()) {
      continue;
    }
    // Before the parameters are freed: autograd checks each gradient
    // against the shape that its accumulator saw when it was made.
    accumulators.emplace_back();
    for (size_t k = 0; k < members[u].size(); ++k) {
      const auto& param = members[u][k].second;
      accumulators.back().push_back(
          param.requires_grad() ? hook_accumulator(param, units.size(), k) : nullptr);
    }
    unit_names.push_back(names[u]);
    units.push_back(built[u] ? std::make_unique<FlatUnit>(names[u], std::move(members[u]),
                                                          *built[u], compute[u])
                             : std::make_unique<FlatUnit>(names[u], std::move(members[u]),
                                                          shard_world, world, compute[u]));
  }
  // Backward reduces the last registered unit first until the forward
  // order is known (agree_on_order); the root last, at the end of backward.
  for (size_t u = units.size(); u-- > 0;) {
    reduce_order.push_back(u);
  }
  for (const auto& buffer : module.named_buffers()) {
    auto tensor = buffer.value();
    world.broadcast(tensor, 0, str(buffer.key(), " from rank 0"));
  }
  for (const auto& item : modules) {
    auto* norm = dynamic_cast<SyncBatchNormImpl*>(item.value().get());
    if (norm != nullptr && !norm->world) {
      norm->world = world;
      bound_norms.push_back(item.value());
    }
  }
  reset_step();
}

} // namespace lockstep::detail
