#pragma once

// For the tests that run whole jobs (the MNIST examples, the fault-tolerant
// programs): where the MNIST data is, and what their output says.

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include "support/paths.h"

namespace lockstep::testing {

/// The MNIST IDX files: $LOCKSTEP_DATA_DIR/mnist, else the checkout's.
inline std::string mnist_dir() {
  const char* root = std::getenv("LOCKSTEP_DATA_DIR");
  return (root ? std::string(root) : std::string(lockstep::testing::source_dir()) + "/data") + "/mnist";
}

/// How many times `part` occurs in `text` (overlapping ones too).
inline int occurrences(const std::string& text, const std::string& part) {
  int found = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) {
    ++found;
  }
  return found;
}

/// The lines a fault-tolerant test program wrote to its log of committed
/// steps so far (one per step: how far a rank is while the job runs).
inline int committed_lines(const std::string& path) {
  std::ifstream log(path);
  std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  return occurrences(text, "\n");
}

} // namespace lockstep::testing
