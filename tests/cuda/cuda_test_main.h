// tests/cuda/cuda_test_main.h — the main() of a CUDA test binary: run the doctest cases
// when a CUDA device is visible, else exit 77, which Meson reports as SKIP.
//
//   #define DOCTEST_CONFIG_IMPLEMENT
//   #include <doctest/doctest.h>
//   #include "cuda_test_main.h"
//   ...
//   int main(int argc, char** argv) { return dp_test::run_if_cuda("my_test", argc, argv); }
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <exception>
#include <iostream>
#include <vector>

#include "dp/core/device.h"

namespace dp_test {

/// Every visible CUDA device, up to 8.
inline std::vector<dp::Device> cuda_devices() {
  std::vector<dp::Device> devs;
  const int n = std::min(dp::device_count(dp::DeviceType::CUDA), 8);
  for (int i = 0; i < n; ++i) devs.push_back(dp::cuda(i));
  return devs;
}

/// CPU virtual devices 0..n-1: the oracle runs beside the GPUs.
inline std::vector<dp::Device> cpu_devices(std::size_t n) {
  std::vector<dp::Device> devs;
  for (std::size_t i = 0; i < n; ++i) devs.push_back(dp::cpu(static_cast<int>(i)));
  return devs;
}

inline int run_if_cuda(const char* name, int argc, char** argv) {
  int n = 0;
  try {
    n = dp::device_count(dp::DeviceType::CUDA);
  } catch (const std::exception& e) {
    std::cerr << name << ": " << e.what() << '\n';
  }
  if (n == 0) {
    std::cerr << name << ": SKIP — no usable CUDA device (no GPU, no driver, "
                 "CUDA_VISIBLE_DEVICES empty, or dp built without CUDA)\n";
    return 77;  // Meson's exit code for a skipped test
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}

}  // namespace dp_test
