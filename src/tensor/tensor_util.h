// src/tensor/tensor_util.h — helpers shared by the tensor, nn and optim sources
// (internal): device/dtype checks with uniform messages, byte copies across devices.
#pragma once

#include <functional>
#include <vector>

#include "backend/ops.h"
#include "dp/core/error.h"
#include "dp/tensor/tensor.h"

namespace dp::detail {

// A tensor's dtype indexes the backend's kernel table as it is (Note [The op list]).
static_assert(static_cast<int>(Dtype::Float32) == static_cast<int>(backend::DType::F32) &&
              static_cast<int>(Dtype::Int64) == static_cast<int>(backend::DType::I64) &&
              static_cast<int>(Dtype::Int32) == static_cast<int>(backend::DType::I32) &&
              static_cast<int>(Dtype::BFloat16) == static_cast<int>(backend::DType::BF16) &&
              static_cast<int>(Dtype::Float16) == static_cast<int>(backend::DType::F16));
/// The backend's name for `dtype`.
constexpr backend::DType kernel_dtype(Dtype dtype) { return static_cast<backend::DType>(dtype); }

/// t converted between floating dtypes, without autograd (Tensor::to records it).
Tensor cast_raw(const Tensor& t, Dtype target);

/// log σ(t) elementwise, without autograd: min(t, 0) - log1p(exp(-|t|)), PyTorch's
/// formula (binary_cross_entropy_with_logits' forward).
Tensor log_sigmoid_raw(const Tensor& t);

/// index_select and index_add along dim d (already normalised, index64 an int64 index of
/// the input's device, source of index_add's checked shape) for an index known to lie in
/// [0, input.size(d)): the backward of an op that checked it in its forward. The public
/// ops read the index on the host to check it, which on CUDA waits for the stream; these
/// do not read it again.
Tensor index_select_in_range(const Tensor& input, std::int64_t d, const Tensor& index64);
Tensor index_add_in_range(const Tensor& input, std::int64_t d, const Tensor& index64, const Tensor& source);

/// Copies bytes between any two devices (CPU virtual devices count as host memory).
void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t nbytes);

// ---- layouts (Note [Channels-last tensors]) ------------------------------------------
/// The tensor's bytes as they lie: a channels-last tensor's N x H x W x C storage,
/// where raw_data() gives its NCHW copy. For code that computes in the layout.
void* layout_data(const Tensor& t);
/// The same pointer for an in-place write; moves the storage version (Note [Storage
/// versions]). Take it after every check that may throw.
void* mutable_layout_data(const Tensor& t);
/// A new tensor of `shape` laid out in `format` (Contiguous where the two layouts are
/// the same bytes, or the shape is not 4-d).
Tensor empty_in(const Shape& shape, TensorOptions opts, MemoryFormat format);
/// The layout the elementwise result of these operands takes: ChannelsLast when t is
/// channels-last and every other defined operand is too, with t's shape; else
/// Contiguous (then every operand is read as NCHW).
MemoryFormat elementwise_format(const Tensor& t, const Tensor& other = Tensor());
/// `t` laid out in `format` without autograd (contiguous(format) records it).
Tensor in_format(const Tensor& t, MemoryFormat format);
/// A new contiguous tensor of t's values, with storage of its own and no history: the
/// copy to make for an output that code then writes through data<T>() or raw_data(),
/// where clone() would keep a channels-last layout that such writes miss (Note
/// [Channels-last tensors]).
Tensor contiguous_copy(const Tensor& t);

inline void check_defined(const char* op, const Tensor& t, const char* what = "input") {
  DP_CHECK(t.defined(), op, ": expected a defined ", what, " tensor, got an undefined one");
}

/// Throws unless a and b live on one device, naming both.
inline void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  check_defined(op, a);
  check_defined(op, b);
  DP_CHECK(a.device() == b.device(), op, ": expected all tensors on one device, got ", a.device(),
           " and ", b.device(), " (move one with .to(device))");
}

inline void check_float(const char* op, const Tensor& t, const char* what = "input") {
  check_defined(op, t, what);
  DP_CHECK(t.dtype() == Dtype::Float32, op, ": expected a float32 ", what, ", got ",
           dtype_name(t.dtype()));
}

/// Throws unless t is of a floating dtype (float32, bfloat16, float16).
inline void check_floating(const char* op, const Tensor& t, const char* what = "input") {
  check_defined(op, t, what);
  DP_CHECK(is_floating_point(t.dtype()), op, ": expected a floating ", what,
           " (float32, bfloat16 or float16), got ", dtype_name(t.dtype()));
}

/// Throws when t is the copy dp makes where PyTorch returns a view (Note [Writes into
/// materialised views]): an in-place write into it would not reach its source.
inline void check_writable(const char* op, const Tensor& t) {
  const char* made_by = t.impl() ? t.impl()->copied_view : nullptr;
  DP_CHECK(made_by == nullptr, op, ": expected a tensor that a write reaches, got one made by ", made_by,
           ", which PyTorch returns as a view of its source and dp as a copy (Note [Writes into materialised "
           "views]): this write would change the copy only, never the source. Write into the source itself "
           "(to fill a slice along a later dim, build the tensor with dp::cat), or call .contiguous() on this "
           "tensor first to write into the copy alone");
}

/// Before an in-place write into `t` (of `source`, for copy_ and add_): false when
/// autograd has nothing to record (grad mode off, or neither requires grad); true when
/// the write must be recorded (record_inplace after it); throws a dp::Error when it can
/// be neither: a leaf that requires grad, or a tensor that shares its storage with
/// other tensors (Note [In-place writes and autograd] in src/tensor/tensor.cpp).
bool check_inplace_grad(const char* op, const Tensor& t, const Tensor& source = Tensor());
/// After a write that check_inplace_grad said to record: `t`'s history becomes a node
/// `name` over its old history and `source`, whose backward is fn(g) = {gradient of the
/// old t, gradient of source}.
void record_inplace(const char* name, Tensor& t, const Tensor& source,
                    std::function<std::vector<Tensor>(const Tensor& g)> fn);

/// `t` broadcast to `shape`, materialised (t itself when the shapes agree); the caller
/// has checked that it broadcasts. Differentiable for a floating t: the gradient is
/// summed back to t's shape (Note [Sources of in-place writes] in src/tensor/tensor.cpp).
Tensor broadcast_source(const Tensor& t, const Shape& shape);

}  // namespace dp::detail
