#pragma once

// Collects the warnings that LibTorch's TORCH_WARN (and lockstep's) would
// print, while a guard installs it:
//   CountingWarnings warnings;
//   c10::Warning::WarningHandlerGuard guard(&warnings);

#include <string>
#include <vector>

#include <c10/util/Exception.h>

namespace lockstep::testing {

struct CountingWarnings : c10::WarningHandler {
  void process(const c10::SourceLocation&, const std::string& message, bool) override {
    messages.push_back(message);
  }
  std::vector<std::string> messages;
};

} // namespace lockstep::testing
