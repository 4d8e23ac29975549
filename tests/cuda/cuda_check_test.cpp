// tests/cuda/cuda_check_test.cpp — a CUDA error names the dp device it happened on.
//
// With logical devices (Note [Logical CUDA devices]) dp device cuda:i runs on GPU
// i / k, so the runtime's current device is not the device the user named: an error
// says "cuda:5 (GPU 1)". Built only with the CUDA backend (it includes the CUDA
// headers); without a visible device it exits 77 (SKIP).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "cuda_test_main.h"

#include <string>

#include "backend/backend.h"
#include "backend/cuda/cuda_check.h"
#include "dp/core/device.h"
#include "dp/core/error.h"

namespace {

std::string message_of(const auto& fn) {
  try {
    fn();
  } catch (const dp::Error& e) {
    return e.what();
  }
  return "(nothing thrown)";
}

}  // namespace

TEST_CASE("the error names the dp device noted on the thread, and its GPU when they differ") {
  using dp::backend::cuda_detail::format_error;
  using dp::backend::cuda_detail::note_thread_device;
  dp::backend::get(dp::DeviceType::CUDA).set_current_device(dp::cuda(0));
  const int gpu = dp::backend::cuda_detail::current_device_or_minus_one();
  REQUIRE(gpu == 0);
  note_thread_device(5, 0);
  CHECK(std::string(format_error("CUDA", 1, "x", "stmt", "f.cpp", 1)).find("on cuda:5 (GPU 0) [") != std::string::npos);
  note_thread_device(0, 0);
  const std::string plain = format_error("CUDA", 1, "x", "stmt", "f.cpp", 1);
  CHECK(plain.find("on cuda:0 [") != std::string::npos);
  CHECK(plain.find("(GPU") == std::string::npos);
  // A note that does not match the runtime's device (something else called
  // cudaSetDevice) is not trusted: the runtime's device is named.
  note_thread_device(7, 3);
  CHECK(std::string(format_error("CUDA", 1, "x", "stmt", "f.cpp", 1)).find("on cuda:0 [") != std::string::npos);
}

TEST_CASE("a failing call on the last dp device names that device") {
  const int n = dp::device_count(dp::DeviceType::CUDA);
  int gpus = 0;
  REQUIRE(cudaGetDeviceCount(&gpus) == cudaSuccess);
  REQUIRE(gpus > 0);
  const int last = n - 1, per_gpu = n / gpus, gpu = last / per_gpu;
  dp::backend::get(dp::DeviceType::CUDA).set_current_device(dp::cuda(last));
  const std::string msg = message_of([&] { DP_CUDA_CHECK(cudaSetDevice(gpus + 7)); });  // an invalid device
  INFO(msg);
  const std::string where = "on cuda:" + std::to_string(last) + (last != gpu ? " (GPU " + std::to_string(gpu) + ")" : "") + " [";
  CHECK(msg.find(where) != std::string::npos);
  CHECK(msg.find("cudaSetDevice") != std::string::npos);
}

int main(int argc, char** argv) { return dp_test::run_if_cuda("cuda_check_test", argc, argv); }
