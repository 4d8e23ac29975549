// src/backend/stub/stub_backend.cpp — the CUDA backend of a build without CUDA.
//
// Built instead of backend/cuda when the toolkit is absent or -Dcuda=disabled, so the
// rest of dp links the same way on every machine. device_count() is 0 (so
// default_device_type() picks CPU virtual devices) and every other call throws a
// dp::Error that says how to get CUDA support.
#include <string>

#include "backend/backend.h"
#include "dp/core/error.h"

namespace dp::backend {
namespace {

[[noreturn]] void unavailable(const char* op) {
  DP_FAIL("dp was built without CUDA support: ", op,
          "() needs a CUDA device. Rebuild with the CUDA toolkit, cuDNN and NCCL installed "
          "(meson setup -Dcuda=enabled), or use CPU devices (dp::cpu(i), DP_DEVICE=cpu)");
}

class StubBackend final : public Backend {
 public:
  DeviceType type() const override { return DeviceType::CUDA; }
  int device_count() override { return 0; }

  void set_current_device(Device) override { unavailable("set_current_device"); }
  void set_concurrent_devices(int) override { unavailable("set_concurrent_devices"); }
  int threads_per_device(Device) override { unavailable("threads_per_device"); }
  void host_parallel_for(Device, std::int64_t, RangeFn) override {
    unavailable("host_parallel_for");
  }
  void synchronize(Device) override { unavailable("synchronize"); }
  std::unique_ptr<Event> create_event(Device) override { unavailable("create_event"); }
  void record_event(Event&, Device) override { unavailable("record_event"); }
  void wait_event(Event&, Device) override { unavailable("wait_event"); }
  // Ranges name work; a build without CUDA has none to name (Note [Profiler ranges]).
  void range_push(Device, const char*) override {}
  void range_pop(Device) noexcept override {}

  void* allocate(Device, std::size_t) override { unavailable("allocate"); }
  // noexcept: nothing can have been allocated by this backend, so there is nothing to free.
  void deallocate(Device, void*, std::size_t) noexcept override {}
  std::size_t memory_allocated(Device) override { unavailable("memory_allocated"); }
  std::size_t max_memory_allocated(Device) override { unavailable("max_memory_allocated"); }
  void reset_peak_memory(Device) override { unavailable("reset_peak_memory"); }
  void* allocate_pinned(std::size_t) override { unavailable("allocate_pinned"); }
  void deallocate_pinned(void*, std::size_t) noexcept override {}
  std::size_t pinned_memory_allocated() override { return 0; }
  void copy(void*, Device, const void*, Device, std::size_t) override { unavailable("copy"); }
  void copy_from_host(void*, Device, const void*, std::size_t) override {
    unavailable("copy_from_host");
  }
  void copy_to_host(void*, const void*, Device, std::size_t) override {
    unavailable("copy_to_host");
  }
  void memset_zero(void*, Device, std::size_t) override { unavailable("memset_zero"); }

  // No kernel is registered: every op says how to get CUDA (Note [The op list] in ops.h).
  [[noreturn]] void missing_kernel(Op op, DType) const override { unavailable(op_name(op)); }
};

}  // namespace

Backend& cuda_backend() {
  static StubBackend backend;
  return backend;
}

}  // namespace dp::backend
