// What the engine's GoogleTest files share: the message an engine call fails with, and a
// scratch path named after the running test.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <string>

#include <c10/util/Exception.h>

namespace partrain::testing_util {

/// The message of the exception `fn` throws (without C++ backtraces), or "" when it throws none.
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

/// A path in the test's temporary folder named after the running test, ending in `suffix`.
inline std::string temp_path(const char* suffix) {
  return std::string(::testing::TempDir()) + "partrain_" +
         ::testing::UnitTest::GetInstance()->current_test_info()->name() + suffix;
}

}  // namespace partrain::testing_util
