// dp/tensor/ops.h — differentiable tensor operations.
//
// Elementwise binary ops broadcast like PyTorch (trailing dims aligned; size-1 dims
// stretch). Every op checks devices, dtypes and shapes first and throws dp::Error
// naming both sides. Ops record an autograd node when grad mode is on and an input
// requires a gradient. Neural-network ops (conv, pooling, losses) live in
// dp/nn/functional.h.
//
//   dp::Tensor y = dp::matmul(x, w) + b;        // (B, in) x (in, out) + (out)
//   dp::Tensor p = dp::cat({a, b});             // along dim 0
//   dp::Tensor q = 1.0 - dp::sigmoid(z);        // scalars on either side
#pragma once

#include <vector>

#include "dp/tensor/tensor.h"

namespace dp {

Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double s);
Tensor mul(const Tensor& a, double s);
/// a / s, elementwise, a true division (PyTorch's `t / 3.0`; a 16-bit tensor divides in
/// float32 and rounds once to its dtype). `a * (1.0 / s)` rounds twice.
Tensor div(const Tensor& a, double s);
/// s - a, elementwise: one rounding, like PyTorch's `1.0 - t` (rsub).
Tensor sub(double s, const Tensor& a);
/// s / a, elementwise, computed as PyTorch 1.13 computes `2.0 / t`: reciprocal(a) * s,
/// two float32 roundings (so it can differ from a true division by one ulp).
Tensor div(double s, const Tensor& a);
/// a ** p for a scalar exponent.
Tensor pow(const Tensor& a, double p);
/// 1.0 where a == b else 0.0 (float32, not differentiable). Integer inputs are compared
/// exactly, int32 with int64 too (labels against argmax): `dp::eq(argmax(out, 1), y)`.
Tensor eq(const Tensor& a, const Tensor& b);

// ---- comparisons ---------------------------------------------------------------------------
// Note [Comparison results]
// dp has no bool dtype: a comparison gives float32 1.0f where it holds and 0.0f where
// not, so that sum() counts and mean() is a fraction, as PyTorch's bool tensors do
// once summed:
//   std::int64_t correct = (out.argmax(1) == y).sum().item<std::int64_t>();
//   dp::Tensor mask = x > 0.5;                     // float32 0/1, x's shape
// Shapes broadcast as for add; both sides on one device (else dp::Error naming both).
// Not differentiable. NaN compares as IEEE says: every comparison false but !=.
// == and != take float32 with float32, or integers (int64, int32) with integers,
// compared exactly; the ordering comparisons (<, <=, >, >=) take float32 only (an
// int64 label above 2^24 has no exact float32): convert with .to(dp::Dtype::Float32).
// A scalar on either side is a float32 value for a float32 tensor; against an integer
// tensor, == and != compare exactly (a non-integral scalar equals nothing).

/// a != b, elementwise (Note [Comparison results]).
Tensor ne(const Tensor& a, const Tensor& b);
/// a > b, elementwise (Note [Comparison results]).
Tensor gt(const Tensor& a, const Tensor& b);
/// a < b, elementwise (Note [Comparison results]).
Tensor lt(const Tensor& a, const Tensor& b);
/// a >= b, elementwise (Note [Comparison results]).
Tensor ge(const Tensor& a, const Tensor& b);
/// a <= b, elementwise (Note [Comparison results]).
Tensor le(const Tensor& a, const Tensor& b);
/// The same against a scalar s on the right: a == s, a != s, a > s, ...
Tensor eq(const Tensor& a, double s);
Tensor ne(const Tensor& a, double s);
Tensor gt(const Tensor& a, double s);
Tensor lt(const Tensor& a, double s);
Tensor ge(const Tensor& a, double s);
Tensor le(const Tensor& a, double s);

// ---- selection -----------------------------------------------------------------------------
// Note [Conditions are float32]
// dp has no bool dtype, so where, masked_fill and the masks built on them take a float32
// condition, as dp's comparisons make it (Note [Comparison results]): any nonzero value,
// NaN included, holds — what PyTorch's conversion of the value to bool gives. A 16-bit
// condition holds where it is nonzero too; an integer one is a dp::Error (convert with
// .to(dp::Dtype::Float32) or compare: `ids != 0`).

/// torch.where(cond, a, b): a where cond holds, else b (Note [Conditions are float32]).
/// cond, a and b broadcast together (trailing dims aligned, size-1 dims stretch), all on
/// one device; a and b floating, the result in their dtype (float32 when they differ,
/// Note [16-bit tensors]). Differentiable in a and b: each gets the gradient where it was
/// chosen and zero elsewhere, summed back to its shape; cond gets none.
///   dp::Tensor y = dp::where(x > 0, x, 0.1 * x);     // leaky ReLU
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
/// where with a scalar on one side, in the tensor's dtype: where(keep, x, 0.0).
Tensor where(const Tensor& cond, const Tensor& a, double b);
Tensor where(const Tensor& cond, double a, const Tensor& b);
/// torch.masked_fill: input with `value` where mask holds (Note [Conditions are
/// float32]), elsewhere input. mask broadcasts to input's shape (never the other way: the
/// result has input's shape and dtype). Differentiable in input (zero gradient where
/// filled).
///   dp::Tensor s = dp::masked_fill(scores, pad.reshape({B, 1, 1, S}), -INFINITY);
Tensor masked_fill(const Tensor& input, const Tensor& mask, double value);
/// torch.clamp: min(max(a, min), max) elementwise, either bound may be absent (not both);
/// as PyTorch, NaN stays NaN, min > max gives max everywhere, and the bounds compare in
/// float32 (a 16-bit tensor's in float32 too, the result rounded to its dtype: exact).
/// Differentiable as PyTorch 2.15's: the gradient passes where min < a < max, zero at a
/// bound and at NaN (Note [clamp's gradient] in src/tensor/ops.cpp). Floating tensors.
///   dp::Tensor p = dp::clamp(probs, 1e-7, 1.0 - 1e-7);
Tensor clamp(const Tensor& a, std::optional<double> min, std::optional<double> max = std::nullopt);
/// torch.tril: the lower triangle of the last two dims (..., R, C) — element (i, j) where
/// j - i <= diagonal — and zeros above it; any batch dims before them. diagonal > 0 keeps
/// that many diagonals above the main one, < 0 drops as many below it. Any floating
/// dtype; differentiable (the gradient is tril of the gradient).
Tensor tril(const Tensor& x, std::int64_t diagonal = 0);
/// torch.triu: the upper triangle, element (i, j) where j - i >= diagonal, zeros below;
/// as tril otherwise. triu(ones({T, T}), 1) marks the keys a causal query must not see.
Tensor triu(const Tensor& x, std::int64_t diagonal = 0);

Tensor neg(const Tensor& a);
Tensor exp(const Tensor& a);
Tensor log(const Tensor& a);
Tensor sqrt(const Tensor& a);
Tensor abs(const Tensor& a);
Tensor square(const Tensor& a);
/// 1 / a.
Tensor reciprocal(const Tensor& a);
Tensor relu(const Tensor& a);
Tensor sigmoid(const Tensor& a);
Tensor tanh(const Tensor& a);
/// The error function, erf(x) = 2/sqrt(pi) * integral of exp(-t^2) from 0 to x.
Tensor erf(const Tensor& a);

Tensor sum(const Tensor& a);
Tensor sum(const Tensor& a, std::int64_t dim, bool keepdim = false);
Tensor mean(const Tensor& a);
Tensor mean(const Tensor& a, std::int64_t dim, bool keepdim = false);
Tensor max(const Tensor& a, std::int64_t dim, bool keepdim = false);
/// Index of the maximum along dim (int64; first on ties).
Tensor argmax(const Tensor& a, std::int64_t dim, bool keepdim = false);
/// Sums a broadcast result back to `shape` (the reverse of broadcasting).
Tensor sum_to(const Tensor& a, const Shape& shape);

/// Matrix product with torch.matmul's rules: (m, k) x (k, n) -> (m, n); a 1-d operand
/// is a row (first) or a column (second) vector whose dim is dropped from the result;
/// with more dims, the leading ones are batch dims that broadcast: (..., m, k) x
/// (..., k, n) -> (broadcast(...), m, n), e.g. attention's (B, H, T, D) x (B, H, D, T).
/// A batch of inputs times one (k, n) matrix is one GEMM over all their rows; other
/// batches are one batched GEMM (cuBLAS's strided-batched call on CUDA; one product
/// after another on the CPU). Differentiable (a broadcast operand's gradient is summed
/// back to its shape).
Tensor matmul(const Tensor& a, const Tensor& b);
/// x (*, in) · w(out, in)ᵀ + b(out), in one GEMM over the rows of x's leading dims
/// (torch.nn.functional.linear; b may be undefined; a 1-d x gives a 1-d result).
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b);
/// relu(linear(x, w, b)) as one op: the same output and gradients bit for bit, with the
/// bias and the ReLU applied while the GEMM's output is in cache (CPU: Note [Linear
/// epilogue]). nn::Sequential uses it for a Linear followed by a ReLU.
Tensor linear_relu(const Tensor& x, const Tensor& w, const Tensor& b);

// ---- indexing ------------------------------------------------------------------------------
// PyTorch's semantics; dims may be negative (counted from the end); indices are int64
// or int32 and must lie in [0, size) (no negative indices, as in PyTorch): an index
// outside throws dp::Error naming it, its position and the bound. The index values are
// read on the host to check them (a copy and a wait on a CUDA device).
//
//   dp::Tensor picked = dp::gather(logp, 1, y.unsqueeze(1));     // (B, 1): logp[i, y[i]]
//   dp::Tensor rows = dp::index_select(x, 0, perm);              // x[perm]
//   dp::Tensor hot = dp::one_hot(y, 10);                         // (B, 10) int64

/// torch.gather: out has index's shape and out[i][j][k] = input[i][index[i][j][k]][k]
/// for dim = 1 (likewise for any dim). index has input's number of dims and
/// index.size(d) <= input.size(d) for every d != dim. input is float32, int64 or int32
/// (values copied bit for bit). Differentiable in a float32 input (backward adds the
/// gradient into zeros at the gathered positions).
Tensor gather(const Tensor& input, std::int64_t dim, const Tensor& index);
/// torch.index_select: the slices index[0], index[1], ... of input along dim, in that
/// order (repeats allowed); index is 1-d (or a scalar, giving a size-1 dim). input is
/// float32, int64 or int32 (`index_select(labels, 0, perm)`). Differentiable in a
/// float32 input (backward is index_add into zeros).
Tensor index_select(const Tensor& input, std::int64_t dim, const Tensor& index);
/// torch.index_add: a copy of input with source's slices added along dim at index:
/// out.select(dim, index[i]) += source.select(dim, i). input and source float32, the same
/// shape but along dim, where source has index.numel() slices; index 1-d. Repeated
/// indices add up, in index order on the CPU (bitwise reproducible); on CUDA with atomic
/// adds (their order, and so the last bits, may vary run to run). Differentiable in
/// input and source.
Tensor index_add(const Tensor& input, std::int64_t dim, const Tensor& index, const Tensor& source);
/// torch.nn.functional.one_hot: int64 (..., num_classes) with a 1 at each label.
/// labels: int64 or int32, values in [0, num_classes); num_classes = -1 takes
/// max(labels) + 1 (labels must then be non-empty).
Tensor one_hot(const Tensor& labels, std::int64_t num_classes = -1);

/// torch.cat: concatenation along `dim` (negative counts from the end) of tensors on one
/// device, of one dtype, whose shapes agree in every other dim. Differentiable.
///   dp::Tensor x = dp::cat({a, b}, 1);   // (N, Ca) and (N, Cb) -> (N, Ca + Cb)
Tensor cat(const std::vector<Tensor>& tensors, std::int64_t dim = 0);
/// Splits along `dim` into `chunks` pieces of ceil(size/chunks) (the last may be
/// smaller; fewer pieces when the dim runs out) — torch.chunk semantics. Pieces are
/// narrow()s: views along dim 0, copies along later dims. Differentiable.
std::vector<Tensor> chunk(const Tensor& t, std::int64_t chunks, std::int64_t dim = 0);
/// Splits along `dim` into pieces of the given sizes (must sum to the dim's size), as
/// torch.split with a list. Differentiable.
std::vector<Tensor> split(const Tensor& t, const std::vector<std::int64_t>& sizes, std::int64_t dim = 0);
/// Splits along `dim` into pieces of `split_size` (the last may be smaller), as
/// torch.split with an int: q, k, v = split(qkv, C, 2).
std::vector<Tensor> split(const Tensor& t, std::int64_t split_size, std::int64_t dim);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator+(const Tensor& a, double s) { return add(a, s); }
inline Tensor operator-(const Tensor& a, double s) { return add(a, -s); }
inline Tensor operator*(const Tensor& a, double s) { return mul(a, s); }
inline Tensor operator/(const Tensor& a, double s) { return div(a, s); }
inline Tensor operator*(double s, const Tensor& a) { return mul(a, s); }
/// Scalars on the left, as in PyTorch: `1.0 + t`, `1.0 - t`, `2.0 / t`.
inline Tensor operator+(double s, const Tensor& a) { return add(a, s); }
inline Tensor operator-(double s, const Tensor& a) { return sub(s, a); }
inline Tensor operator/(double s, const Tensor& a) { return div(s, a); }

/// Comparisons give float32 0/1 tensors (Note [Comparison results]).
inline Tensor operator==(const Tensor& a, const Tensor& b) { return eq(a, b); }
inline Tensor operator!=(const Tensor& a, const Tensor& b) { return ne(a, b); }
inline Tensor operator>(const Tensor& a, const Tensor& b) { return gt(a, b); }
inline Tensor operator<(const Tensor& a, const Tensor& b) { return lt(a, b); }
inline Tensor operator>=(const Tensor& a, const Tensor& b) { return ge(a, b); }
inline Tensor operator<=(const Tensor& a, const Tensor& b) { return le(a, b); }
inline Tensor operator==(const Tensor& a, double s) { return eq(a, s); }
inline Tensor operator!=(const Tensor& a, double s) { return ne(a, s); }
inline Tensor operator>(const Tensor& a, double s) { return gt(a, s); }
inline Tensor operator<(const Tensor& a, double s) { return lt(a, s); }
inline Tensor operator>=(const Tensor& a, double s) { return ge(a, s); }
inline Tensor operator<=(const Tensor& a, double s) { return le(a, s); }
/// A scalar on the left: `0.5 < x` is `x > 0.5`.
inline Tensor operator==(double s, const Tensor& a) { return eq(a, s); }
inline Tensor operator!=(double s, const Tensor& a) { return ne(a, s); }
inline Tensor operator>(double s, const Tensor& a) { return lt(a, s); }
inline Tensor operator<(double s, const Tensor& a) { return gt(a, s); }
inline Tensor operator>=(double s, const Tensor& a) { return le(a, s); }
inline Tensor operator<=(double s, const Tensor& a) { return ge(a, s); }

/// Max |a - b| over all elements (a test helper; synchronous).
double max_abs_diff(const Tensor& a, const Tensor& b);
/// True when every element is equal bit for bit (synchronous).
bool equal(const Tensor& a, const Tensor& b);

}  // namespace dp
