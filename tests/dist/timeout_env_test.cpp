// DP_DIST_TIMEOUT (Note [DP_DIST_TIMEOUT] in src/dist/dist.cpp): the forms accepted,
// and a bad value as an error at the first use of dp::dist. Meson runs this binary
// with DP_DIST_TIMEOUT=10s, a unit the variable does not take.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdlib>
#include <string>

#include "dist/process_group.h"
#include "dp/core/error.h"
#include "dp/dist/dist.h"

using std::chrono::milliseconds;
using dp::dist::detail::parse_timeout_seconds;

TEST_CASE("DP_DIST_TIMEOUT takes seconds as digits with an optional fraction; 0 waits forever") {
  CHECK(parse_timeout_seconds("600") == milliseconds(600'000));
  CHECK(parse_timeout_seconds("0.5") == milliseconds(500));
  CHECK(parse_timeout_seconds("1.25") == milliseconds(1250));
  CHECK(parse_timeout_seconds("0.001") == milliseconds(1));
  CHECK(parse_timeout_seconds("007") == milliseconds(7000));
  CHECK(parse_timeout_seconds("1000000000") == milliseconds(1'000'000'000'000));
  CHECK(parse_timeout_seconds("0") == milliseconds(0));
  CHECK(parse_timeout_seconds("0.0") == milliseconds(0));
}

TEST_CASE("any other DP_DIST_TIMEOUT is a dp::Error naming the value") {
  for (const char* bad : {"", "abc", "-5", "+5", "10s", "10m", "1e3", "1e99", "inf", "nan", "0x10", " 60", "60 ",
                          ".5", "5.", "1.2.3", "0.0004", "1000000001", "99999999999999999999999"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(parse_timeout_seconds(bad), doctest::Contains("DP_DIST_TIMEOUT: expected a number of seconds"),
                         dp::Error);
    const std::string quoted = std::string("got '") + bad + "'";
    CHECK_THROWS_WITH_AS(parse_timeout_seconds(bad), doctest::Contains(quoted.c_str()), dp::Error);
  }
}

TEST_CASE("a bad DP_DIST_TIMEOUT in the environment stops the first use of dp::dist") {
  const char* env = std::getenv("DP_DIST_TIMEOUT");
  REQUIRE(env != nullptr);
  REQUIRE(std::string(env) == "10s");  // set by tests/dist/meson.build
  CHECK_THROWS_WITH_AS(dp::dist::timeout(), doctest::Contains("got '10s'"), dp::Error);
  // Asked again, it is still an error: the bad value is never replaced by a default.
  CHECK_THROWS_WITH_AS(dp::dist::timeout(), doctest::Contains("got '10s'"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::dist::init(), doctest::Contains("DP_DIST_TIMEOUT"), dp::Error);
}
