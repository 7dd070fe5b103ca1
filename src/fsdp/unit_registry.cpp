// Which modules are units, and which wrapper shards each: a Sharded holder
// finds its hooks here by the module it holds, so that the same model runs
// unchanged inside a wrapper and outside one.

#include <mutex>
#include <unordered_map>

#include <lockstep/fsdp.h>

#include "fsdp/constructed_shard.h"
#include "fsdp/unit_registry.h"

namespace lockstep::detail {
namespace {

struct Entry {
  // Checked on lookup: another module may come to live at a dead one's
  // address.
  std::weak_ptr<torch::nn::Module> module;
  std::weak_ptr<UnitHooks> hooks;
  std::shared_ptr<ConstructedShard> constructed;
};

std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::unordered_map<const torch::nn::Module*, Entry>& registry() {
  static std::unordered_map<const torch::nn::Module*, Entry> entries;
  return entries;
}

// Under the lock: the entry of a live `module`, or null.
Entry* live_entry(const torch::nn::Module& module) {
  auto found = registry().find(&module);
  if (found == registry().end()) {
    return nullptr;
  }
  auto alive = found->second.module.lock();
  if (alive.get() != &module) {
    registry().erase(found);
    return nullptr;
  }
  return &found->second;
}

void forget_dead_modules() {
  for (auto it = registry().begin(); it != registry().end();) {
    it = it->second.module.expired() ? registry().erase(it) : std::next(it);
  }
}

} // namespace

void declare_unit(const std::shared_ptr<torch::nn::Module>& module) {
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    if (live_entry(*module) == nullptr) {
      // Keeps the table as small as the live units, however many models a
      // program builds and drops.
      forget_dead_modules();
      registry()[module.get()] = Entry{module, {}, nullptr};
    }
  }
  // Under a ShardedConstruction, once (the holder that register_module's
  // result makes declares the unit again).
  shard_at_construction(module);
}

bool is_declared_unit(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  return live_entry(module) != nullptr;
}

std::shared_ptr<UnitHooks> hooks_of_unit(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto* entry = live_entry(module);
  return entry == nullptr ? nullptr : entry->hooks.lock();
}

bool attach_unit_hooks(const torch::nn::Module& module, const std::shared_ptr<UnitHooks>& hooks) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto* entry = live_entry(module);
  TORCH_INTERNAL_ASSERT(entry != nullptr, "a unit that was never declared");
  if (!entry->hooks.expired()) {
    return false;
  }
  entry->hooks = hooks;
  return true;
}

void detach_unit_hooks(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  if (auto* entry = live_entry(module)) {
    entry->hooks.reset();
  }
}

void keep_constructed_shard(const torch::nn::Module& module,
                            std::shared_ptr<ConstructedShard> shard) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto* entry = live_entry(module);
  TORCH_INTERNAL_ASSERT(entry != nullptr, "a unit that was never declared");
  entry->constructed = std::move(shard);
}

std::shared_ptr<ConstructedShard> constructed_shard_of(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto* entry = live_entry(module);
  return entry == nullptr ? nullptr : entry->constructed;
}

} // namespace lockstep::detail
