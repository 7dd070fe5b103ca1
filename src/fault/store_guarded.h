#pragma once

// How fault tolerance meets a store that does not answer within its
// timeout (its host cut off, or gone): this rank can no longer agree on
// anything, so it ends with FaultToleranceError, and lockstep-run
// --restart rank restarts it to rejoin once the store answers. One
// wording for every store operation of the loop (membership.cpp,
// agreement.cpp).

#include <exception>

#include <lockstep/error.h>

namespace lockstep::detail {

/// `operation()`, its failure other than lockstep's own raised as having
/// lost the job's store while this rank did `what` ("announced itself",
/// "asked to join").
template <typename Operation>
auto store_guarded(const char* what, Operation operation) {
  try {
    return operation();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    LOCKSTEP_FAIL(FaultToleranceError, "this rank lost the job's store while it ", what,
                  ", so it can no longer agree with the others on who trains; it ends, and "
                  "lockstep-run --restart rank restarts it to rejoin once the store answers.\n"
                  "  cause: ", e.what());
  }
}

} // namespace lockstep::detail
