// The mapping of dp CUDA devices onto physical GPUs (see logical_devices.h).
#include "backend/logical_devices.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <string>

#include "dp/core/error.h"

namespace dp::backend {

int parse_devices_per_gpu(const char* value) {
  if (value == nullptr) return 1;
  std::string text(value);
  const auto blank = [](unsigned char c) { return std::isspace(c) != 0; };
  text.erase(text.begin(), std::find_if_not(text.begin(), text.end(), blank));
  text.erase(std::find_if_not(text.rbegin(), text.rend(), blank).base(), text.end());
  if (text.empty()) return 1;
  const bool digits = std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
  long n = 0;
  if (digits && text.size() <= 4) n = std::strtol(text.c_str(), nullptr, 10);  // 4 digits: no overflow
  DP_CHECK(digits && n >= 1 && n <= kMaxDevicesPerGpu, kDevicesPerGpuEnv, "='", value,
           "': expected an integer from 1 to ", kMaxDevicesPerGpu,
           " (the number of dp devices each physical GPU carries; 1, or unset, for one device per GPU)");
  return static_cast<int>(n);
}

LogicalDeviceMap::LogicalDeviceMap(int physical_count, int per_gpu)
    : physical_count_(physical_count), per_gpu_(per_gpu) {
  DP_CHECK(physical_count >= 0, "LogicalDeviceMap: expected a GPU count >= 0, got ", physical_count);
  DP_CHECK(per_gpu >= 1 && per_gpu <= kMaxDevicesPerGpu, "LogicalDeviceMap: expected 1 to ", kMaxDevicesPerGpu,
           " devices per GPU, got ", per_gpu);
}

LogicalDeviceMap LogicalDeviceMap::from_env(int physical_count) {
  return LogicalDeviceMap(physical_count, parse_devices_per_gpu(std::getenv(kDevicesPerGpuEnv)));
}

int LogicalDeviceMap::physical(int device) const {
  DP_CHECK(device >= 0 && device < count(), "cuda:", device, " is out of range: ", count(),
           " CUDA device(s) (", physical_count_, " GPU(s) x ", per_gpu_, " per GPU, ", kDevicesPerGpuEnv, ")");
  return device / per_gpu_;
}

int LogicalDeviceMap::slot(int device) const { return device - physical(device) * per_gpu_; }

bool LogicalDeviceMap::shares_gpu(const std::vector<int>& devices) const {
  return physical_gpus(devices).size() < devices.size();
}

std::vector<int> LogicalDeviceMap::physical_gpus(const std::vector<int>& devices) const {
  std::vector<int> gpus;
  for (int d : devices) {
    const int p = physical(d);
    if (std::find(gpus.begin(), gpus.end(), p) == gpus.end()) gpus.push_back(p);
  }
  return gpus;
}

}  // namespace dp::backend
