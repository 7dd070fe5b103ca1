#pragma once

// splitmix64: a stream of 64-bit numbers from a seed, the same on every
// platform and LibTorch (StepSampler's orders, a joining rank's seed).

#include <cstdint>

namespace lockstep::detail {

/// Advances `state` and returns its next number.
inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

} // namespace lockstep::detail
