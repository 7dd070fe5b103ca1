#pragma once

// Forming the world: waiting in the job's store until every rank has
// joined, with errors that name the address, the port and the missing ranks
// instead of a bare timeout.

#include <chrono>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>

#include "common/wording.h"
#include "world/process_identity.h"
#include "world/resolve.h"

namespace c10d {
class Store;
} // namespace c10d

namespace lockstep::detail {

/// Announces this rank and blocks until every rank has announced itself with
/// the same world size; returns every rank's identity. With a job secret and
/// a `nonce` (JobStore::nonce), every rank also proves that it holds the
/// secret, and checks the others' proofs. Raises RendezvousError naming the
/// missing ranks when the timeout passes first.
std::vector<ProcessIdentity> join(const c10::intrusive_ptr<c10d::Store>& store,
                                  const WorldConfig& config,
                                  const std::string& nonce);

/// The address of this machine on the route towards `host`: what peers can
/// reach us at when `host` is the master. Loopback when `host` is.
std::string local_address_towards(const std::string& host);

/// "address:port" of the master, for messages.
std::string master_endpoint(const WorldConfig& config);

} // namespace lockstep::detail
