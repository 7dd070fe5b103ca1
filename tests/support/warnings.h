#pragma once

// Collects the warnings that LibTorch's TORCH_WARN (and lockstep's) would
// print, while it is installed:
//   CountingWarnings warnings;
//   WarningHandlerGuard guard(&warnings);
// (LibTorch 2.x hands the handler a c10::Warning and moved the guard into
// c10::WarningUtils; 1.13 has both in c10::Warning.)

#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/version.h>

namespace lockstep::testing {

struct CountingWarnings : c10::WarningHandler {
#if TORCH_VERSION_MAJOR >= 2
  void process(const c10::Warning& warning) override {
    messages.push_back(warning.msg());
  }
#else
  void process(const c10::SourceLocation&, const std::string& message, bool) override {
    messages.push_back(message);
  }
#endif
  std::vector<std::string> messages;
};

#if TORCH_VERSION_MAJOR >= 2
using WarningHandlerGuard = c10::WarningUtils::WarningHandlerGuard;
#else
using WarningHandlerGuard = c10::Warning::WarningHandlerGuard;
#endif

} // namespace lockstep::testing
