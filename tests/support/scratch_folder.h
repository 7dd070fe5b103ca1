#pragma once

// A fresh folder under /tmp for one test, removed with everything in it
// when the test ends.

#include <cstdlib>
#include <string>

#include "support/multiprocess.h"

namespace lockstep::testing {

class ScratchFolder {
 public:
  /// Creates /tmp/lockstep-<name>-XXXXXX. In a rank started by launch_ranks,
  /// which re-runs the test up to the launch, it creates nothing and path()
  /// is empty: the ranks get the parent's folder through the environment.
  explicit ScratchFolder(const std::string& name) {
    if (in_rank_process()) {
      return;
    }
    std::string pattern = "/tmp/lockstep-" + name + "-XXXXXX";
    if (::mkdtemp(pattern.data()) != nullptr) {
      path_ = pattern;
    }
  }
  ~ScratchFolder() {
    if (!path_.empty()) {
      std::system(("rm -rf '" + path_ + "'").c_str());
    }
  }
  ScratchFolder(const ScratchFolder&) = delete;
  ScratchFolder& operator=(const ScratchFolder&) = delete;

  const std::string& path() const {
    return path_;
  }
  std::string operator/(const std::string& name) const {
    return path_ + "/" + name;
  }

 private:
  std::string path_;
};

} // namespace lockstep::testing
