// src/backend/cuda/cuda_register.h — how a kernel file of the CUDA backend puts its ops in
// the kernel table (Note [The op list] in backend/ops.h). Internal to backend/cuda.
//
//   void register_elementwise_kernels(CudaBackend& be) {
//     add<Op::Unary, &table::unary<float>>(be, DType::F32);
//   }
#pragma once

#include "backend/cuda/cuda_backend.h"

namespace dp::backend::cuda_kernels {

/// Registers F, a kernel over op's argument struct, for (op, dt) in the CUDA backend's table.
template <Op op, void (*F)(CudaBackend&, Device, const OpArgs<op>&)>
void add(CudaBackend& be, DType dt) {
  be.add_kernel(op, dt, [](Backend& b, Device dev, DType, const void* args) {
    F(static_cast<CudaBackend&>(b), dev, *static_cast<const OpArgs<op>*>(args));
  });
}

}  // namespace dp::backend::cuda_kernels
