// tests/test_errors.h — the check every suite uses for a bad input's dp::Error.
//
//   CHECK(dp_test::throws_with([&] { (void)dp::matmul(a, b); }, {"same k", "[2, 3]"}));
#pragma once

#include <doctest/doctest.h>

#include <initializer_list>
#include <string>

#include "dp/core/error.h"

namespace dp_test {

/// True when `fn` throws dp::Error whose message contains every one of `parts`; a
/// missing part is printed with the whole message.
template <typename Fn>
bool throws_with(Fn&& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
  } catch (const dp::Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) {
      if (msg.find(p) == std::string::npos) {
        MESSAGE("message lacks '", p, "': ", msg);
        return false;
      }
    }
    return true;
  }
  return false;
}

}  // namespace dp_test
