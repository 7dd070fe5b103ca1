#pragma once

// What the ranks (src/world, src/fault) and lockstep-run (which hosts the
// store and signs the loop's end) must name alike in the job's store: one
// definition each, since a difference would only show as a proof that
// never verifies.

#include <string>

namespace lockstep::detail {

/// Unscoped, so that another job's ranks find it: which job owns the store,
/// its nonce and the proof of its secret.
constexpr const char* kJobRecordKey = "lockstep/job";

/// The prefix of every key of one attempt of a job (a restart is a new
/// attempt, so the previous one's keys are never mistaken for its own).
inline std::string job_key_prefix(const std::string& job, const std::string& attempt) {
  return "lockstep/" + job + "/" + attempt;
}

/// What a proof of fault tolerance's covers: the job, the claim, and the
/// nonce of the job's record.
inline std::string fault_tolerance_claim(const std::string& job, const std::string& claim,
                                         const std::string& nonce) {
  return "ft|" + job + "|" + claim + "|" + nonce;
}

} // namespace lockstep::detail
