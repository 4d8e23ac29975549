#include <doctest/doctest.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "dp/core/device.h"
#include "dp/core/error.h"
#include "dp/tensor/tensor.h"

TEST_CASE("cpu virtual devices are numbered and range-checked") {
  CHECK(dp::device_count(dp::DeviceType::CPU) == 8);  // tests run with DP_CPU_DEVICES=8
  CHECK(dp::cpu(3) == dp::Device{dp::DeviceType::CPU, 3});
  CHECK(dp::cpu(3).str() == "cpu:3");
  CHECK_THROWS_AS(dp::cpu(8), dp::Error);
  CHECK_THROWS_AS(dp::cpu(-1), dp::Error);
}

TEST_CASE("device text is parsed or rejected with a clear error") {
  CHECK(dp::parse_device("cpu:2") == dp::cpu(2));
  CHECK(dp::parse_device("cpu") == dp::cpu(0));
  CHECK_THROWS_WITH_AS(dp::parse_device("cpu:x"), doctest::Contains("expected 'cpu'"), dp::Error);
  CHECK_THROWS_AS(dp::parse_device("gpu:0"), dp::Error);
  CHECK_THROWS_AS(dp::parse_device(""), dp::Error);
}

TEST_CASE("without a GPU the default device type is cpu and cuda ids are rejected") {
  if (dp::device_count(dp::DeviceType::CUDA) > 0) return;
  CHECK(dp::default_device_type() == dp::DeviceType::CPU);
  CHECK(dp::device(1) == dp::cpu(1));
  CHECK_THROWS_WITH_AS(dp::cuda(0), doctest::Contains("no CUDA device"), dp::Error);
}

TEST_CASE("DP_CHECK messages carry what and where") {
  try {
    DP_CHECK(1 == 2, "expected ", 1, ", got ", 2);
    FAIL("DP_CHECK did not throw");
  } catch (const dp::Error& e) {
    CHECK(std::string(e.what()).find("expected 1, got 2") != std::string::npos);
    CHECK(std::string(e.what()).find("device_test.cpp") != std::string::npos);
  }
}

TEST_CASE("empty_cache is a no-op on CPU virtual devices and checks the device") {
  dp::Tensor t = dp::zeros({1024}, dp::cpu(0));
  const std::size_t held = dp::memory_allocated(dp::cpu(0));
  dp::empty_cache(dp::cpu(0));
  CHECK(dp::memory_allocated(dp::cpu(0)) == held);
  CHECK(t.to_vector().size() == 1024);
  CHECK_THROWS_AS(dp::empty_cache(dp::Device{dp::DeviceType::CPU, 999}), dp::Error);
}

TEST_CASE("TF32 policy: PyTorch's defaults (matmul off, convolution on) and the setters") {
  if (std::getenv("DP_CUDA_ALLOW_TF32") == nullptr) {
    CHECK_FALSE(dp::allow_tf32_matmul());
    CHECK(dp::allow_tf32_conv());
  }
  const bool mm = dp::allow_tf32_matmul(), conv = dp::allow_tf32_conv();
  dp::set_allow_tf32_matmul(true);
  dp::set_allow_tf32_conv(false);
  CHECK(dp::allow_tf32_matmul());
  CHECK_FALSE(dp::allow_tf32_conv());
  dp::set_allow_tf32_matmul(mm);
  dp::set_allow_tf32_conv(conv);
}

namespace {

/// The flags of the first "flags" line of /proc/cpuinfo ("" when there is none).
std::string cpuinfo_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("flags", 0) == 0) return " " + line.substr(line.find(':') + 1) + " ";
  return "";
}

}  // namespace

TEST_CASE("cpu_bf16 says what /proc/cpuinfo says: native with avx512_bf16 or amx_bf16, emulated with AVX-512") {
  const std::string flags = cpuinfo_flags();
  if (flags.empty()) return;  // not Linux on x86: nothing to compare with
  const auto has = [&](const char* f) { return flags.find(std::string(" ") + f + " ") != std::string::npos; };
  const bool native = has("amx_bf16") || (has("avx512f") && has("avx512_bf16"));
  const bool avx512 = has("avx512f") && has("avx512bw");
  const dp::CpuBf16 want = native ? dp::CpuBf16::Native : avx512 ? dp::CpuBf16::Emulated : dp::CpuBf16::Widened;
  CAPTURE(flags);
  CHECK(dp::cpu_bf16() == want);
  MESSAGE("bfloat16 products here: ", std::string(dp::cpu_bf16_name(dp::cpu_bf16())));
  CHECK(std::string(dp::cpu_bf16_name(dp::CpuBf16::Native)).find("native") == 0);
}
