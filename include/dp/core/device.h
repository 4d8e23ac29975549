// dp/core/device.h — where a tensor lives: a CPU virtual device or a CUDA device.
//
// CPU virtual devices (docs/architecture.md) model GPUs on a machine without one:
// each cpu(i) has its own allocations, its own worker thread under DataParallel and
// its own share of the cores. This header knows nothing about tensors or kernels.
//
//   dp::Device d = dp::cpu(1);              // explicit
//   dp::Device g = dp::device(0);           // CUDA 0 if a GPU is visible, else cpu(0)
//   int n = dp::device_count();             // devices of the default type
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

namespace dp {

/// The kind of memory and compute a device offers.
enum class DeviceType : std::uint8_t { CPU = 0, CUDA = 1 };

/// A device: a type and an index. Cheap to copy, comparable, hashable.
struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  friend bool operator==(const Device&, const Device&) = default;
  /// "cpu:0", "cuda:3".
  std::string str() const;
};

std::ostream& operator<<(std::ostream& os, const Device& d);
std::ostream& operator<<(std::ostream& os, DeviceType t);

/// CPU virtual device i. Throws dp::Error when i is out of range.
Device cpu(int index = 0);
/// CUDA device i. Throws dp::Error when i is out of range or no device is visible.
Device cuda(int index = 0);

/// Number of devices of a type. CPU: the number of virtual devices (DP_CPU_DEVICES,
/// default 8). CUDA: visible GPUs; any driver error counts as zero devices.
int device_count(DeviceType type);
/// Number of devices of the default type.
int device_count();

/// The default device type: CUDA when a GPU is visible, else CPU. DP_DEVICE=cpu|cuda
/// overrides. The choice of CPU virtual devices is said once on stderr.
DeviceType default_device_type();

/// Device `index` of the default type, with a range check.
Device device(int index);

/// Parses "cpu", "cpu:2", "cuda", "cuda:1" or "2" (default type). Throws on bad text.
Device parse_device(const std::string& text);

/// Number of hardware threads of this machine (at least 1).
int hardware_concurrency();

/// How this machine's CPU runs bfloat16 matrix products (Note [bf16 GEMMs through
/// oneDNN] in src/backend/cpu/cpu_gemm.cpp), from its CPUID:
///  - Native: avx512_bf16 or AMX-BF16 instructions: oneDNN's bfloat16 matmul, faster
///    than float32;
///  - Emulated: AVX-512 without them: oneDNN's matmul emulates bfloat16 products with
///    float32 FMAs, about float32's speed;
///  - Widened: neither (AVX2 CPUs): products widen to float32 and round once, slower
///    than float32 by the conversions.
/// The results are the same bfloat16 bits a product with float32 accumulation gives in
/// every case; only the speed differs.
enum class CpuBf16 { Native, Emulated, Widened };
CpuBf16 cpu_bf16();
/// "native (avx512_bf16/AMX)", "emulated (AVX-512 without bf16 instructions)" or
/// "widened to float32 (no AVX-512)".
const char* cpu_bf16_name(CpuBf16 kind);

/// Bytes held by tensors on `dev` now (torch.cuda.memory_allocated); pinned host
/// memory is not on any device and is counted by pinned_memory_allocated().
std::size_t memory_allocated(Device dev);
/// Peak of memory_allocated(dev) since the start or the last reset_peak_memory(dev).
std::size_t max_memory_allocated(Device dev);
/// Restarts max_memory_allocated(dev) from the current value.
void reset_peak_memory(Device dev);
/// Returns the memory the caching allocator of `dev` keeps in free blocks to the
/// driver (torch.cuda.empty_cache). Synchronises the device: call it between steps.
/// A no-op on CPU virtual devices.
void empty_cache(Device dev);
/// Note [TF32 policy]
/// TF32 tensor-core math (Ampere and newer GPUs: products of 10-bit-mantissa inputs,
/// FP32 accumulation) is ~8x faster than FP32 and agrees with it to about 1e-3
/// relative. As in PyTorch, two switches decide where it may be used:
/// matrix products (cuBLAS; torch.backends.cuda.matmul.allow_tf32, default OFF) and
/// convolutions (cuDNN; torch.backends.cudnn.allow_tf32, default ON). With a switch off
/// the backend uses pure FP32 and fails, rather than falling back, when cuDNN offers
/// no FP32 algorithm. DP_CUDA_ALLOW_TF32=1 (or 0) at start-up turns both on (or off).
/// CPU devices never use TF32. Thread-safe; a change applies to the next operation.
void set_allow_tf32_matmul(bool on);
void set_allow_tf32_conv(bool on);
bool allow_tf32_matmul();
bool allow_tf32_conv();

/// Note [cuDNN benchmark]
/// Like torch.backends.cudnn.benchmark: when on, the first use of a convolution shape
/// on a device times cuDNN's algorithms on the real tensors (cudnnFind*AlgorithmEx,
/// which synchronises the device once per shape and direction) and keeps the fastest
/// deterministic one allowed by the TF32 policy; when off (the default), cuDNN's
/// heuristics choose without running anything. Either way the choice is cached per
/// (device, shape), results stay bitwise reproducible run to run for a given choice,
/// and the choice itself may differ between benchmarked runs. DP_CUDNN_BENCHMARK=1 at
/// start-up turns it on. CPU devices ignore it. Thread-safe; applies to shapes first
/// used after the change.
void set_cudnn_benchmark(bool on);
bool cudnn_benchmark();

/// Bytes of pinned host memory held by tensors now (Tensor::pin_memory).
std::size_t pinned_memory_allocated();

}  // namespace dp

template <>
struct std::hash<dp::Device> {
  std::size_t operator()(const dp::Device& d) const noexcept {
    return (static_cast<std::size_t>(d.type) << 16) ^ static_cast<std::size_t>(d.index);
  }
};
