#include "parallel/grad_wire.h"

#include "backend/backend.h"
#include "dp/core/error.h"
#include "tensor/tensor_util.h"

namespace dp::parallel {

void cast_into(const Tensor& src, const Tensor& dst) {
  DP_ASSERT(src.numel() == dst.numel() && src.device() == dst.device(), "cast_into: a cast between ",
            src.numel(), " elements on ", src.device(), " and ", dst.numel(), " on ", dst.device());
  if (src.numel() == 0) return;
  backend::get(src.device()).run<backend::Op::Cast>(
      src.device(), detail::kernel_dtype(dst.dtype()),
      {src.raw_data(), detail::kernel_dtype(src.dtype()), dst.raw_data(), src.numel()});
}

GradWire::GradWire(const std::vector<Device>& devices, Dtype dtype, std::int64_t numel) : dtype_(dtype) {
  DP_ASSERT(dtype == Dtype::BFloat16 || dtype == Dtype::Float16, "GradWire: a 16-bit floating dtype, got ",
            dtype_name(dtype));
  for (const Device& d : devices) buffers_.push_back(empty({numel}, TensorOptions{dtype, d}));
}

Tensor GradWire::pack(int rank, const Tensor& grad, std::int64_t offset) const {
  const Tensor& buffer = buffers_[static_cast<std::size_t>(rank)];
  DP_ASSERT(grad.dtype() == Dtype::Float32 && offset >= 0 && offset + grad.numel() <= buffer.numel(),
            "GradWire::pack: float32 elements [", offset, ", ", offset + grad.numel(), ") of ", buffer.numel());
  Tensor wire = buffer.narrow(0, offset, grad.numel());
  cast_into(grad.reshape({grad.numel()}), wire);
  return wire;
}

void GradWire::unpack(const Tensor& wire, const Tensor& grad) {
  DP_ASSERT(grad.dtype() == Dtype::Float32, "GradWire::unpack: into float32, got ", dtype_name(grad.dtype()));
  cast_into(wire, grad);
}

}  // namespace dp::parallel
