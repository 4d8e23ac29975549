#include "dp/tensor/ops.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "backend/backend.h"
#include "dp/autograd/grad_mode.h"
#include "dp/autograd/node.h"
#include "dp/core/error.h"
#include "tensor/autocast_policy.h"
#include "tensor/tensor_util.h"

namespace dp {
namespace {

using backend::BinaryOp;
using backend::Indexer;
using backend::ReduceOp;
using backend::UnaryOp;

backend::Backend& be(const Tensor& t) { return backend::get(t.device()); }
using backend::DType;
using backend::Op;

// Note [Broadcasting]
// Shapes align at their trailing dims; a size-1 (or missing) dim stretches. The
// kernel sees the output shape and, per input, element strides with 0 where the
// input is stretched. Backward sums the gradient back to each input's shape
// (sum_to), which is what makes bias adds and per-channel scales differentiable.
Shape broadcast_shape(const char* op, const Shape& a, const Shape& b) {
  std::size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    std::int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    DP_CHECK(da == db || da == 1 || db == 1, op, ": shapes ", shape_str(a), " and ", shape_str(b),
             " cannot be broadcast (dim ", i, ": ", da, " vs ", db, ")");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

// Strides of `in` (contiguous) read as shape `out` with broadcasting.
void broadcast_strides(const Shape& in, const Shape& out, std::int64_t* strides) {
  std::size_t n = out.size(), off = n - in.size();
  std::int64_t stride = 1;
  for (std::size_t i = n; i-- > 0;) {
    if (i < off) {
      strides[i] = 0;
      continue;
    }
    std::int64_t s = in[i - off];
    strides[i] = s == 1 ? 0 : stride;
    stride *= s;
  }
}

// Builds an indexer over `out`, merging adjacent dims where both inputs stay
// contiguous so common cases reach the kernel's fast paths.
Indexer make_indexer(const Shape& a, const Shape& b, const Shape& out) {
  DP_CHECK(static_cast<int>(out.size()) <= backend::kMaxDims, "expected at most ", backend::kMaxDims,
           " dims, got shape ", shape_str(out));
  std::int64_t sa[backend::kMaxDims], sb[backend::kMaxDims];
  broadcast_strides(a, out, sa);
  broadcast_strides(b, out, sb);
  Indexer ix;
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (out[i] == 1) continue;  // size-1 dims carry no information
    if (ix.ndim > 0) {
      int j = ix.ndim - 1;
      // dim i merges into the indexer's last dim j when stepping j equals stepping i over
      // its whole extent. j's strides are the indexer's (after earlier merges and skipped
      // size-1 dims j is not dim j of `out`): comparing with dim j of `out` merged, e.g.,
      // (2, 2, 1, 4) broadcast to (2, 2, 5, 4) into 4 x 20 rows, a wrong walk.
      bool ok_a = ix.strides_a[j] == sa[i] * out[i];
      bool ok_b = ix.strides_b[j] == sb[i] * out[i];
      if (ok_a && ok_b) {
        ix.sizes[j] *= out[i];
        ix.strides_a[j] = sa[i];
        ix.strides_b[j] = sb[i];
        continue;
      }
    }
    ix.sizes[ix.ndim] = out[i];
    ix.strides_a[ix.ndim] = sa[i];
    ix.strides_b[ix.ndim] = sb[i];
    ++ix.ndim;
  }
  if (ix.ndim == 0) {  // a scalar result
    ix.ndim = 1;
    ix.sizes[0] = 1;
    ix.strides_a[0] = 0;
    ix.strides_b[0] = 0;
  }
  return ix;
}

bool is_16bit(const Tensor& t) { return t.dtype() == Dtype::BFloat16 || t.dtype() == Dtype::Float16; }

// Note [16-bit backward formulas]
// A backward formula of several ops run on 16-bit tensors rounds after every op. Where
// PyTorch has a fused backward kernel — tanh's g·(1 − y²), sigmoid's g·y·(1 − y) —
// that kernel computes in float32 and rounds once, and so does dp: f on the gradient and
// the saved tensors widened (exactly), its result rounded once to the gradient's dtype
// (PyTorch's bits; half_tensor_test). Where PyTorch
// composes the formula from 16-bit ops (reciprocal's −g·y², erf's g·2/√π·exp(−x²)), dp
// composes the same ops in the same order and rounds where it does, which gives its bits
// too; sqrt's g / (2y) and the scalar ops' one rounding either way.
template <typename F, typename... T>
Tensor backward_rounded_once(F f, const Tensor& g, const T&... saved) {
  if (!is_16bit(g) && !(is_16bit(saved) || ...)) return f(g, saved...);
  auto wide = [](const Tensor& t) { return t.dtype() == Dtype::Float32 ? t : t.to(Dtype::Float32); };
  return f(wide(g), wide(saved)...).to(g.dtype());
}

// The dtype an op of two floating operands computes in (Note [16-bit tensors]): theirs
// when they agree, else float32. Anything else is left to the op's own checks.
Dtype common_dtype(const Tensor& a, const Tensor& b) {
  if (a.dtype() == b.dtype() || !is_floating_point(a.dtype()) || !is_floating_point(b.dtype())) return a.dtype();
  return Dtype::Float32;
}
bool mixed_floating(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.dtype() != b.dtype() && is_floating_point(a.dtype()) &&
         is_floating_point(b.dtype());
}

// An op of Note [Autocast op policy]'s float32 list inside an autocast scope: f on its
// input in float32, with the scope suspended.
template <typename F>
Tensor autocast_f32(F f, const Tensor& a) {
  amp::detail::Suspend inner;
  return f(amp::detail::cast(a, Dtype::Float32));
}

Tensor binary_raw(const char* op, BinaryOp kind, const Tensor& a, const Tensor& b) {
  detail::check_same_device(op, a, b);
  detail::check_floating(op, a, "first input");
  detail::check_floating(op, b, "second input");
  DP_ASSERT(a.dtype() == b.dtype(), op, ": operands of one dtype expected here, got ", dtype_name(a.dtype()),
            " and ", dtype_name(b.dtype()));
  Shape out_shape = broadcast_shape(op, a.shape(), b.shape());
  if (detail::elementwise_format(a, b) == MemoryFormat::ChannelsLast) {
    // Two channels-last operands of one shape: element i of each is the same (n, c, h,
    // w), so the op runs over the bytes as they lie (Note [Channels-last tensors]).
    Tensor out = detail::empty_in(out_shape, TensorOptions{a.dtype(), a.device()}, MemoryFormat::ChannelsLast);
    if (out.numel() == 0) return out;
    Indexer ix = make_indexer(a.shape(), a.shape(), out_shape);
    be(a).run<Op::Binary>(a.device(), detail::kernel_dtype(a.dtype()),
                          {kind, ix, detail::layout_data(a), detail::layout_data(b), detail::layout_data(out)});
    return out;
  }
  Tensor out = empty(out_shape, TensorOptions{a.dtype(), a.device()});
  if (out.numel() == 0) return out;
  Indexer ix = make_indexer(a.shape(), b.shape(), out_shape);
  be(a).run<Op::Binary>(a.device(), detail::kernel_dtype(a.dtype()), {kind, ix, a.raw_data(), b.raw_data(), out.raw_data()});
  return out;
}

// Unary and affine ops map element i to element i: they keep their input's layout
// (Note [Channels-last tensors]).
Tensor unary_raw(const char* op, UnaryOp kind, const Tensor& a) {
  detail::check_floating(op, a);
  Tensor out = detail::empty_in(a.shape(), TensorOptions{a.dtype(), a.device()}, a.suggest_memory_format());
  be(a).run<Op::Unary>(a.device(), detail::kernel_dtype(a.dtype()),
                       {kind, detail::layout_data(a), detail::layout_data(out), a.numel()});
  return out;
}

Tensor affine_raw(const Tensor& a, double alpha, double beta) {
  detail::check_floating("affine", a);
  Tensor out = detail::empty_in(a.shape(), TensorOptions{a.dtype(), a.device()}, a.suggest_memory_format());
  be(a).run<Op::Affine>(a.device(), detail::kernel_dtype(a.dtype()),
                        {detail::layout_data(a), detail::layout_data(out), a.numel(), static_cast<float>(alpha),
                         static_cast<float>(beta)});
  return out;
}

// Materialises `g` broadcast to `shape`.
Tensor expand_to(const Tensor& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  Tensor out = empty(shape, TensorOptions{g.dtype(), g.device()});
  if (out.numel() == 0) return out;
  broadcast_shape("expand", g.shape(), shape);
  Indexer ix = make_indexer(g.shape(), g.shape(), shape);
  be(g).run<Op::StridedCopy>(g.device(), detail::kernel_dtype(g.dtype()), {ix, g.raw_data(), out.raw_data()});
  return out;
}

}  // namespace

Tensor detail::broadcast_source(const Tensor& t, const Shape& shape) {
  if (t.shape() == shape) return t;
  if (t.dtype() == Dtype::Int32) return expand_to(t.to(Dtype::Int64), shape).to(Dtype::Int32);  // exact both ways
  Tensor out = expand_to(t, shape);
  if (is_floating_point(t.dtype())) {
    Shape from = t.shape();
    autograd::record("ExpandBackward", {t}, out, {},
                     [from](const std::vector<Tensor>& g) { return std::vector<Tensor>{sum_to(g[0], from)}; });
  }
  return out;
}

Tensor Tensor::expand(const Shape& shape) const {
  const auto n = static_cast<std::int64_t>(shape.size());
  DP_CHECK(n >= dim(), "expand: expected at least ", dim(), " sizes for shape ", shape_str(this->shape()), ", got ",
           shape_str(shape));
  Shape target = shape;
  const std::int64_t lead = n - dim();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t own = i >= lead ? this->shape()[static_cast<std::size_t>(i - lead)] : 1;
    auto& want = target[static_cast<std::size_t>(i)];
    DP_CHECK(want != -1 || i >= lead, "expand: -1 at new leading dim ", i, " of ", shape_str(shape),
             "; expected a size there");
    if (want == -1) want = own;
    DP_CHECK(want >= 0 && (own == want || own == 1), "expand: cannot expand shape ", shape_str(this->shape()),
             " to ", shape_str(shape), ": dim ", i, " has size ", own, ", expected it to be 1 or ", want);
  }
  detail::check_floating("expand", *this);
  Tensor out = expand_to(*this, target);
  if (out.impl() == impl())
    out = out.detach();  // the same shape: a new handle on the same storage
  else
    out.impl()->copied_view = "expand()";  // Note [Writes into materialised views]
  Shape from = this->shape();
  autograd::record("ExpandBackward", {*this}, out, {},
                   [from](const std::vector<Tensor>& g) { return std::vector<Tensor>{sum_to(g[0], from)}; });
  return out;
}

namespace {

std::int64_t norm_dim(const char* op, const Tensor& a, std::int64_t d) {
  std::int64_t n = a.dim();
  DP_CHECK(d >= -n && d < n, op, ": expected a dim in [", -n, ", ", n, "), got ", d, " for shape ",
           shape_str(a.shape()));
  return d < 0 ? d + n : d;
}

struct ReduceGeometry {
  std::int64_t outer = 1, r = 1, inner = 1;
  Shape out_keep, out;
};

ReduceGeometry reduce_geometry(const Tensor& a, std::int64_t d) {
  ReduceGeometry g;
  const Shape& s = a.shape();
  for (std::int64_t i = 0; i < d; ++i) g.outer *= s[i];
  g.r = s[d];
  for (std::size_t i = d + 1; i < s.size(); ++i) g.inner *= s[i];
  g.out_keep = s;
  g.out_keep[d] = 1;
  g.out = s;
  g.out.erase(g.out.begin() + d);
  return g;
}

Tensor reduce_raw(ReduceOp op, const Tensor& a, std::int64_t d, bool keepdim) {
  // 16-bit: accumulate in float32, round once (Note [16-bit tensors]).
  if (is_16bit(a)) return detail::cast_raw(reduce_raw(op, detail::cast_raw(a, Dtype::Float32), d, keepdim), a.dtype());
  ReduceGeometry g = reduce_geometry(a, d);
  Tensor out = empty(keepdim ? g.out_keep : g.out, a.device());
  be(a).run<Op::Reduce>(a.device(), DType::F32, {op, a.data<float>(), out.data<float>(), g.outer, g.r, g.inner});
  return out;
}

Tensor sum_all_raw(const Tensor& a) {
  if (is_16bit(a)) return detail::cast_raw(sum_all_raw(detail::cast_raw(a, Dtype::Float32)), a.dtype());
  Tensor out = empty({}, a.device());
  be(a).run<Op::Reduce>(a.device(), DType::F32,
                        {ReduceOp::Sum, a.data<float>(), out.data<float>(), 1, a.numel(), 1});
  return out;
}

}  // namespace

// ---- binary ------------------------------------------------------------------------------

Tensor add(const Tensor& a, const Tensor& b) {
  if (mixed_floating(a, b)) return add(a.to(common_dtype(a, b)), b.to(common_dtype(a, b)));
  Tensor out = binary_raw("add", BinaryOp::Add, a, b);
  Shape sa = a.shape(), sb = b.shape();
  autograd::record("AddBackward", {a, b}, out, {}, [sa, sb](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{sum_to(g[0], sa), sum_to(g[0], sb)};
  });
  return out;
}

Tensor sub(const Tensor& a, const Tensor& b) {
  if (mixed_floating(a, b)) return sub(a.to(common_dtype(a, b)), b.to(common_dtype(a, b)));
  Tensor out = binary_raw("sub", BinaryOp::Sub, a, b);
  Shape sa = a.shape(), sb = b.shape();
  autograd::record("SubBackward", {a, b}, out, {}, [sa, sb](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{sum_to(g[0], sa), sum_to(neg(g[0]), sb)};
  });
  return out;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  if (mixed_floating(a, b)) return mul(a.to(common_dtype(a, b)), b.to(common_dtype(a, b)));
  Tensor out = binary_raw("mul", BinaryOp::Mul, a, b);
  bool ga = a.requires_grad(), gb = b.requires_grad();
  autograd::record("MulBackward", {a, b}, out, {gb ? a : Tensor(), ga ? b : Tensor()}, [a, b, ga, gb](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{ga ? sum_to(mul(g[0], b), a.shape()) : Tensor(),
                               gb ? sum_to(mul(g[0], a), b.shape()) : Tensor()};
  });
  return out;
}

Tensor div(const Tensor& a, const Tensor& b) {
  if (mixed_floating(a, b)) return div(a.to(common_dtype(a, b)), b.to(common_dtype(a, b)));
  Tensor out = binary_raw("div", BinaryOp::Div, a, b);
  bool gb = b.requires_grad();
  autograd::record("DivBackward", {a, b}, out, {b, gb ? out : Tensor()}, [a, b, out = out.detach(), gb](const std::vector<Tensor>& g) {
    Tensor ga = sum_to(div(g[0], b), a.shape());
    Tensor gbv = gb ? sum_to(neg(div(mul(g[0], out), b)), b.shape()) : Tensor();
    return std::vector<Tensor>{ga, gbv};
  });
  return out;
}

Tensor maximum(const Tensor& a, const Tensor& b) {
  if (mixed_floating(a, b)) return maximum(a.to(common_dtype(a, b)), b.to(common_dtype(a, b)));
  Tensor out = binary_raw("maximum", BinaryOp::Maximum, a, b);
  autograd::record("MaximumBackward", {a, b}, out, {a, b}, [a, b](const std::vector<Tensor>& g) {
    Tensor a_wins = binary_raw("maximum", BinaryOp::Gt, a, b);  // ties go to b
    Tensor ga = mul(g[0], a_wins);
    Tensor gb = sub(g[0], ga);
    return std::vector<Tensor>{sum_to(ga, a.shape()), sum_to(gb, b.shape())};
  });
  return out;
}

Tensor add(const Tensor& a, double s) {
  Tensor out = affine_raw(a, 1.0, s);
  autograd::record("AddScalarBackward", {a}, out, {},
                   [](const std::vector<Tensor>& g) { return std::vector<Tensor>{g[0]}; });
  return out;
}

Tensor mul(const Tensor& a, double s) {
  Tensor out = affine_raw(a, s, 0.0);
  autograd::record("MulScalarBackward", {a}, out, {},
                   [s](const std::vector<Tensor>& g) { return std::vector<Tensor>{mul(g[0], s)}; });
  return out;
}

Tensor div(const Tensor& a, double s) {
  // A true division, as PyTorch's `t / 3.0`: a * (1 / 3) rounds twice and differs from
  // it in the last bit for about a third of the values. A 16-bit tensor divides in
  // float32 and rounds once more, as PyTorch's float opmath.
  if (is_16bit(a)) return div(a.to(Dtype::Float32), s).to(a.dtype());
  Tensor out = binary_raw("div", BinaryOp::Div, a, scalar_tensor(s, a.device()));
  autograd::record("DivScalarBackward", {a}, out, {},
                   [s](const std::vector<Tensor>& g) { return std::vector<Tensor>{div(g[0], s)}; });
  return out;
}

Tensor sub(double s, const Tensor& a) {
  // fl(s - a) in one rounding: -1 * a is exact, so the affine's one add is the rounding.
  Tensor out = affine_raw(a, -1.0, s);
  autograd::record("RsubScalarBackward", {a}, out, {},
                   [](const std::vector<Tensor>& g) { return std::vector<Tensor>{neg(g[0])}; });
  return out;
}

Tensor div(double s, const Tensor& a) {
  if (is_16bit(a)) return div(s, a.to(Dtype::Float32)).to(a.dtype());  // one rounding
  // PyTorch 1.13's Tensor.__rdiv__ is `self.reciprocal() * other`: the same two
  // roundings here, with the multiply as a float32 binary op (an affine's `+ 0` would
  // turn a -0 into +0).
  Tensor r = unary_raw("div", UnaryOp::Reciprocal, a);
  Tensor out = binary_raw("div", BinaryOp::Mul, r, scalar_tensor(s, a.device()));
  autograd::record("RdivScalarBackward", {a}, out, {}, [r, s](const std::vector<Tensor>& g) {
    // d(s / a)/da = -s / a^2 = -(s * g) * r^2, in reciprocal's backward order.
    return std::vector<Tensor>{backward_rounded_once(
        [s](const Tensor& gg, const Tensor& rr) { return neg(mul(mul(gg, s), mul(rr, rr))); }, g[0], r)};
  });
  return out;
}

Tensor pow(const Tensor& a, double p) {
  if (amp::detail::active()) return autocast_f32([p](const Tensor& x) { return pow(x, p); }, a);
  if (is_16bit(a)) return pow(a.to(Dtype::Float32), p).to(a.dtype());  // one rounding
  Tensor out = binary_raw("pow", BinaryOp::Pow, a, scalar_tensor(p, a.device()));
  autograd::record("PowBackward", {a}, out, {a}, [a, p](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{mul(mul(g[0], pow(a, p - 1.0)), p)};
  });
  return out;
}

Tensor eq(const Tensor& a, const Tensor& b) {
  detail::check_same_device("eq", a, b);
  // Integer labels against integer predictions: int32 widens to int64 (exact), so
  // int32 labels compare with argmax's int64 output as PyTorch's type promotion does.
  if (is_16bit(a) || is_16bit(b)) return eq(detail::cast_raw(a, Dtype::Float32), detail::cast_raw(b, Dtype::Float32));
  const bool ints_a = a.dtype() != Dtype::Float32, ints_b = b.dtype() != Dtype::Float32;
  DP_CHECK(ints_a == ints_b, "eq: expected one dtype (or int32 with int64), got ",
           dtype_name(a.dtype()), " and ", dtype_name(b.dtype()));
  if (a.dtype() == Dtype::Int32 || b.dtype() == Dtype::Int32)
    return eq(a.to(Dtype::Int64), b.to(Dtype::Int64));
  if (a.dtype() == Dtype::Int64) {
    // int64 compares exactly on the device (a cast to float32 would round above 2^24).
    Shape out_shape = broadcast_shape("eq", a.shape(), b.shape());
    Tensor out = empty(out_shape, a.device());
    if (out.numel() == 0) return out;
    Indexer ix = make_indexer(a.shape(), b.shape(), out_shape);
    be(a).run<Op::Binary>(a.device(), DType::I64,
                          {BinaryOp::Eq, ix, a.data<std::int64_t>(), b.data<std::int64_t>(), out.data<float>()});
    return out;
  }
  return binary_raw("eq", BinaryOp::Eq, a, b);
}

// ---- comparisons (Note [Comparison results] in ops.h) -----------------------------------

namespace {

// The ordering comparisons take float32 only: an int64 above 2^24 has no exact float32,
// and the backend compares integers for equality alone.
void check_ordering(const char* op, const Tensor& a, const Tensor& b) {
  detail::check_same_device(op, a, b);
  DP_CHECK(is_floating_point(a.dtype()) && is_floating_point(b.dtype()), op, ": expected floating tensors, got ",
           dtype_name(a.dtype()), " and ", dtype_name(b.dtype()),
           "; integer tensors compare with == and != only (for an order, convert with .to(dp::Dtype::Float32))");
}

// An integer tensor against a scalar: the scalar as an int64 when it is a whole number
// inside int64's range; std::nullopt when no integer equals it.
std::optional<Tensor> integer_scalar(const Tensor& a, double s) {
  constexpr double kTwo63 = 9223372036854775808.0;  // 2^63, exact
  if (!(s == std::nearbyint(s) && s >= -kTwo63 && s < kTwo63)) return std::nullopt;
  return full({}, s, TensorOptions{Dtype::Int64, a.device()});
}

}  // namespace

Tensor ne(const Tensor& a, const Tensor& b) {
  return affine_raw(eq(a, b), -1.0, 1.0);  // 1 - (a == b): exact on 0 and 1; NaN != NaN holds
}

Tensor gt(const Tensor& a, const Tensor& b) {
  check_ordering("gt (>)", a, b);
  if (is_16bit(a) || is_16bit(b)) return gt(detail::cast_raw(a, Dtype::Float32), detail::cast_raw(b, Dtype::Float32));
  return binary_raw("gt (>)", BinaryOp::Gt, a, b);
}

Tensor lt(const Tensor& a, const Tensor& b) {
  check_ordering("lt (<)", a, b);
  broadcast_shape("lt (<)", a.shape(), b.shape());  // the shapes named in the caller's order
  return gt(b, a);
}

Tensor ge(const Tensor& a, const Tensor& b) {
  check_ordering("ge (>=)", a, b);
  if (is_16bit(a) || is_16bit(b)) return ge(detail::cast_raw(a, Dtype::Float32), detail::cast_raw(b, Dtype::Float32));
  // a > b and a == b never both hold, so their sum is 0 or 1, and 0 where either is NaN.
  return binary_raw("ge (>=)", BinaryOp::Add, binary_raw("ge (>=)", BinaryOp::Gt, a, b),
                    binary_raw("ge (>=)", BinaryOp::Eq, a, b));
}

Tensor le(const Tensor& a, const Tensor& b) {
  check_ordering("le (<=)", a, b);
  broadcast_shape("le (<=)", a.shape(), b.shape());
  return ge(b, a);
}

Tensor eq(const Tensor& a, double s) {
  detail::check_defined("eq (==)", a);
  if (is_floating_point(a.dtype())) return eq(detail::cast_raw(a, Dtype::Float32), scalar_tensor(s, a.device()));
  std::optional<Tensor> si = integer_scalar(a, s);
  return si ? eq(a, *si) : zeros(a.shape(), a.device());
}

Tensor ne(const Tensor& a, double s) { return affine_raw(eq(a, s), -1.0, 1.0); }

Tensor gt(const Tensor& a, double s) {
  detail::check_defined("gt (>)", a);
  return gt(a, scalar_tensor(s, a.device()));
}
Tensor lt(const Tensor& a, double s) {
  detail::check_defined("lt (<)", a);
  return lt(a, scalar_tensor(s, a.device()));
}
Tensor ge(const Tensor& a, double s) {
  detail::check_defined("ge (>=)", a);
  return ge(a, scalar_tensor(s, a.device()));
}
Tensor le(const Tensor& a, double s) {
  detail::check_defined("le (<=)", a);
  return le(a, scalar_tensor(s, a.device()));
}

// ---- selection (Note [Conditions are float32] in ops.h) ------------------------------------

namespace {

// where's geometry over `out`: a and b in ix's strides, cond in strides_cond; size-1 dims
// dropped and neighbours merged where all three operands stay contiguous (as make_indexer
// does for two), so a mask over (T, T) and scores over (B, H, T, T) walk T*T-long rows.
backend::WhereArgs where_geometry(const Shape& cond, const Shape& a, const Shape& b, const Shape& out) {
  DP_CHECK(static_cast<int>(out.size()) <= backend::kMaxDims, "where: expected at most ", backend::kMaxDims,
           " dims, got shape ", shape_str(out));
  std::int64_t in[3][backend::kMaxDims];
  broadcast_strides(cond, out, in[0]);
  broadcast_strides(a, out, in[1]);
  broadcast_strides(b, out, in[2]);
  backend::WhereArgs w{};
  Indexer& ix = w.ix;
  std::int64_t* st[3] = {w.strides_cond, ix.strides_a, ix.strides_b};
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (out[i] == 1) continue;
    const int j = ix.ndim - 1;
    bool merge = j >= 0;
    for (int k = 0; k < 3 && merge; ++k) merge = st[k][j] == in[k][i] * out[i];
    const int at = merge ? j : ix.ndim++;
    ix.sizes[at] = merge ? ix.sizes[at] * out[i] : out[i];
    for (int k = 0; k < 3; ++k) st[k][at] = in[k][i];
  }
  if (ix.ndim == 0) {  // one element; every stride stays 0
    ix.ndim = 1;
    ix.sizes[0] = 1;
  }
  return w;
}

// out = cond ? a : b for a and b of one floating dtype, not recorded.
Tensor where_raw(const Tensor& cond, const Tensor& a, const Tensor& b) {
  const char* op = "where";
  DP_ASSERT(a.dtype() == b.dtype(), op, ": values of one dtype expected here, got ", dtype_name(a.dtype()), " and ",
            dtype_name(b.dtype()));
  Shape out_shape;
  try {
    out_shape = broadcast_shape(op, broadcast_shape(op, cond.shape(), a.shape()), b.shape());
  } catch (const Error&) {
    DP_FAIL("where: expected cond, a and b whose shapes broadcast together, got ", shape_str(cond.shape()), ", ",
            shape_str(a.shape()), " and ", shape_str(b.shape()));
  }
  Tensor out = empty(out_shape, TensorOptions{a.dtype(), a.device()});
  if (out.numel() == 0) return out;
  backend::WhereArgs w = where_geometry(cond.shape(), a.shape(), b.shape(), out_shape);
  w.cond = cond.data<float>();
  w.a = a.raw_data();
  w.b = b.raw_data();
  w.out = out.raw_data();
  be(a).run<Op::Where>(a.device(), detail::kernel_dtype(a.dtype()), w);
  return out;
}

// cond as the float32 the kernel reads (Note [Conditions are float32]): a 16-bit one
// widens exactly, keeping which values are nonzero; an integer one is refused.
Tensor where_condition(const char* op, const Tensor& cond) {
  detail::check_defined(op, cond, "condition");
  DP_CHECK(is_floating_point(cond.dtype()), op, ": expected a float32 condition (0/1 as comparisons give; "
           "nonzero holds), got ", dtype_name(cond.dtype()), " (", cond.str(),
           "); convert with .to(dp::Dtype::Float32) or compare, e.g. ids != 0");
  return cond.dtype() == Dtype::Float32 ? cond : cond.detach().to(Dtype::Float32);
}

// Keeps element (i, j) of the last two dims where j - i <= diagonal (lower) or
// j - i >= diagonal (upper); zeros elsewhere.
Tensor triangle(const char* op, const Tensor& x, std::int64_t diagonal, bool lower) {
  detail::check_floating(op, x);
  DP_CHECK(x.dim() >= 2, op, ": expected a tensor with at least 2 dims (..., rows, cols), got shape ",
           shape_str(x.shape()));
  const std::int64_t R = x.size(-2), C = x.size(-1);
  const TensorOptions f32{Dtype::Float32, x.device()};
  // j - i, exact in float32 for any size a tensor here can have along one dim (< 2^24).
  Tensor offset = binary_raw(op, BinaryOp::Sub, arange(C, f32).reshape({1, C}), arange(R, f32).reshape({R, 1}));
  const auto d = static_cast<double>(diagonal);
  return where(lower ? le(offset, d) : ge(offset, d), x, 0.0);
}

}  // namespace

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  const char* op = "where";
  detail::check_floating(op, a, "first value (a)");
  detail::check_floating(op, b, "second value (b)");
  detail::check_same_device(op, a, b);
  if (mixed_floating(a, b)) return where(cond, a.to(common_dtype(a, b)), b.to(common_dtype(a, b)));
  const Tensor c = where_condition(op, cond);
  detail::check_same_device(op, c, a);
  Tensor out = where_raw(c, a, b);
  const bool ga = a.requires_grad(), gb = b.requires_grad();
  autograd::record("WhereBackward", {a, b}, out, {c},
                   [c = c.detach(), sa = a.shape(), sb = b.shape(), ga, gb](const std::vector<Tensor>& g) {
                     return std::vector<Tensor>{ga ? sum_to(where(c, g[0], 0.0), sa) : Tensor(),
                                                gb ? sum_to(where(c, 0.0, g[0]), sb) : Tensor()};
                   });
  return out;
}

// A scalar beside a tensor takes the tensor's dtype (as a Python scalar does in PyTorch).
Tensor where(const Tensor& cond, const Tensor& a, double b) {
  detail::check_floating("where", a, "first value (a)");
  return where(cond, a, scalar_tensor(b, a.device()).to(a.dtype()));
}

Tensor where(const Tensor& cond, double a, const Tensor& b) {
  detail::check_floating("where", b, "second value (b)");
  return where(cond, scalar_tensor(a, b.device()).to(b.dtype()), b);
}

// Note [clamp's gradient]
// Values: max then min, so that min > max gives max everywhere, as PyTorch's; NaN fails
// both comparisons and stays NaN. The gradient passes where min < x < max STRICTLY and
// is zero at a bound and at NaN: measured in PyTorch 2.15 (clamp(x, -0.5, 0.5) gives x
// = ±0.5 a zero gradient), where a composition of where() would pass it at the bounds
// and at NaN. The bounds are rounded to float32 first: PyTorch compares in float32
// (opmath) for float32 and 16-bit tensors alike, so clamp(0.1f, 0.1) is at its bound
// (gradient 0), not above it.
Tensor clamp(const Tensor& a, std::optional<double> min, std::optional<double> max) {
  detail::check_defined("clamp", a);
  detail::check_floating("clamp", a);
  DP_CHECK(min.has_value() || max.has_value(), "clamp: expected at least one of min and max, got neither (PyTorch "
           "refuses that too)");
  const std::optional<double> lo = min ? std::optional<double>(static_cast<float>(*min)) : std::nullopt;
  const std::optional<double> hi = max ? std::optional<double>(static_cast<float>(*max)) : std::nullopt;
  Tensor out;
  {
    NoGradGuard no_grad;
    Tensor y = a;
    if (lo) y = where(lt(y, *lo), *lo, y);
    if (hi) y = where(gt(y, *hi), *hi, y);
    out = y;
  }
  autograd::record("ClampBackward1", {a}, out, {a}, [x = a.detach(), lo, hi](const std::vector<Tensor>& g) {
    Tensor inside;
    if (lo) inside = gt(x, *lo);
    if (hi) inside = inside.defined() ? mul(inside, lt(x, *hi)) : lt(x, *hi);
    return std::vector<Tensor>{where(inside, g[0], 0.0)};
  });
  return out;
}

Tensor masked_fill(const Tensor& input, const Tensor& mask, double value) {
  detail::check_floating("masked_fill", input);
  detail::check_defined("masked_fill", mask, "mask");
  Shape both;
  try {
    both = broadcast_shape("masked_fill", mask.shape(), input.shape());
  } catch (const Error&) {
  }
  DP_CHECK(both == input.shape(), "masked_fill: expected a mask that broadcasts to the input's shape ",
           shape_str(input.shape()), ", got mask ", shape_str(mask.shape()));
  return where(mask, value, input);
}

Tensor tril(const Tensor& x, std::int64_t diagonal) { return triangle("tril", x, diagonal, true); }
Tensor triu(const Tensor& x, std::int64_t diagonal) { return triangle("triu", x, diagonal, false); }

// ---- unary -------------------------------------------------------------------------------

Tensor neg(const Tensor& a) {
  Tensor out = unary_raw("neg", UnaryOp::Neg, a);
  autograd::record("NegBackward", {a}, out, {},
                   [](const std::vector<Tensor>& g) { return std::vector<Tensor>{neg(g[0])}; });
  return out;
}

Tensor exp(const Tensor& a) {
  if (amp::detail::active()) return autocast_f32([](const Tensor& x) { return exp(x); }, a);
  Tensor out = unary_raw("exp", UnaryOp::Exp, a);
  autograd::record("ExpBackward", {a}, out, {out}, [y = out.detach()](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{mul(g[0], y)};
  });
  return out;
}

Tensor log(const Tensor& a) {
  if (amp::detail::active()) return autocast_f32([](const Tensor& x) { return log(x); }, a);
  Tensor out = unary_raw("log", UnaryOp::Log, a);
  autograd::record("LogBackward", {a}, out, {a},
                   [a](const std::vector<Tensor>& g) { return std::vector<Tensor>{div(g[0], a)}; });
  return out;
}

Tensor sqrt(const Tensor& a) {
  Tensor out = unary_raw("sqrt", UnaryOp::Sqrt, a);
  autograd::record("SqrtBackward", {a}, out, {out}, [y = out.detach()](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{
        backward_rounded_once([](const Tensor& gg, const Tensor& yy) { return div(mul(gg, 0.5), yy); }, g[0], y)};
  });
  return out;
}

Tensor abs(const Tensor& a) {
  Tensor out = unary_raw("abs", UnaryOp::Abs, a);
  autograd::record("AbsBackward", {a}, out, {a}, [a](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{mul(g[0], unary_raw("abs", UnaryOp::Sign, a))};
  });
  return out;
}

Tensor square(const Tensor& a) {
  Tensor out = unary_raw("square", UnaryOp::Square, a);
  autograd::record("SquareBackward", {a}, out, {a}, [a](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{mul(mul(g[0], a), 2.0)};
  });
  return out;
}

Tensor reciprocal(const Tensor& a) {
  Tensor out = unary_raw("reciprocal", UnaryOp::Reciprocal, a);
  autograd::record("ReciprocalBackward", {a}, out, {out}, [y = out.detach()](const std::vector<Tensor>& g) {
    // PyTorch's formula, op by op (in 16 bits, its roundings: Note [16-bit backward formulas]).
    return std::vector<Tensor>{neg(mul(g[0], mul(y, y)))};
  });
  return out;
}

Tensor relu(const Tensor& a) {
  Tensor out = unary_raw("relu", UnaryOp::Relu, a);
  autograd::record("ReluBackward", {a}, out, {out}, [y = out.detach()](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{binary_raw("relu_backward", BinaryOp::ReluBackward, g[0], y)};
  });
  return out;
}

Tensor sigmoid(const Tensor& a) {
  Tensor out = unary_raw("sigmoid", UnaryOp::Sigmoid, a);
  autograd::record("SigmoidBackward", {a}, out, {out}, [y = out.detach()](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{backward_rounded_once(
        [](const Tensor& gg, const Tensor& yy) { return mul(gg, mul(yy, affine_raw(yy, -1.0, 1.0))); }, g[0], y)};
  });
  return out;
}

Tensor tanh(const Tensor& a) {
  Tensor out = unary_raw("tanh", UnaryOp::Tanh, a);
  autograd::record("TanhBackward", {a}, out, {out}, [y = out.detach()](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{backward_rounded_once(
        [](const Tensor& gg, const Tensor& yy) {
          return mul(gg, affine_raw(unary_raw("square", UnaryOp::Square, yy), -1.0, 1.0));
        },
        g[0], y)};
  });
  return out;
}

Tensor erf(const Tensor& a) {
  Tensor out = unary_raw("erf", UnaryOp::Erf, a);
  autograd::record("ErfBackward", {a}, out, {a}, [a](const std::vector<Tensor>& g) {
    // d erf(x) / dx = 2/sqrt(pi) exp(-x^2)
    // PyTorch's formula, op by op (in 16 bits, its roundings: Note [16-bit backward formulas]).
    Tensor e = unary_raw("exp", UnaryOp::Exp, affine_raw(unary_raw("square", UnaryOp::Square, a.detach()), -1.0, 0.0));
    return std::vector<Tensor>{mul(g[0], affine_raw(e, 1.1283791670955126, 0.0))};
  });
  return out;
}

// ---- reductions --------------------------------------------------------------------------

Tensor sum(const Tensor& a) {
  if (amp::detail::active()) return autocast_f32([](const Tensor& x) { return sum(x); }, a);
  detail::check_floating("sum", a);
  if (is_16bit(a)) return sum(a.to(Dtype::Float32)).to(a.dtype());  // Note [16-bit tensors]
  Tensor out = sum_all_raw(a);
  Shape sa = a.shape();
  autograd::record("SumBackward", {a}, out, {},
                   [sa](const std::vector<Tensor>& g) { return std::vector<Tensor>{expand_to(g[0], sa)}; });
  return out;
}

Tensor sum(const Tensor& a, std::int64_t dim, bool keepdim) {
  if (amp::detail::active()) return autocast_f32([=](const Tensor& x) { return sum(x, dim, keepdim); }, a);
  detail::check_floating("sum", a);
  if (is_16bit(a)) return sum(a.to(Dtype::Float32), dim, keepdim).to(a.dtype());
  std::int64_t d = norm_dim("sum", a, dim);
  Tensor out = reduce_raw(ReduceOp::Sum, a, d, keepdim);
  Shape sa = a.shape();
  Shape keep = reduce_geometry(a, d).out_keep;
  autograd::record("SumDimBackward", {a}, out, {}, [sa, keep](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{expand_to(g[0].reshape(keep), sa)};
  });
  return out;
}

Tensor mean(const Tensor& a) {
  if (amp::detail::active()) return autocast_f32([](const Tensor& x) { return mean(x); }, a);
  detail::check_floating("mean", a);
  if (is_16bit(a)) return mean(a.to(Dtype::Float32)).to(a.dtype());  // one rounding, as PyTorch
  DP_CHECK(a.numel() > 0, "mean: expected a non-empty tensor, got shape ", shape_str(a.shape()));
  // The sum divided by n, and the gradient g / n, as PyTorch's CPU mean and its
  // backward: times 1 / n rounds twice, and differed from them in the last bit for
  // about a third of the gradients.
  return div(sum(a), static_cast<double>(a.numel()));
}

Tensor mean(const Tensor& a, std::int64_t dim, bool keepdim) {
  if (amp::detail::active()) return autocast_f32([=](const Tensor& x) { return mean(x, dim, keepdim); }, a);
  detail::check_floating("mean", a);
  if (is_16bit(a)) return mean(a.to(Dtype::Float32), dim, keepdim).to(a.dtype());
  std::int64_t d = norm_dim("mean", a, dim);
  DP_CHECK(a.size(d) > 0, "mean: expected a non-empty dim ", d, ", got shape ", shape_str(a.shape()));
  return div(sum(a, d, keepdim), static_cast<double>(a.size(d)));  // as mean(a) above
}

Tensor argmax(const Tensor& a, std::int64_t dim, bool keepdim) {
  detail::check_floating("argmax", a);
  if (is_16bit(a)) return argmax(detail::cast_raw(a, Dtype::Float32), dim, keepdim);  // widening is exact
  std::int64_t d = norm_dim("argmax", a, dim);
  DP_CHECK(a.size(d) > 0, "argmax: expected a non-empty dim ", d, ", got shape ", shape_str(a.shape()));
  ReduceGeometry g = reduce_geometry(a, d);
  Tensor out = empty(keepdim ? g.out_keep : g.out, TensorOptions{Dtype::Int64, a.device()});
  be(a).run<Op::Argmax>(a.device(), DType::F32,
                        {a.data<float>(), out.data<std::int64_t>(), g.outer, g.r, g.inner});
  return out;
}

Tensor max(const Tensor& a, std::int64_t dim, bool keepdim) {
  detail::check_floating("max", a);
  if (is_16bit(a)) return max(a.to(Dtype::Float32), dim, keepdim).to(a.dtype());  // exact both ways
  std::int64_t d = norm_dim("max", a, dim);
  DP_CHECK(a.size(d) > 0, "max: expected a non-empty dim ", d, ", got shape ", shape_str(a.shape()));
  Tensor out = reduce_raw(ReduceOp::Max, a, d, keepdim);
  autograd::record("MaxBackward", {a}, out, {a}, [a, d](const std::vector<Tensor>& g) {
    // Gradient flows to the first maximum only: a one-hot mask from argmax.
    ReduceGeometry geo = reduce_geometry(a, d);
    Tensor idx = argmax(a, d, true).to(Dtype::Float32);                       // (.., 1, ..)
    Shape pos_shape(a.dim(), 1);
    pos_shape[d] = a.size(d);
    Tensor pos = arange(a.size(d), TensorOptions{Dtype::Float32, a.device()}).reshape(pos_shape);
    Tensor mask = binary_raw("max", BinaryOp::Eq, expand_to(idx, a.shape()), pos);
    return std::vector<Tensor>{mul(mask, expand_to(g[0].reshape(geo.out_keep), a.shape()))};
  });
  return out;
}

Tensor sum_to(const Tensor& a, const Shape& shape) {
  if (a.shape() == shape) return a;
  if (is_16bit(a)) return sum_to(a.to(Dtype::Float32), shape).to(a.dtype());  // one rounding per element
  Tensor cur = a;
  std::size_t lead = cur.shape().size() - shape.size();
  DP_CHECK(cur.shape().size() >= shape.size(), "sum_to: cannot reduce ", shape_str(a.shape()), " to ",
           shape_str(shape));
  for (std::size_t i = 0; i < lead; ++i) cur = sum(cur, 0, false);
  for (std::size_t i = 0; i < shape.size(); ++i)
    if (shape[i] == 1 && cur.shape()[i] != 1) cur = sum(cur, static_cast<std::int64_t>(i), true);
  DP_CHECK(cur.shape() == shape, "sum_to: cannot reduce ", shape_str(a.shape()), " to ", shape_str(shape));
  return cur;
}

// ---- linear algebra ------------------------------------------------------------------------

namespace {

// c (m×n) = op(a) * op(b) + beta * c for 2-d floating tensors of one dtype on one device
// (no autograd); 16-bit products accumulate in float32 (Note [16-bit tensors]).
void gemm_into(const Tensor& a, bool ta, const Tensor& b, bool tb, float beta, const Tensor& c, void* out,
               const Tensor& bias = {}) {
  const std::int64_t m = ta ? a.size(1) : a.size(0), k = ta ? a.size(0) : a.size(1);
  const std::int64_t n = tb ? b.size(0) : b.size(1);
  DP_ASSERT(c.dim() == 2 && c.size(0) == m && c.size(1) == n && c.device() == a.device(), "gemm: output ",
            c.str(), " for a (", m, ", ", n, ") product");
  if (c.numel() == 0) return;
  if (k == 0 && !bias.defined()) {  // nothing to add; beta 0 overwrites
    if (beta == 0.0f) be(a).run<Op::Fill>(a.device(), detail::kernel_dtype(c.dtype()), {out, c.numel(), 0.0f});
    return;
  }
  const backend::GemmEpilogue ep{bias.defined() ? bias.raw_data() : nullptr};
  be(a).run<Op::Gemm>(
      a.device(), detail::kernel_dtype(a.dtype()),
      {ta, tb, m, n, k, 1.0f, a.raw_data(), std::max<std::int64_t>(1, a.size(1)), b.raw_data(),
       std::max<std::int64_t>(1, b.size(1)), beta, out, std::max<std::int64_t>(1, n), ep});
}

// c = op(a) * op(b) (+ bias, a row of n in a's dtype, in the one rounding of a 16-bit
// product: GemmEpilogue), a fresh tensor.
Tensor gemm_raw(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& bias = {}) {
  Tensor c = empty({ta ? a.size(1) : a.size(0), tb ? b.size(0) : b.size(1)}, TensorOptions{a.dtype(), a.device()});
  if (c.numel() > 0) gemm_into(a, ta, b, tb, 0.0f, c, c.raw_data(), bias);
  return c;
}

// The gradient op(a) * op(b) for input `input_nr` of the node running this backward:
// added into that leaf's .grad when the engine lends it (Note [Gradients added in
// place]), written over it when the .grad is known to hold only +0 (Note [Gradients
// written over zeros]), else a fresh tensor.
Tensor grad_gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, int input_nr) {
  autograd::GradSink sink = autograd::grad_sink(input_nr);
  if (!sink) return gemm_raw(a, ta, b, tb);
  const Tensor& c = sink.grad();
  if (c.numel() > 0 && (ta ? a.size(0) : a.size(1)) > 0) {
    autograd::GradientWriteScope scope;
    gemm_into(a, ta, b, tb, sink.zeros() ? 0.0f : 1.0f, c, c.mutable_raw_data());
  }
  return c;
}

}  // namespace

namespace {

// c[i] = op(a[i]) * op(b[i]) for (batch, rows, cols) float tensors on one device: one
// batched GEMM (no autograd).
Tensor bmm_raw(const Tensor& a, bool ta, const Tensor& b, bool tb) {
  const std::int64_t batch = a.size(0);
  const std::int64_t m = ta ? a.size(2) : a.size(1), k = ta ? a.size(1) : a.size(2);
  const std::int64_t n = tb ? b.size(1) : b.size(2);
  Tensor c = empty({batch, m, n}, TensorOptions{a.dtype(), a.device()});
  if (c.numel() == 0) return c;
  if (k == 0) return c.zero_();
  backend::GemmArgs args{ta, tb, m, n, k, 1.0f, a.raw_data(), a.size(2), b.raw_data(), b.size(2), 0.0f, c.raw_data(),
                         n, {}};
  args.batch = batch;  // one batched product (GemmArgs): one strided-batched call on CUDA
  args.stride_a = a.size(1) * a.size(2);
  args.stride_b = b.size(1) * b.size(2);
  args.stride_c = m * n;
  be(a).run<Op::Gemm>(a.device(), detail::kernel_dtype(a.dtype()), args);
  return c;
}

// (batch, m, k) x (batch, k, n), differentiable.
Tensor bmm(const Tensor& a, const Tensor& b) {
  Tensor out = bmm_raw(a, false, b, false);
  const bool ga = a.requires_grad(), gb = b.requires_grad();
  autograd::record("BmmBackward", {a, b}, out, {gb ? a : Tensor(), ga ? b : Tensor()}, [a, b, ga, gb](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{ga ? bmm_raw(g[0], false, b, true) : Tensor(),
                               gb ? bmm_raw(a, true, g[0], false) : Tensor()};
  });
  return out;
}

// (m, k) x (k, n): the 2-d product, its gradients written into the leaves' .grad where
// the engine lends them.
Tensor matmul_2d(const Tensor& a, const Tensor& b) {
  Tensor out = gemm_raw(a, false, b, false);
  bool ga = a.requires_grad(), gb = b.requires_grad();
  autograd::record("MatmulBackward", {a, b}, out, {gb ? a : Tensor(), ga ? b : Tensor()}, [a, b, ga, gb](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{ga ? grad_gemm(g[0], false, b, true, 0) : Tensor(),
                               gb ? grad_gemm(a, true, g[0], false, 1) : Tensor()};
  });
  return out;
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  if (amp::detail::active()) {  // Note [Autocast op policy]: the lower-precision list
    const Dtype low = amp::detail::lower();
    amp::detail::Suspend inner;
    return matmul(amp::detail::cast(a, low), amp::detail::cast(b, low));
  }
  detail::check_same_device("matmul", a, b);
  detail::check_floating("matmul", a, "first input");
  detail::check_floating("matmul", b, "second input");
  DP_CHECK(a.dtype() == b.dtype(), "matmul: expected operands of one dtype, got ", dtype_name(a.dtype()), " and ",
           dtype_name(b.dtype()), " (convert one with .to(dtype), or run under dp::amp::autocast)");
  DP_CHECK(a.dim() >= 1 && b.dim() >= 1, "matmul: expected operands with at least 1 dim, got ",
           shape_str(a.shape()), " x ", shape_str(b.shape()));
  const std::int64_t k_a = a.size(a.dim() - 1), k_b = b.dim() == 1 ? b.size(0) : b.size(b.dim() - 2);
  DP_CHECK(k_a == k_b, "matmul: expected (..., m, k) x (..., k, n) with the same k, got ", shape_str(a.shape()), " x ",
           shape_str(b.shape()), " (k ", k_a, " vs ", k_b, ")");
  if (a.dim() == 2 && b.dim() == 2) return matmul_2d(a, b);
  if (a.dim() == 1 && b.dim() == 1) return matmul_2d(a.unsqueeze(0), b.unsqueeze(1)).reshape({});  // a dot
  if (a.dim() == 1) return matmul(a.unsqueeze(0), b).squeeze(-2);
  if (b.dim() == 1) return matmul(a, b.unsqueeze(1)).squeeze(-1);
  const std::int64_t m = a.size(a.dim() - 2), n = b.size(b.dim() - 1);
  Shape a_batch(a.shape().begin(), a.shape().end() - 2), b_batch(b.shape().begin(), b.shape().end() - 2);
  if (b.dim() == 2) {  // every row of every batch times one matrix: one GEMM
    Shape out_shape = a_batch;
    out_shape.push_back(m);
    out_shape.push_back(n);
    return matmul_2d(a.reshape({shape_numel(a_batch) * m, k_a}), b).reshape(out_shape);
  }
  Shape batch;
  try {
    batch = broadcast_shape("matmul", a_batch, b_batch);
  } catch (const Error&) {
    DP_FAIL("matmul: the batch dims of ", shape_str(a.shape()), " and ", shape_str(b.shape()),
            " do not broadcast (", shape_str(a_batch), " vs ", shape_str(b_batch), ")");
  }
  auto full = [&](const Tensor& t, std::int64_t r, std::int64_t c) {
    Shape s = batch;
    s.push_back(r);
    s.push_back(c);
    return (t.shape() == s ? t : t.expand(s)).reshape({shape_numel(batch), r, c});
  };
  Shape out_shape = batch;
  out_shape.push_back(m);
  out_shape.push_back(n);
  return bmm(full(a, m, k_a), full(b, k_a, n)).reshape(out_shape);
}

namespace {

// Note [ReLU mask in the input gradient]
// In an MLP, Linear-ReLU-Linear, the second Linear's backward computed its input
// gradient gx = gy W, and the first one's backward then masked it by its ReLU's output
// y (Binary<ReluBackward>: y > 0 ? gx : 0), one more pass that read gx and y back from
// memory and wrote a third tensor as large. When a Linear's input x is a linear_relu's
// output (x is that y), its backward masks gx itself, each GEMM chunk its slab while
// it is in cache (Backend::linear_backward_input), and tells that linear_relu's
// backward so through a note on this thread naming the gradient and the mask's
// storage; finding the same gradient tensor and its own output's storage there, it
// uses the gradient as it is. Anything else — the gradient summed with another path's,
// another thread — misses the note and masks as before, which changes nothing: the
// mask applied twice is the mask applied once. The same element op on the same values
// gives the same bits (tested against the unfused ops). MLP 784-1024-1024-10, batch
// 512 on the Zen 5 EPYC: the two ReLU backward passes were 1.2 % of the step's CPU
// samples.

constexpr const char* kLinearReluBackward = "LinearReluBackward";

// The input gradient a Linear's backward last masked on this thread, and the storage of
// the ReLU output it masked with.
struct MaskedGrad {
  std::weak_ptr<TensorImpl> grad;
  const Storage* by = nullptr;
};
thread_local MaskedGrad t_masked_grad;

// True (and the note is used up) when g is the gradient a Linear's backward masked
// with y's storage.
bool masked_by(const Tensor& g, const Tensor& y) {
  const std::shared_ptr<TensorImpl> noted = t_masked_grad.grad.lock();
  const bool hit = noted != nullptr && noted == g.impl_ptr() && t_masked_grad.by == y.storage().get();
  if (hit) t_masked_grad = {};
  return hit;
}

// x is output 0 of a linear_relu (its ReLU's output, which its backward masks by).
bool is_linear_relu_output(const Tensor& x) {
  const std::shared_ptr<autograd::Node> fn = x.grad_fn();
  const auto* node = dynamic_cast<const autograd::LambdaNode*>(fn.get());
  return node != nullptr && x.impl()->autograd->output_nr == 0 && node->is(kLinearReluBackward);
}

// Note [16-bit Linear: the bias in the one rounding]
// A bfloat16 or float16 linear forms each output as one float32 value — the products
// summed in float32 plus the bias — and rounds it once (the Gemm op's GemmEpilogue bias:
// oneDNN's matmul bias on the CPU, the widened float32 pass elsewhere, on CUDA C filled
// with the bias and cuBLAS adding the product with beta = 1: Note [16-bit GEMMs on
// CUDA]). That is PyTorch's: at::linear folds a 2-d or contiguous 3-d input
// into addmm, whose CPU kernels (oneDNN with C filled with the bias and beta = 1, or its
// own GEMM into that C) and CUDA kernel (cuBLASLt's CUBLASLT_EPILOGUE_BIAS) add the bias
// to the float32 sum. PyTorch 2.15 on the CPU, F.linear over bfloat16 (64 x 96 times
// 96 x 80): all 5120 outputs are the float32 product plus the bias rounded once but one
// (an order of the sum), and 1516 differ from the product rounded, then the bias added
// and rounded again, which is what dp computed before. One unit is not all: where the
// bias cancels most of the product, the first rounding is a unit of the product, not of
// the output — x = (1, 1), w = (1, 2^-8), b = -1 gives 2^-8 rounded once (PyTorch's
// 0.00390625) and 0 rounded twice. The ReLU of linear_relu stays a separate op: rounding
// is monotone and keeps 0, so it commutes with the ReLU and the bits are the fused ones.
// The backward is unchanged: gx and gW are 16-bit products, the bias's gradient the
// column sums of gy as a broadcast add's backward takes them (sum_to).

// linear over 16-bit operands of one dtype (Note [16-bit Linear: the bias in the one
// rounding]): each output is the float32 sum of the products and the bias, rounded once;
// then the ReLU, a plain op (rounding and ReLU commute, so the bits are the fused ones).
Tensor linear_16bit(const Tensor& x, const Tensor& w, const Tensor& b, bool relu) {
  const char* op = relu ? "linear_relu" : "linear";
  detail::check_floating(op, x);
  detail::check_floating(op, w, "weight");
  DP_CHECK(x.dtype() == w.dtype() && (!b.defined() || b.dtype() == x.dtype()), op,
           ": expected input, weight and bias of one dtype, got ", dtype_name(x.dtype()), ", ", dtype_name(w.dtype()),
           b.defined() ? std::string(", ") + dtype_name(b.dtype()) : std::string(),
           " (convert with .to(dtype), or run under dp::amp::autocast)");
  DP_CHECK(x.dim() == 2, op, ": expected input (B, in), got shape ", shape_str(x.shape()));
  DP_CHECK(w.dim() == 2 && w.size(1) == x.size(1), op, ": expected weight (out, in=", x.size(1), "), got ",
           shape_str(w.shape()), " for input ", shape_str(x.shape()));
  detail::check_same_device(op, x, w);
  if (b.defined()) {
    detail::check_same_device(op, x, b);
    DP_CHECK(b.dim() == 1 && b.size(0) == w.size(0), op, ": expected bias (", w.size(0), "), got ",
             shape_str(b.shape()));
  }
  Tensor out = gemm_raw(x, false, w, true, b);
  const bool gx = x.requires_grad(), gw = w.requires_grad(), gb = b.defined() && b.requires_grad();
  std::vector<Tensor> inputs{x, w};
  if (b.defined()) inputs.push_back(b);
  autograd::record("LinearBackward", inputs, out, {gw ? x : Tensor(), gx ? w : Tensor()},
                   [x, w, gx, gw, gb, has_b = b.defined(), bias_shape = b.defined() ? b.shape() : Shape{}](
                       const std::vector<Tensor>& g) {
                     std::vector<Tensor> r{gx ? gemm_raw(g[0], false, w, false) : Tensor(),
                                           gw ? gemm_raw(g[0], true, x, false) : Tensor()};
                     // The column sums, as a broadcast add's backward takes them.
                     if (has_b) r.push_back(gb ? sum_to(g[0], bias_shape) : Tensor());
                     return r;
                   });
  return relu ? dp::relu(out) : out;
}

// linear, and linear_relu when `relu`: one backend call computes the product, the bias
// and the ReLU (Note [Linear epilogue] in src/backend/cpu/cpu_gemm.cpp).
Tensor linear_impl(const Tensor& x, const Tensor& w, const Tensor& b, bool relu) {
  const char* op = relu ? "linear_relu" : "linear";
  detail::check_same_device(op, x, w);
  if (x.dtype() != Dtype::Float32 || w.dtype() != Dtype::Float32) return linear_16bit(x, w, b, relu);
  detail::check_float(op, x);
  detail::check_float(op, w, "weight");
  DP_CHECK(x.dim() == 2, op, ": expected input (B, in), got shape ", shape_str(x.shape()));
  DP_CHECK(w.dim() == 2 && w.size(1) == x.size(1), op, ": expected weight (out, in=", x.size(1),
           "), got ", shape_str(w.shape()), " for input ", shape_str(x.shape()));
  if (b.defined()) {
    detail::check_same_device(op, x, b);
    detail::check_float(op, b, "bias");
    DP_CHECK(b.dim() == 1 && b.size(0) == w.size(0), op, ": expected bias (", w.size(0), "), got ",
             shape_str(b.shape()));
  }
  const std::int64_t m = x.size(0), n = w.size(0), k = x.size(1);
  Tensor out = empty({m, n}, x.device());  // (B, out)
  if (out.numel() > 0) {
    // The Linear's forward y = x·wᵀ + b, then relu (GemmEpilogue; Note [Linear epilogue]).
    const std::int64_t ld_k = std::max<std::int64_t>(1, k), ld_n = std::max<std::int64_t>(1, n);
    const backend::GemmEpilogue ep{b.defined() ? b.data<float>() : nullptr, relu, nullptr};
    be(x).run<Op::Gemm>(x.device(), DType::F32,
                        {false, true, m, n, k, 1.0f, x.data<float>(), ld_k, w.data<float>(), ld_k, 0.0f,
                         out.data<float>(), ld_n, ep});
  }
  bool gx = x.requires_grad(), gw = w.requires_grad(), gb = b.defined() && b.requires_grad();
  if (!autograd::needs_grad({x, w, b})) return out;
  std::vector<Tensor> inputs{x, w};
  if (b.defined()) inputs.push_back(b);
  // The ReLU's mask is the output > 0, as ReluBackward reads it from relu's output.
  Tensor ys = relu ? out.detach() : Tensor();
  const bool mask_gx = gx && is_linear_relu_output(x);  // Note [ReLU mask in the input gradient]
  autograd::record(relu ? kLinearReluBackward : "LinearBackward", inputs, out, {gw ? x : Tensor(), gx ? w : Tensor(), ys},
                   [x, w, ys, gx, gw, gb, mask_gx, has_b = b.defined()](const std::vector<Tensor>& g) {
                     const Tensor gy = ys.defined() && !masked_by(g[0], ys)
                                           ? binary_raw("relu_backward", BinaryOp::ReluBackward, g[0], ys)
                                           : g[0];
                     Tensor dx;
                     if (mask_gx) {
                       dx = empty(x.shape(), x.device());
                       if (dx.numel() > 0) {
                         // dx = gy·w masked by x > 0 (GemmEpilogue::relu_y).
                         const std::int64_t mm = x.size(0), nn = x.size(1), kk = w.size(0);
                         const std::int64_t ld_k = std::max<std::int64_t>(1, kk), ld_n = std::max<std::int64_t>(1, nn);
                         const backend::GemmEpilogue ep{nullptr, false, x.data<float>()};
                         be(x).run<Op::Gemm>(x.device(), DType::F32,
                                             {false, false, mm, nn, kk, 1.0f, gy.data<float>(), ld_k, w.data<float>(),
                                              ld_n, 0.0f, dx.data<float>(), ld_n, ep});
                       }
                       t_masked_grad = {dx.impl_ptr(), x.storage().get()};
                     } else if (gx) {
                       dx = grad_gemm(gy, false, w, false, 0);
                     }
                     std::vector<Tensor> r{dx, gw ? grad_gemm(gy, true, x, false, 1) : Tensor()};
                     if (has_b) r.push_back(gb ? reduce_raw(ReduceOp::Sum, gy, 0, false) : Tensor());
                     return r;
                   });
  return out;
}

}  // namespace

namespace {

Tensor autocast_linear(const Tensor& x, const Tensor& w, const Tensor& b, bool relu) {
  if (x.defined() && w.defined() && x.dim() != 2 && x.dim() >= 1 && w.dim() == 2) {
    // torch.nn.functional.linear's (*, in): the leading dims as rows of one GEMM.
    DP_CHECK(x.shape().back() == w.size(1), relu ? "linear_relu" : "linear", ": expected input (*, ", w.size(1),
             ") for weight ", shape_str(w.shape()), ", got shape ", shape_str(x.shape()));
    std::int64_t rows = 1;
    for (std::int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
    Shape out_shape = x.shape();
    out_shape.back() = w.size(0);
    return autocast_linear(x.reshape({rows, w.size(1)}), w, b, relu).reshape(out_shape);
  }
  if (amp::detail::active()) {  // Note [Autocast op policy]: the lower-precision list
    const Dtype low = amp::detail::lower();
    amp::detail::Suspend inner;
    return linear_impl(amp::detail::cast(x, low), amp::detail::cast(w, low), amp::detail::cast(b, low), relu);
  }
  return linear_impl(x, w, b, relu);
}

}  // namespace

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b) { return autocast_linear(x, w, b, false); }

Tensor linear_relu(const Tensor& x, const Tensor& w, const Tensor& b) { return autocast_linear(x, w, b, true); }

// ---- gather / index_select / one_hot -----------------------------------------------------------

namespace {

// An int64 copy of an index tensor (int32 widens; float is refused), on the index's device.
Tensor index_as_i64(const char* op, const Tensor& index, const char* what = "index") {
  detail::check_defined(op, index, what);
  DP_CHECK(index.dtype() == Dtype::Int64 || index.dtype() == Dtype::Int32, op, ": expected an int64 or int32 ",
           what, ", got ", dtype_name(index.dtype()), " (", index.str(), ")");
  return index.to(Dtype::Int64);
}

// Throws unless every index lies in [0, bound), naming the first that does not. Reads
// the values on the host (a wait on CUDA): a bad index must never reach a kernel.
void check_index_range(const char* op, const Tensor& index64, std::int64_t bound, std::int64_t dim,
                       const Shape& input_shape) {
  const std::vector<std::int64_t> v = index64.to_vector_i64();
  for (std::size_t i = 0; i < v.size(); ++i) {
    DP_CHECK(v[i] >= 0 && v[i] < bound, op, ": index ", v[i], " (at position ", i,
             " of the index) is out of bounds for dim ", dim, " with size ", bound, " of input ",
             shape_str(input_shape), "; expected indices in [0, ", bound, ")");
  }
}

// Contiguous element strides of `shape`.
std::vector<std::int64_t> contiguous_strides(const Shape& shape) {
  std::vector<std::int64_t> st(shape.size());
  std::int64_t s = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    st[i] = s;
    s *= shape[i];
  }
  return st;
}

// The geometry of Note [Gather geometry] (backend.h): walk `out_shape`, read input
// (contiguous `in_shape`) with the index's strides `index_strides` (0 = broadcast).
Indexer gather_indexer(const Shape& out_shape, const Shape& in_shape, const std::vector<std::int64_t>& index_strides) {
  DP_CHECK(static_cast<int>(out_shape.size()) <= backend::kMaxDims, "expected at most ", backend::kMaxDims,
           " dims, got shape ", shape_str(out_shape));
  const std::vector<std::int64_t> in_strides = contiguous_strides(in_shape);
  Indexer ix;
  ix.ndim = static_cast<int>(out_shape.size());
  for (std::size_t i = 0; i < out_shape.size(); ++i) {
    ix.sizes[i] = out_shape[i];
    ix.strides_a[i] = in_strides[i];
    ix.strides_b[i] = index_strides[i];
  }
  return ix;
}

// Note [Integer gathers]
// gather and index_select only move elements, so int64 and int32 inputs reuse the
// float32 kernel on the same bytes: an int32 element is one float32-sized word, an
// int64 element two (a trailing dim of 2 that the index does not step). The kernels
// load and store these words without arithmetic, which copies their bits exactly (on
// the CPU and on CUDA), whatever float value the bits would spell.

// The float32 words of an integer tensor's elements, sharing its storage.
Tensor as_words(const Tensor& t) {
  auto impl = std::make_shared<TensorImpl>();
  const std::int64_t per = static_cast<std::int64_t>(element_size(t.dtype()) / sizeof(float));
  impl->storage = t.storage();
  impl->offset = t.storage_offset() * per;
  impl->shape = t.shape();
  if (per == 2) impl->shape.push_back(2);
  impl->dtype = Dtype::Float32;
  return Tensor(std::move(impl));
}

// A tensor of `dtype` and `shape` over the words `w` made by the gather kernel.
Tensor from_words(const Tensor& w, Dtype dtype, const Shape& shape) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = w.storage();
  impl->offset = 0;
  impl->shape = shape;
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

// out (out_shape) = input gathered along d by index64 read with `index_strides`; float32
// records the scatter-add backward, integers go through Note [Integer gathers].
Tensor gather_with(const char* node, const Tensor& input, const Tensor& index64, const Shape& out_shape,
                   std::vector<std::int64_t> index_strides, int d) {
  if (!is_floating_point(input.dtype())) {
    Tensor words = as_words(input);
    Shape out_words = out_shape;
    if (words.dim() > input.dim()) {  // int64: two words per element, one index each
      out_words.push_back(2);
      index_strides.push_back(0);
    }
    Indexer ix = gather_indexer(out_words, words.shape(), index_strides);
    Tensor out = empty(out_words, input.device());
    if (out.numel() > 0)
      be(input).run<Op::Gather>(input.device(), DType::F32,
                                {ix, static_cast<int>(d), words.data<float>(), index64.data<std::int64_t>(),
                                 out.data<float>()});
    return from_words(out, input.dtype(), out_shape);
  }
  Indexer ix = gather_indexer(out_shape, input.shape(), index_strides);
  Tensor out = empty(out_shape, TensorOptions{input.dtype(), input.device()});
  if (out.numel() > 0)
    be(input).run<Op::Gather>(input.device(), detail::kernel_dtype(input.dtype()),
                              {ix, static_cast<int>(d), input.raw_data(), index64.data<std::int64_t>(), out.raw_data()});
  Shape in_shape = input.shape();
  autograd::record(node, {input}, out, {index64}, [in_shape, index64, ix, d](const std::vector<Tensor>& g) {
    // A repeated index sums its gradients: for 16-bit ones in float32, rounded once at
    // the end (Note [16-bit tensors]), not once per addition.
    const Tensor gy = is_16bit(g[0]) ? g[0].to(Dtype::Float32) : g[0];
    Tensor gx = zeros(in_shape, TensorOptions{gy.dtype(), gy.device()});
    if (gy.numel() > 0)
      be(gy).run<Op::ScatterAdd>(gy.device(), detail::kernel_dtype(gy.dtype()),
                                 {ix, static_cast<int>(d), gy.raw_data(), index64.data<std::int64_t>(), gx.raw_data()});
    return std::vector<Tensor>{gx.dtype() == g[0].dtype() ? gx : gx.to(g[0].dtype())};
  });
  return out;
}

}  // namespace

Tensor gather(const Tensor& input, std::int64_t dim, const Tensor& index) {
  detail::check_defined("gather", input);
  Tensor idx = index_as_i64("gather", index);
  detail::check_same_device("gather", input, idx);
  // A scalar input gathers like a 1-element vector (torch.gather allows dim 0 / -1).
  if (input.dim() == 0) return gather(input.reshape({1}), dim, idx.dim() == 0 ? idx.reshape({1}) : idx).reshape(idx.shape());
  const std::int64_t d = norm_dim("gather", input, dim);
  DP_CHECK(idx.dim() == input.dim(), "gather: expected an index with as many dims as the input (",
           input.dim(), "), got index ", shape_str(idx.shape()), " for input ", shape_str(input.shape()));
  for (std::int64_t i = 0; i < input.dim(); ++i) {
    if (i == d) continue;
    DP_CHECK(idx.size(i) <= input.size(i), "gather: expected index.size(", i, ") <= input.size(", i,
             ") outside dim ", d, ", got index ", shape_str(idx.shape()), " for input ", shape_str(input.shape()));
  }
  check_index_range("gather", idx, input.size(d), d, input.shape());
  return gather_with("GatherBackward", input, idx, idx.shape(), contiguous_strides(idx.shape()), static_cast<int>(d));
}

Tensor index_select(const Tensor& input, std::int64_t dim, const Tensor& index) {
  detail::check_defined("index_select", input);
  Tensor idx = index_as_i64("index_select", index);
  detail::check_same_device("index_select", input, idx);
  DP_CHECK(idx.dim() <= 1, "index_select: expected a 1-d index, got shape ", shape_str(idx.shape()));
  if (input.dim() == 0) return index_select(input.reshape({1}), dim, idx).reshape(idx.dim() == 0 ? Shape{} : Shape{idx.numel()});
  const std::int64_t d = norm_dim("index_select", input, dim);
  check_index_range("index_select", idx, input.size(d), d, input.shape());
  return detail::index_select_in_range(input, d, idx);
}

Tensor detail::index_select_in_range(const Tensor& input, std::int64_t d, const Tensor& index64) {
  Shape out_shape = input.shape();
  out_shape[d] = index64.numel();
  std::vector<std::int64_t> idx_strides(out_shape.size(), 0);
  idx_strides[d] = 1;  // index[c_d]; broadcast over every other dim
  return gather_with("IndexSelectBackward", input, index64, out_shape, std::move(idx_strides), static_cast<int>(d));
}

Tensor index_add(const Tensor& input, std::int64_t dim, const Tensor& index, const Tensor& source) {
  detail::check_defined("index_add", input);
  detail::check_float("index_add", input, "input");
  detail::check_float("index_add", source, "source");
  Tensor idx = index_as_i64("index_add", index);
  detail::check_same_device("index_add", input, idx);
  detail::check_same_device("index_add", input, source);
  DP_CHECK(idx.dim() <= 1, "index_add: expected a 1-d index, got shape ", shape_str(idx.shape()));
  DP_CHECK(input.dim() >= 1, "index_add: expected an input with at least 1 dim, got a scalar");
  const std::int64_t d = norm_dim("index_add", input, dim);
  Shape want = input.shape();
  want[d] = idx.numel();
  DP_CHECK(source.shape() == want, "index_add: expected source of shape ", shape_str(want), " (input ",
           shape_str(input.shape()), " with ", idx.numel(), " slices along dim ", d, "), got ",
           shape_str(source.shape()));
  check_index_range("index_add", idx, input.size(d), d, input.shape());
  return detail::index_add_in_range(input, d, idx, source);
}

Tensor detail::log_sigmoid_raw(const Tensor& t) { return unary_raw("log_sigmoid", UnaryOp::LogSigmoid, t); }

Tensor detail::index_add_in_range(const Tensor& input, std::int64_t d, const Tensor& index64, const Tensor& source) {
  Tensor out = detail::contiguous_copy(input);  // written below through data<float>()
  if (source.numel() > 0) {
    std::vector<std::int64_t> idx_strides(source.shape().size(), 0);
    idx_strides[d] = 1;
    Indexer ix = gather_indexer(source.shape(), input.shape(), idx_strides);
    be(out).run<Op::ScatterAdd>(out.device(), DType::F32,
                                {ix, static_cast<int>(d), source.data<float>(), index64.data<std::int64_t>(),
                                 out.data<float>()});
  }
  autograd::record("IndexAddBackward", {input, source}, out, {index64}, [d, index64](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{g[0], detail::index_select_in_range(g[0], d, index64)};
  });
  return out;
}

Tensor one_hot(const Tensor& labels, std::int64_t num_classes) {
  Tensor y = index_as_i64("one_hot", labels, "labels");
  DP_CHECK(num_classes >= -1, "one_hot: expected num_classes >= 0, or -1 to infer it, got ", num_classes);
  const std::vector<std::int64_t> v = y.to_vector_i64();
  if (num_classes == -1) {
    DP_CHECK(!v.empty(), "one_hot: cannot infer num_classes from empty labels ", shape_str(y.shape()),
             "; pass num_classes");
    num_classes = *std::max_element(v.begin(), v.end()) + 1;
  }
  for (std::size_t i = 0; i < v.size(); ++i) {
    DP_CHECK(v[i] >= 0 && v[i] < num_classes, "one_hot: label ", v[i], " (at position ", i,
             ") is outside [0, ", num_classes, "); expected class values in [0, num_classes)");
  }
  Shape out_shape = y.shape();
  out_shape.push_back(num_classes);
  Shape row(out_shape.size(), 1);
  row.back() = num_classes;
  // eq against 0..C-1 broadcast along a new last dim: exact for int64, then 0/1 to int64.
  Tensor classes = arange(num_classes, TensorOptions{Dtype::Int64, y.device()}).reshape(row);
  Shape col = y.shape();
  col.push_back(1);
  return eq(y.reshape(col), classes).to(Dtype::Int64);
}

// ---- cat / chunk / split ---------------------------------------------------------------------

Tensor cat(const std::vector<Tensor>& tensors, std::int64_t dim) {
  DP_CHECK(!tensors.empty(), "cat: expected at least one tensor, got none");
  const Tensor& first = tensors[0];
  detail::check_defined("cat", first);
  DP_CHECK(first.dim() >= 1, "cat: expected tensors with at least 1 dim, got a scalar");
  const std::int64_t d = norm_dim("cat", first, dim);
  // Floating tensors of different dtypes meet in float32 (torch.cat's promotion: a
  // bfloat16 and a float32 piece give float32), each piece converted differentiably.
  bool floating = true, one_dtype = true;
  for (const Tensor& t : tensors) {
    detail::check_defined("cat", t);
    floating = floating && is_floating_point(t.dtype());
    one_dtype = one_dtype && t.dtype() == first.dtype();
  }
  if (floating && !one_dtype) {
    std::vector<Tensor> wide;
    for (const Tensor& t : tensors) wide.push_back(t.to(Dtype::Float32));
    return cat(wide, d);
  }
  std::int64_t total = 0;
  std::vector<std::int64_t> sizes;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    detail::check_defined("cat", t);
    detail::check_same_device("cat", first, t);
    DP_CHECK(t.dtype() == first.dtype(), "cat: expected ", dtype_name(first.dtype()), " for tensor ", i,
             " (floating dtypes mix, integers do not), got ", dtype_name(t.dtype()));
    bool same = t.dim() == first.dim();
    for (std::int64_t k = 0; same && k < t.dim(); ++k) same = k == d || t.size(k) == first.size(k);
    DP_CHECK(same, "cat: expected tensor ", i, " to match ", shape_str(first.shape()), " in every dim but dim ", d,
             ", got ", shape_str(t.shape()));
    total += t.size(d);
    sizes.push_back(t.size(d));
  }
  Shape out_shape = first.shape();
  out_shape[static_cast<std::size_t>(d)] = total;
  Tensor out = empty(out_shape, TensorOptions{first.dtype(), first.device()});
  // Along dim d every tensor is `outer` blocks of size(d) * inner elements, which land
  // `total * inner` apart in the result: one strided copy of bytes per tensor (exact
  // for every dtype).
  std::int64_t outer = 1, inner = 1;
  for (std::int64_t k = 0; k < d; ++k) outer *= first.size(k);
  for (std::int64_t k = d + 1; k < first.dim(); ++k) inner *= first.size(k);
  const std::size_t es = element_size(first.dtype());
  auto& be = backend::get(first.device());
  std::int64_t at = 0;
  for (const Tensor& t : tensors) {
    const std::int64_t block = t.size(d) * inner;
    if (block > 0 && outer > 0)
      be.copy_rows(static_cast<char*>(out.raw_data()) + static_cast<std::size_t>(at * inner) * es,
                   static_cast<std::size_t>(total * inner) * es, t.raw_data(), static_cast<std::size_t>(block) * es,
                   static_cast<std::size_t>(block) * es, static_cast<std::size_t>(outer), first.device());
    at += t.size(d);
  }
  autograd::record("CatBackward", tensors, out, {}, [sizes, d](const std::vector<Tensor>& g) {
    std::vector<Tensor> r;
    std::int64_t off = 0;
    for (auto s : sizes) {
      r.push_back(g[0].narrow(d, off, s));
      off += s;
    }
    return r;
  });
  return out;
}

std::vector<Tensor> chunk(const Tensor& t, std::int64_t chunks, std::int64_t dim) {
  DP_CHECK(chunks >= 1, "chunk: expected chunks >= 1, got ", chunks);
  DP_CHECK(t.dim() >= 1, "chunk: expected a tensor with at least 1 dim, got a scalar");
  dim = norm_dim("chunk", t, dim);
  const std::int64_t rows = t.size(dim);
  const std::int64_t step = (rows + chunks - 1) / chunks;
  std::vector<std::int64_t> sizes;
  for (std::int64_t at = 0; at < rows; at += step) sizes.push_back(std::min(step, rows - at));
  // torch.chunk keeps the count when the dim is empty: `chunks` empty pieces.
  if (rows == 0) sizes.assign(static_cast<std::size_t>(chunks), 0);
  return split(t, sizes, dim);
}

std::vector<Tensor> split(const Tensor& t, const std::vector<std::int64_t>& sizes, std::int64_t dim) {
  DP_CHECK(t.dim() >= 1, "split: expected a tensor with at least 1 dim, got a scalar");
  dim = norm_dim("split", t, dim);
  std::int64_t total = 0;
  for (auto s : sizes) {
    DP_CHECK(s >= 0, "split: expected non-negative sizes, got ", s);
    total += s;
  }
  DP_CHECK(total == t.size(dim), "split: sizes sum to ", total, " but dim ", dim, " has ", t.size(dim),
           dim == 0 ? " rows" : " elements", " (shape ", shape_str(t.shape()), ")");
  std::vector<Tensor> out;
  std::int64_t at = 0;
  for (auto s : sizes) {
    out.push_back(t.narrow(dim, at, s));
    at += s;
  }
  return out;
}

std::vector<Tensor> split(const Tensor& t, std::int64_t split_size, std::int64_t dim) {
  DP_CHECK(split_size >= 1, "split: expected a split_size >= 1, got ", split_size);
  DP_CHECK(t.dim() >= 1, "split: expected a tensor with at least 1 dim, got a scalar");
  dim = norm_dim("split", t, dim);
  std::vector<std::int64_t> sizes;
  for (std::int64_t at = 0; at < t.size(dim); at += split_size) sizes.push_back(std::min(split_size, t.size(dim) - at));
  if (sizes.empty()) sizes.push_back(0);  // torch.split of an empty dim: one empty piece
  return split(t, sizes, dim);
}

// ---- test helpers ----------------------------------------------------------------------------

double max_abs_diff(const Tensor& a, const Tensor& b) {
  DP_CHECK(a.shape() == b.shape(), "max_abs_diff: shapes differ: ", shape_str(a.shape()), " vs ",
           shape_str(b.shape()));
  auto va = a.to(Dtype::Float32).to_vector(), vb = b.to(Dtype::Float32).to_vector();
  double m = 0;
  for (std::size_t i = 0; i < va.size(); ++i) {
    double d = std::fabs(static_cast<double>(va[i]) - vb[i]);
    if (std::isnan(d)) return d;
    m = std::max(m, d);
  }
  return m;
}

bool equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  std::vector<char> ha(a.nbytes()), hb(b.nbytes());
  if (!ha.empty()) {
    backend::get(a.device()).copy_to_host(ha.data(), a.raw_data(), a.device(), a.nbytes());
    backend::get(b.device()).copy_to_host(hb.data(), b.raw_data(), b.device(), b.nbytes());
  }
  return ha == hb;
}

}  // namespace dp
