#pragma once

// The wrapper's side of the unit registry (the holder's is in fsdp.h).

#include <memory>

#include <lockstep/fsdp.h>

namespace lockstep::detail {

struct ConstructedShard;

/// Points the declared unit `module` at `hooks`; false when another live
/// wrapper already shards it.
bool attach_unit_hooks(const torch::nn::Module& module, const std::shared_ptr<UnitHooks>& hooks);
void detach_unit_hooks(const torch::nn::Module& module);
/// What the live declared unit `module` kept when it was built under a
/// ShardedConstruction (fsdp/constructed_shard.h), held until the wrapper
/// takes it (then null) or the module dies.
void keep_constructed_shard(const torch::nn::Module& module,
                            std::shared_ptr<ConstructedShard> shard);
/// The same, or null for a unit built in full.
std::shared_ptr<ConstructedShard> constructed_shard_of(const torch::nn::Module& module);

} // namespace lockstep::detail
