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

}  // namespace dp::backend
