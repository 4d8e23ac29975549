// src/backend/logical_devices.h — how dp's CUDA devices map onto physical GPUs.
//
// Internal to the backend layer; plain C++ (no CUDA headers), so the mapping and its
// environment parsing are tested on CPU (tests/backend/logical_devices_test.cpp).
// With DP_CUDA_DEVICES_PER_GPU=k every physical GPU carries k dp devices: cuda:i runs
// on GPU i / k, with its own streams, handles and allocator (Note [Logical CUDA
// devices], src/backend/cuda/cuda_backend.cpp). It knows nothing of streams or memory.
//
//   LogicalDeviceMap m = LogicalDeviceMap::from_env(1);  // DP_CUDA_DEVICES_PER_GPU=4
//   m.count();          // 4
//   m.physical(3);      // 0
#pragma once

#include <vector>

namespace dp::backend {

/// The environment variable that sets the number of dp devices per physical GPU.
inline constexpr const char* kDevicesPerGpuEnv = "DP_CUDA_DEVICES_PER_GPU";
/// The largest accepted value: 16 logical devices on one GPU already test every path
/// an 8-GPU node takes, and each costs a set of streams, handles and a cuDNN workspace.
inline constexpr int kMaxDevicesPerGpu = 16;

/// Parses the value of DP_CUDA_DEVICES_PER_GPU: null or empty means 1; otherwise an
/// integer in [1, kMaxDevicesPerGpu] (surrounding blanks allowed). Throws dp::Error
/// naming the variable, the value and what is expected.
int parse_devices_per_gpu(const char* value);

/// Logical device i ↦ physical GPU i / per_gpu: the k devices of one GPU are
/// consecutive, so a list {cuda:0, ..., cuda:k-1} fills GPU 0 first.
class LogicalDeviceMap {
 public:
  /// `physical_count` >= 0 GPUs, each carrying `per_gpu` >= 1 devices (checked).
  LogicalDeviceMap(int physical_count, int per_gpu);
  /// The map for `physical_count` GPUs and the value of DP_CUDA_DEVICES_PER_GPU.
  static LogicalDeviceMap from_env(int physical_count);

  /// Number of dp CUDA devices: physical_count * per_gpu.
  int count() const { return physical_count_ * per_gpu_; }
  int physical_count() const { return physical_count_; }
  int per_gpu() const { return per_gpu_; }
  /// True when some GPU carries more than one dp device.
  bool logical() const { return per_gpu_ > 1; }
  /// The physical GPU of dp device `device` (checked: 0 <= device < count()).
  int physical(int device) const;
  /// The position of `device` among the devices of its GPU (0 .. per_gpu - 1).
  int slot(int device) const;
  /// True when two of `devices` (dp device indices) run on the same physical GPU.
  bool shares_gpu(const std::vector<int>& devices) const;
  /// The distinct physical GPUs of `devices`, in order of first appearance.
  std::vector<int> physical_gpus(const std::vector<int>& devices) const;

 private:
  int physical_count_;
  int per_gpu_;
};

}  // namespace dp::backend
