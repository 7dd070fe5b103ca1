#pragma once

// The private folder of a job on this host: $TMPDIR (or /tmp)/lockstep-<uid>/
// port-<MASTER_PORT>, inside a folder that only this user may enter (0700,
// checked), since it holds the job's store socket and its ledgers.
// Whoever hosts the store (lockstep-run, or rank 0) creates it and records
// itself as its owner; a folder whose owner is gone was left by a crash.

#include <string>

namespace lockstep::store {

/// $TMPDIR/lockstep-<uid>, created 0700; "" and `error` if it cannot be
/// made or is not private.
std::string private_base(std::string& error);

/// The job folder of `port` under `base`.
std::string job_folder(const std::string& base, int port);

/// The store's socket in a job folder.
std::string socket_path(const std::string& folder);

/// Creates `folder` afresh (under another name, renamed into place, so that
/// nobody sees half of it) with `owner` (one line) in its owner file.
/// Returns "" or why not.
std::string create_job_folder(const std::string& folder, const std::string& owner);

/// Whether `name`, an entry of the base, is a job folder ("port-" and
/// digits): a folder still being made (".draft") is not one, so that a
/// job that clears abandoned folders never takes another's for abandoned
/// before its owner is written.
bool is_job_folder_name(const std::string& name);

/// The owner line of a job folder ("" when there is none yet).
std::string folder_owner(const std::string& folder);

void remove_folder(const std::string& folder);

} // namespace lockstep::store
