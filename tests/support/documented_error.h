#pragma once

// The messages shown in docs/troubleshooting.md are the tests' expectations:
// each sits in a ```text block after a `<!-- tested: NAME -->` line, and a
// test compares a real error with it, so the page cannot drift from the
// code. In a documented message, "…" stands for text that varies between
// runs (the backend's own words, for instance).

#include <string>

namespace lockstep::testing {

/// The documented message called `name`; fails the test when missing.
std::string documented_message(const std::string& name);

/// Whether `message` reads as `pattern`, where each "…" matches any text.
bool matches_documented(const std::string& message, const std::string& pattern);

} // namespace lockstep::testing

#include <functional>

#include <gtest/gtest.h>

namespace lockstep::testing {

/// Runs `action`, expects it to throw `ErrorType` and its text to read as
/// the documented message `name`.
template <typename ErrorType>
void expect_documented_error(const std::function<void()>& action, const std::string& name) {
  try {
    action();
  } catch (const ErrorType& e) {
    std::string documented = documented_message(name);
    EXPECT_TRUE(matches_documented(e.what(), documented))
        << "docs/troubleshooting.md, message '" << name << "', reads:\n"
        << documented << "\nbut the error reads:\n" << e.what();
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw another error type: " << e.what();
    return;
  }
  ADD_FAILURE() << "expected the error '" << name << "', nothing was thrown";
}

} // namespace lockstep::testing
