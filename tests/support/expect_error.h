#pragma once

// Asserts the type and the user-facing text of an error: a test of bad input
// checks what the user reads, not only that something was thrown.

#include <functional>
#include <vector>
#include <string>

#include <gtest/gtest.h>

namespace lockstep::testing {

/// Runs `action`, expects it to throw `ErrorType`, and checks that the
/// message contains every fragment. Returns the message.
template <typename ErrorType>
std::string expect_error(
    const std::function<void()>& action,
    const std::vector<std::string>& fragments) {
  try {
    action();
  } catch (const ErrorType& e) {
    std::string message = e.what();
    for (const auto& fragment : fragments) {
      EXPECT_NE(message.find(fragment), std::string::npos)
          << "the message lacks '" << fragment << "':\n" << message;
    }
    return message;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw another error type: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected an error, nothing was thrown";
  return "";
}

} // namespace lockstep::testing
