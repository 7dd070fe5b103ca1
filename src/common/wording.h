#pragma once

// How messages write the things they name, the same in every part.

#include <chrono>
#include <string>
#include <vector>

namespace lockstep::detail {

/// Ranks as "0, 2, 5–9", or "none", for messages.
std::string rank_list(const std::vector<int>& ranks);

/// A limit as "2.5 s", for messages.
std::string seconds(std::chrono::milliseconds duration);

} // namespace lockstep::detail
