#pragma once

// The messages shown in docs/troubleshooting.md are the tests' expectations:
// each sits in a ```text block after a `<!-- tested: NAME -->` line, and a
// test compares a real error with it, so the page cannot drift from the
// code. In a documented message, "…" stands for text that varies between
// runs (the backend's own words, for instance).

#include <functional>
#include <string>

#include <gtest/gtest.h>

#include "support/expect_error.h"

namespace lockstep::testing {

/// The documented message called `name`; fails the test when missing.
std::string documented_message(const std::string& name);

/// Whether `message` reads as `pattern`, where each "…" matches any text.
bool matches_documented(const std::string& message, const std::string& pattern);

/// Runs `action`, expects it to throw `ErrorType` and its text to read as
/// the documented message `name`.
template <typename ErrorType>
void expect_documented_error(const std::function<void()>& action, const std::string& name) {
  std::string message = expect_error<ErrorType>(action, {});
  std::string documented = documented_message(name);
  EXPECT_TRUE(matches_documented(message, documented))
      << "docs/troubleshooting.md, message '" << name << "', reads:\n"
      << documented << "\nbut the error reads:\n" << message;
}

} // namespace lockstep::testing
