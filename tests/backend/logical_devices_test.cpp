// The mapping of dp CUDA devices onto physical GPUs (DP_CUDA_DEVICES_PER_GPU): plain
// C++, tested without a GPU.
#include "backend/logical_devices.h"

#include <doctest/doctest.h>

#include <string>

#include "dp/core/error.h"

namespace {

using dp::backend::LogicalDeviceMap;
using dp::backend::parse_devices_per_gpu;

std::string error_of(const char* value) {
  try {
    parse_devices_per_gpu(value);
  } catch (const dp::Error& e) {
    return e.what();
  }
  return {};
}

}  // namespace

TEST_CASE("DP_CUDA_DEVICES_PER_GPU: unset and empty mean one device per GPU") {
  CHECK(parse_devices_per_gpu(nullptr) == 1);
  CHECK(parse_devices_per_gpu("") == 1);
  CHECK(parse_devices_per_gpu("  ") == 1);
}

TEST_CASE("DP_CUDA_DEVICES_PER_GPU: integers from 1 to 16") {
  CHECK(parse_devices_per_gpu("1") == 1);
  CHECK(parse_devices_per_gpu("4") == 4);
  CHECK(parse_devices_per_gpu(" 8 ") == 8);
  CHECK(parse_devices_per_gpu("016") == 16);
}

TEST_CASE("DP_CUDA_DEVICES_PER_GPU: a bad value names the variable, the value and the range") {
  for (const char* bad : {"0", "17", "-2", "4x", "x", "2.5", "99999999999999999999", "+3"}) {
    CAPTURE(bad);
    const std::string msg = error_of(bad);
    REQUIRE(!msg.empty());
    CHECK(msg.find("DP_CUDA_DEVICES_PER_GPU") != std::string::npos);
    CHECK(msg.find(std::string("'") + bad + "'") != std::string::npos);
    CHECK(msg.find("expected an integer from 1 to 16") != std::string::npos);
  }
}

TEST_CASE("LogicalDeviceMap: the devices of one GPU are consecutive") {
  const LogicalDeviceMap m(2, 4);
  CHECK(m.count() == 8);
  CHECK(m.logical());
  for (int d = 0; d < 8; ++d) {
    CAPTURE(d);
    CHECK(m.physical(d) == d / 4);
    CHECK(m.slot(d) == d % 4);
  }
  CHECK(m.shares_gpu({0, 1}));
  CHECK_FALSE(m.shares_gpu({0, 4}));
  CHECK(m.shares_gpu({3, 4, 5}));
  CHECK(m.physical_gpus({5, 1, 6, 2}) == std::vector<int>{1, 0});
  CHECK_THROWS_AS(m.physical(8), dp::Error);
  CHECK_THROWS_AS(m.physical(-1), dp::Error);
}

TEST_CASE("LogicalDeviceMap: one device per GPU is the identity") {
  const LogicalDeviceMap m(3, 1);
  CHECK(m.count() == 3);
  CHECK_FALSE(m.logical());
  for (int d = 0; d < 3; ++d) CHECK(m.physical(d) == d);
  CHECK_FALSE(m.shares_gpu({0, 1, 2}));
  CHECK(LogicalDeviceMap(0, 4).count() == 0);
  CHECK_THROWS_AS(LogicalDeviceMap(1, 0), dp::Error);
  CHECK_THROWS_AS(LogicalDeviceMap(-1, 1), dp::Error);
}
