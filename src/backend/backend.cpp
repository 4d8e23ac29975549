#include "backend/backend.h"

namespace dp::backend {

// Defined by backend/cpu and by backend/cuda (or backend/stub when CUDA is absent).
Backend& cpu_backend();
Backend& cuda_backend();

Backend& get(DeviceType type) {
  return type == DeviceType::CPU ? cpu_backend() : cuda_backend();
}

Backend& pinned_host_backend() {
  // Probed once: the device count of a process does not change.
  static Backend& backend = cuda_backend().device_count() > 0 ? cuda_backend() : cpu_backend();
  return backend;
}

namespace {

// Note [Device runtime registration]
// Core answers dp::device_count(type), dp::memory_allocated(dev) and the other device
// queries through the runtimes registered here (core/device_runtime.h), so core never
// includes a backend: the arrow points from the backends down to core. The registrar
// runs while libdp is loaded, before any user code; nothing in dp asks core about
// devices from a static initialiser, and core's slots are constant-initialised, so the
// order of initialisation between translation units does not matter. The getters
// create a backend only when first asked: loading dp never touches the CUDA driver.
struct Registrar {
  Registrar() {
    dp::detail::register_device_runtime(
        DeviceType::CPU, []() -> dp::detail::DeviceRuntime& { return cpu_backend(); });
    dp::detail::register_device_runtime(
        DeviceType::CUDA, []() -> dp::detail::DeviceRuntime& { return cuda_backend(); });
  }
};
const Registrar registrar;

}  // namespace

}  // namespace dp::backend
