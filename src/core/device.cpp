#include "dp/core/device.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <array>
#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>

#include "core/device_runtime.h"
#include "dp/core/error.h"

namespace dp {
namespace {

// Eight virtual devices: enough to exercise every DP/DDP path a single node with
// 8 GPUs would take, while each still gets at least a core's share on small machines.
constexpr int kDefaultCpuDevices = 8;
constexpr int kMaxCpuDevices = 64;

int cpu_device_count_from_env() {
  const char* env = std::getenv("DP_CPU_DEVICES");
  if (!env || !*env) return kDefaultCpuDevices;
  char* end = nullptr;
  long n = std::strtol(env, &end, 10);
  DP_CHECK(end && *end == '\0' && n >= 1 && n <= kMaxCpuDevices,
           "DP_CPU_DEVICES: expected an integer in [1, ", kMaxCpuDevices, "], got '", env, "'");
  return static_cast<int>(n);
}

/// One slot per DeviceType, constant-initialised (null) before any code runs, so a
/// registration at load time never races with the slots' own initialisation.
constexpr std::size_t kDeviceTypes = 2;
constinit std::array<std::atomic<detail::DeviceRuntimeGetter>, kDeviceTypes> g_runtimes{};

std::size_t slot_of(DeviceType type) { return static_cast<std::size_t>(type); }

/// The runtime that answers for dev's type; registered by the backend layer.
detail::DeviceRuntime& runtime_of(Device dev) {
  detail::DeviceRuntime* rt = detail::device_runtime(dev.type);
  DP_ASSERT(rt != nullptr, "no device runtime registered for ", dev.type);
  return *rt;
}

}  // namespace

namespace detail {

void register_device_runtime(DeviceType type, DeviceRuntimeGetter getter) {
  g_runtimes[slot_of(type)].store(getter, std::memory_order_release);
}

DeviceRuntime* device_runtime(DeviceType type) {
  DeviceRuntimeGetter get = g_runtimes[slot_of(type)].load(std::memory_order_acquire);
  return get != nullptr ? &get() : nullptr;
}

}  // namespace detail

std::string Device::str() const {
  return detail::str_cat(type == DeviceType::CPU ? "cpu:" : "cuda:", index);
}

std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }
std::ostream& operator<<(std::ostream& os, DeviceType t) {
  return os << (t == DeviceType::CPU ? "cpu" : "cuda");
}

int hardware_concurrency() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

int device_count(DeviceType type) {
  if (type == DeviceType::CPU) {
    static const int n = cpu_device_count_from_env();
    return n;
  }
  // Unregistered means no backend for the type is linked: no devices.
  detail::DeviceRuntime* rt = detail::device_runtime(type);
  return rt != nullptr ? rt->device_count() : 0;
}

DeviceType default_device_type() {
  static const DeviceType chosen = [] {
    const char* env = std::getenv("DP_DEVICE");
    std::string want = env ? env : "";
    if (want == "cpu") return DeviceType::CPU;
    if (want == "cuda") {
      DP_CHECK(device_count(DeviceType::CUDA) > 0,
               "DP_DEVICE=cuda: expected a visible CUDA device, found none (driver missing, "
               "CUDA_VISIBLE_DEVICES empty, or dp built without CUDA)");
      return DeviceType::CUDA;
    }
    DP_CHECK(want.empty(), "DP_DEVICE: expected 'cpu' or 'cuda', got '", want, "'");
    if (device_count(DeviceType::CUDA) > 0) return DeviceType::CUDA;
    detail::log_warning(detail::str_cat("no CUDA device visible; integer device ids mean CPU "
                                        "virtual devices cpu:0..cpu:",
                                        device_count(DeviceType::CPU) - 1));
    return DeviceType::CPU;
  }();
  return chosen;
}

int device_count() { return device_count(default_device_type()); }

CpuBf16 cpu_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  static const CpuBf16 kind = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_max(0, nullptr) < 7) return CpuBf16::Widened;
    __cpuid_count(7, 0, a, b, c, d);
    const bool avx512f = (b >> 16) & 1u, avx512bw = (b >> 30) & 1u, amx_bf16 = (d >> 22) & 1u;
    __cpuid_count(7, 1, a, b, c, d);
    const bool avx512_bf16 = (a >> 5) & 1u;
    if (amx_bf16 || (avx512f && avx512_bf16)) return CpuBf16::Native;
    return avx512f && avx512bw ? CpuBf16::Emulated : CpuBf16::Widened;
  }();
  return kind;
#else
  return CpuBf16::Widened;
#endif
}

const char* cpu_bf16_name(CpuBf16 kind) {
  switch (kind) {
    case CpuBf16::Native: return "native (avx512_bf16/AMX)";
    case CpuBf16::Emulated: return "emulated (AVX-512 without bf16 instructions)";
    case CpuBf16::Widened: return "widened to float32 (no AVX-512)";
  }
  return "?";
}

std::size_t memory_allocated(Device dev) { return runtime_of(dev).memory_allocated(dev); }
std::size_t max_memory_allocated(Device dev) { return runtime_of(dev).max_memory_allocated(dev); }
void reset_peak_memory(Device dev) { runtime_of(dev).reset_peak_memory(dev); }
namespace {

// Note [TF32 policy]: PyTorch's defaults, or DP_CUDA_ALLOW_TF32 for both.
struct Tf32 {
  std::atomic<bool> matmul{false}, conv{true};
  Tf32() {
    if (const char* env = std::getenv("DP_CUDA_ALLOW_TF32"); env != nullptr && *env != '\0') {
      const bool on = std::string(env) != "0";
      matmul = on;
      conv = on;
    }
  }
};
Tf32& tf32() {
  static Tf32 t;
  return t;
}

}  // namespace

void set_allow_tf32_matmul(bool on) { tf32().matmul.store(on, std::memory_order_relaxed); }
void set_allow_tf32_conv(bool on) { tf32().conv.store(on, std::memory_order_relaxed); }
bool allow_tf32_matmul() { return tf32().matmul.load(std::memory_order_relaxed); }
bool allow_tf32_conv() { return tf32().conv.load(std::memory_order_relaxed); }

namespace {

// Note [cuDNN benchmark]: off unless DP_CUDNN_BENCHMARK says otherwise.
std::atomic<bool>& cudnn_benchmark_flag() {
  static std::atomic<bool> flag{[] {
    const char* env = std::getenv("DP_CUDNN_BENCHMARK");
    return env != nullptr && *env != '\0' && std::string(env) != "0";
  }()};
  return flag;
}

}  // namespace

void set_cudnn_benchmark(bool on) { cudnn_benchmark_flag().store(on, std::memory_order_relaxed); }
bool cudnn_benchmark() { return cudnn_benchmark_flag().load(std::memory_order_relaxed); }

void empty_cache(Device dev) {
  const int count = device_count(dev.type);
  DP_CHECK(dev.index >= 0 && dev.index < count, "empty_cache: expected a device of this process (", count, " ",
           dev.is_cuda() ? "CUDA" : "CPU", " device(s)), got ", dev);
  runtime_of(dev).empty_cache(dev);
}

std::size_t pinned_memory_allocated() {
  // One runtime pins the host memory of this process (CUDA when a GPU is visible, else
  // CPU); the others report 0, so the sum is what tensors hold.
  std::size_t total = 0;
  for (std::size_t t = 0; t < kDeviceTypes; ++t) {
    if (detail::DeviceRuntime* rt = detail::device_runtime(static_cast<DeviceType>(t)))
      total += rt->pinned_memory_allocated();
  }
  return total;
}

Device cpu(int index) {
  int n = device_count(DeviceType::CPU);
  DP_CHECK(index >= 0 && index < n, "cpu(", index, "): expected a virtual device id in [0, ", n,
           "); set DP_CPU_DEVICES for more");
  return Device{DeviceType::CPU, index};
}

Device cuda(int index) {
  int n = device_count(DeviceType::CUDA);
  DP_CHECK(n > 0, "cuda(", index, "): no CUDA device is visible");
  DP_CHECK(index >= 0 && index < n, "cuda(", index, "): expected a device id in [0, ", n, ")");
  return Device{DeviceType::CUDA, index};
}

Device device(int index) {
  return default_device_type() == DeviceType::CUDA ? cuda(index) : cpu(index);
}

Device parse_device(const std::string& text) {
  auto parse_index = [&](const std::string& s) {
    DP_CHECK(!s.empty() && s.find_first_not_of("0123456789") == std::string::npos && s.size() < 6,
             "device: expected 'cpu', 'cpu:N', 'cuda', 'cuda:N' or 'N', got '", text, "'");
    return std::stoi(s);
  };
  if (text == "cpu") return cpu(0);
  if (text == "cuda") return cuda(0);
  if (text.rfind("cpu:", 0) == 0) return cpu(parse_index(text.substr(4)));
  if (text.rfind("cuda:", 0) == 0) return cuda(parse_index(text.substr(5)));
  return device(parse_index(text));
}

}  // namespace dp
