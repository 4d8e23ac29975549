#include "backend/backend.h"

namespace dp::backend {

// Defined by backend/cpu and by backend/cuda (or backend/stub when CUDA is absent).
Backend& cpu_backend();
Backend& cuda_backend();

Backend& get(DeviceType type) {
  return type == DeviceType::CPU ? cpu_backend() : cuda_backend();
}

}  // namespace dp::backend
