// src/core/device_runtime.h — how core answers device queries without knowing a backend.
//
// dp::device_count(DeviceType::CUDA), dp::memory_allocated(dev) and the other run-time
// queries of dp/core/device.h need a backend, but core sits below every backend. So
// core owns this small interface and one registry slot per device type; the backend
// layer fills the slots when libdp is loaded (Note [Device runtime registration] in
// src/backend/backend.cpp), and core only calls through them. Internal header: it
// knows nothing of backends, tensors or kernels.
//
//   // in the backend layer (backend::Backend derives from DeviceRuntime):
//   dp::detail::register_device_runtime(dp::DeviceType::CUDA, [] () -> DeviceRuntime& { ... });
//   // in core:
//   if (DeviceRuntime* rt = device_runtime(DeviceType::CUDA)) n = rt->device_count();
#pragma once

#include <cstddef>

#include "dp/core/device.h"

namespace dp::detail {

/// What core asks of the devices of one type at run time (see the file comment).
class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;

  /// Devices of this type; 0 when none can be used (never throws).
  virtual int device_count() = 0;
  /// Bytes currently allocated to tensors on `dev`, and the peak since reset.
  virtual std::size_t memory_allocated(Device dev) = 0;
  virtual std::size_t max_memory_allocated(Device dev) = 0;
  virtual void reset_peak_memory(Device dev) = 0;
  /// Returns cached, unused memory of `dev` to the driver (a no-op where nothing is
  /// cached, as on CPU virtual devices).
  virtual void empty_cache(Device /*dev*/) {}
  /// Bytes of pinned host memory this runtime has handed out now.
  virtual std::size_t pinned_memory_allocated() = 0;
};

/// Returns the runtime of one device type, creating it on first use, so that loading
/// dp never initialises a device driver before someone asks about its devices.
using DeviceRuntimeGetter = DeviceRuntime& (*)();

/// Makes `getter` answer for `type` (replaces an earlier registration). Thread-safe.
void register_device_runtime(DeviceType type, DeviceRuntimeGetter getter);

/// The runtime of `type`, or null when none is registered.
DeviceRuntime* device_runtime(DeviceType type);

}  // namespace dp::detail
