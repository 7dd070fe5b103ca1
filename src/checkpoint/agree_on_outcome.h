#pragma once

// How the ranks of a collective save or load fail: together.

#include <string>

#include <lockstep/world.h>

namespace lockstep::detail {

/// Collective: every rank learns whether every rank succeeded (`my_error`
/// empty); if any failed, every rank raises CheckpointError, "`what` failed
/// on K rank(s)", with each failed rank's error.
void agree_on_outcome(World& world, const std::string& my_error, const std::string& what);

} // namespace lockstep::detail
