#pragma once

// A member record of fault tolerance's protocol (fault/membership.h), as
// the tests of the protocol over a real store write them.

#include <cstdint>

#include "fault/membership.h"

namespace lockstep::testing {

/// Launcher rank `replica`, holding `step` committed steps of the state it
/// last trained in epoch `trained` (-1: none).
inline detail::Member member(int replica, int64_t step, int64_t trained) {
  detail::Member m;
  m.replica = replica;
  m.step = step;
  m.trained = trained;
  return m;
}

} // namespace lockstep::testing
