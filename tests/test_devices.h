// tests/test_devices.h — device parameters for doctest's TEST_CASE_TEMPLATE.
//
// CPU virtual devices always exist (tests run with DP_CPU_DEVICES=8); the CUDA case
// runs only where a GPU is visible:
//   TEST_CASE_TEMPLATE("add", D, DP_TEST_DEVICES) { DP_SKIP_UNLESS_AVAILABLE(D); ... D::device() ... }
#pragma once

#include "dp/core/device.h"

namespace dp_test {

struct Cpu0 {
  static bool available() { return true; }
  static dp::Device device() { return dp::cpu(0); }
};
struct Cpu1 {
  static bool available() { return true; }
  static dp::Device device() { return dp::cpu(1); }
};
struct Cuda0 {
  static bool available() { return dp::device_count(dp::DeviceType::CUDA) > 0; }
  static dp::Device device() { return dp::cuda(0); }
};

}  // namespace dp_test

#define DP_TEST_DEVICES dp_test::Cpu0, dp_test::Cpu1, dp_test::Cuda0
#define DP_SKIP_UNLESS_AVAILABLE(D) \
  if (!D::available()) return
