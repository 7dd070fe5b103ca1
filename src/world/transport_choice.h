#pragma once

// Which transport carries a world's collectives of CPU tensors, chosen at
// init() on every rank alike: shared memory where the ranks share a host,
// Gloo elsewhere (WorldOptions::transport, LOCKSTEP_TRANSPORT).

#include <memory>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>

#include "compat/c10d.h"
#include "transport/transport.h"
#include "world/process_identity.h"
#include "world/resolve.h"

namespace lockstep::detail {

/// Collective. `gloo` is the world's Gloo group, the fallback and the
/// transport across hosts; `group_options` are its options, from which the
/// groups of each local index across hosts are made. Raises ConfigError when the configuration asks
/// for shared memory that cannot be had; with `auto`, falls back to Gloo
/// and prints (on rank 0) one line that says why and how to fix it.
std::shared_ptr<Transport> choose_transport(const WorldConfig& config,
                                            const c10::intrusive_ptr<c10d::Store>& store,
                                            const std::vector<ProcessIdentity>& peers,
                                            const c10::intrusive_ptr<CollectiveBackend>& gloo,
                                            const GroupOptions& group_options);

} // namespace lockstep::detail
