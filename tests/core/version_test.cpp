// Tests for dp/version.h: the headers' macros and the library's dp::version() name the
// same release, and the string is MAJOR.MINOR.PATCH made of the three numbers.
#include <doctest/doctest.h>

#include <cstring>
#include <string>

#include "dp/dp.h"  // and nothing else of dp's: the umbrella header brings dp/version.h in

static_assert(DP_VERSION == DP_VERSION_MAJOR * 10000 + DP_VERSION_MINOR * 100 + DP_VERSION_PATCH);
static_assert(DP_VERSION_MINOR < 100 && DP_VERSION_PATCH < 100, "DP_VERSION packs them in two digits");

TEST_CASE("the library's version is the headers' version") {
  CHECK(dp::version_major() == DP_VERSION_MAJOR);
  CHECK(dp::version_minor() == DP_VERSION_MINOR);
  CHECK(dp::version_patch() == DP_VERSION_PATCH);
  CHECK(std::string(dp::version()) == DP_VERSION_STRING);
}

TEST_CASE("the version string is MAJOR.MINOR.PATCH of its parts, in plain decimal") {
  const std::string v = dp::version();
  CAPTURE(v);
  CHECK(v == std::to_string(dp::version_major()) + "." + std::to_string(dp::version_minor()) + "." +
                 std::to_string(dp::version_patch()));
  // to_string writes no leading zero; digits and two dots only leave no room for a
  // suffix ("0.2.0-rc1" fails here).
  CHECK(v.find_first_not_of("0123456789.") == std::string::npos);
  int dots = 0;
  for (char c : v) dots += c == '.';
  CHECK(dots == 2);
  CHECK(dp::version_major() >= 0);
  CHECK(dp::version_minor() >= 0);
  CHECK(dp::version_patch() >= 0);
  // A release after the first: the project started at 0.1.0.
  CHECK(DP_VERSION > 100);
}
