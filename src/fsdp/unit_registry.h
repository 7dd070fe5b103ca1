#pragma once

// The wrapper's side of the unit registry (the holder's is in fsdp.h).

#include <memory>

#include <lockstep/fsdp.h>

namespace lockstep::detail {

/// Points the declared unit `module` at `hooks`; false when another live
/// wrapper already shards it.
bool attach_unit_hooks(const torch::nn::Module& module, const std::shared_ptr<UnitHooks>& hooks);
void detach_unit_hooks(const torch::nn::Module& module);

} // namespace lockstep::detail
