#pragma once

// Forming the world: connecting to the store and waiting until every rank
// has joined, with errors that name the address, the port and the missing
// ranks instead of a bare timeout.

#include <chrono>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>

#include "world/resolve.h"

namespace c10d {
class Store;
} // namespace c10d

namespace lockstep::detail {

/// The job-scoped store: a TCPStore hosted by rank 0 (or by torchrun's
/// agent), or an in-memory store for a world of size 1, which opens no socket.
c10::intrusive_ptr<c10d::Store> connect_store(const WorldConfig& config);

/// Announces this rank and blocks until every rank has announced itself with
/// the same world size. Raises RendezvousError naming the missing ranks when
/// the timeout passes first.
void join(const c10::intrusive_ptr<c10d::Store>& store,
          const WorldConfig& config);

/// The address of this machine on the route towards `host`: what peers can
/// reach us at when `host` is the master. Loopback when `host` is.
std::string local_address_towards(const std::string& host);

/// Ranks as "0, 2, 3", or "none", for messages.
std::string rank_list(const std::vector<int>& ranks);

/// A limit as "2.5 s", for messages.
std::string seconds(std::chrono::milliseconds duration);

/// "address:port" of the master, for messages.
std::string master_endpoint(const WorldConfig& config);

} // namespace lockstep::detail
