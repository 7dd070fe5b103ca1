#pragma once

// A folder that every rank of a launch names alike: the test makes it (a
// ScratchFolder) and hands its path to the ranks in LOCKSTEP_TEST_FOLDER.

#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "support/multiprocess.h"

namespace lockstep::testing {

/// The launch of `world_size` ranks that all see `folder` as shared_folder().
inline LaunchOptions with_shared_folder(
    int world_size, const std::string& folder,
    std::chrono::milliseconds timeout = std::chrono::seconds(120)) {
  LaunchOptions options;
  options.world_size = world_size;
  options.timeout = timeout;
  options.environment = [folder](int, RankEnvironment& env) {
    env["LOCKSTEP_TEST_FOLDER"] = folder;
  };
  return options;
}

/// In a rank of such a launch: the folder's path.
inline std::string shared_folder() {
  const char* folder = std::getenv("LOCKSTEP_TEST_FOLDER");
  if (folder == nullptr || *folder == '\0') {
    throw std::logic_error("shared_folder() outside a launch of with_shared_folder: "
                           "LOCKSTEP_TEST_FOLDER is not set");
  }
  return folder;
}

} // namespace lockstep::testing
