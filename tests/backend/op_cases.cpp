// tests/backend/op_cases.cpp — the rows of the backend op table (see op_cases.h).
//
// Tolerances are against the CPU backend. Exact ({0, 0}) where both backends must give
// the same bits: data movement, integer ops, comparisons, max/min, single IEEE
// operations (+, -, *), the counter-based random numbers. Elsewhere they are the ones
// the hand-written CUDA comparisons used before this table, verified on GPUs, and for
// sums they grow with the number of terms (sum_tol).
#include "op_cases.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <type_traits>
#include <utility>

#include "dp/core/error.h"

namespace dp_test {
namespace {

using dp::Device;
using dp::backend::Backend;
namespace be = dp::backend;
using dp::backend::BinaryOp;
using dp::backend::Conv2dShape;
using dp::backend::DType;
using dp::backend::Indexer;
using dp::backend::Op;
using dp::backend::Pool2dShape;
using dp::backend::ReduceOp;
using dp::backend::UnaryOp;
using i64 = std::int64_t;

/// The names of the Kernels after the table's ops (those are named by op_name).
constexpr const char* kKernelNames[] = {
    "copy", "copy_from_host", "copy_to_host", "memset_zero"};
static_assert(std::size(kKernelNames) + dp::backend::kOpCount == static_cast<std::size_t>(Kernel::kCount),
              "one name per Kernel after the ops, in enum order");

// ---- tolerances ------------------------------------------------------------------------

/// libm functions (expf, logf, tanhf, powf), division and FMA contraction: CPU and CUDA
/// differ by an ulp or two.
constexpr Tolerance kUlps{2e-6, 1e-7};
/// Elementwise a * x + b: one rounding more or less where CUDA contracts to an FMA.
constexpr Tolerance kFma{2e-6, 1e-6};

/// A float sum of `terms` products, added in a different order on each backend and
/// thread count. Rounding errors add up like a random walk, so the absolute part grows
/// as sqrt(terms); `base` holds up to 64 terms (GEMM and convolution were verified on
/// GPUs at 1e-4 with 29 to 180 terms).
Tolerance sum_tol(Tolerance base, double terms) {
  return {base.rtol, base.atol * std::max(1.0, std::sqrt(terms / 64.0))};
}
constexpr Tolerance kGemmBase{1e-4, 1e-4};

// ---- op enums: one row per value ---------------------------------------------------------
// Note [Op enum sentinels] (backend.h): each array has one row per enum value, in enum
// order, checked at compile time against kCount; every row becomes a case below.

template <typename Row, std::size_t N>
constexpr bool in_enum_order(const Row (&rows)[N]) {
  for (std::size_t i = 0; i < N; ++i)
    if (static_cast<std::size_t>(rows[i].op) != i) return false;
  return true;
}

/// A unary op, its input domain [lo, hi) and its tolerance.
struct UnaryRow {
  UnaryOp op;
  const char* name;
  float lo, hi;
  Tolerance tol;
};
constexpr UnaryRow kUnaryRows[] = {
    {UnaryOp::Neg, "neg", -3.0f, 3.0f, kExact},
    {UnaryOp::Exp, "exp", -10.0f, 10.0f, kUlps},
    {UnaryOp::Log, "log", 0.01f, 100.0f, kUlps},
    {UnaryOp::Sqrt, "sqrt", 0.0f, 100.0f, kUlps},
    {UnaryOp::Rsqrt, "rsqrt", 0.01f, 100.0f, kUlps},
    {UnaryOp::Abs, "abs", -3.0f, 3.0f, kExact},
    {UnaryOp::Square, "square", -3.0f, 3.0f, kExact},
    {UnaryOp::Reciprocal, "reciprocal", 0.1f, 10.0f, kUlps},
    {UnaryOp::Relu, "relu", -3.0f, 3.0f, kExact},
    {UnaryOp::Sigmoid, "sigmoid", -20.0f, 20.0f, kUlps},
    {UnaryOp::Tanh, "tanh", -10.0f, 10.0f, kUlps},
    {UnaryOp::Sign, "sign", -3.0f, 3.0f, kExact},
    {UnaryOp::Erf, "erf", -4.0f, 4.0f, kUlps},
    {UnaryOp::LogSigmoid, "log_sigmoid", -20.0f, 20.0f, kUlps},
};
static_assert(std::size(kUnaryRows) == static_cast<std::size_t>(UnaryOp::kCount),
              "every UnaryOp needs a row in kUnaryRows (Note [Op enum sentinels])");
static_assert(in_enum_order(kUnaryRows), "kUnaryRows must follow UnaryOp's order");

/// A binary op, the domains of a and b, and its tolerance. `integers` draws whole
/// numbers so that equality and ties occur.
struct BinaryRow {
  BinaryOp op;
  const char* name;
  float a_lo, a_hi, b_lo, b_hi;
  bool integers;
  Tolerance tol;
};
constexpr BinaryRow kBinaryRows[] = {
    {BinaryOp::Add, "add", -3.0f, 3.0f, -3.0f, 3.0f, false, kExact},
    {BinaryOp::Sub, "sub", -3.0f, 3.0f, -3.0f, 3.0f, false, kExact},
    {BinaryOp::Mul, "mul", -3.0f, 3.0f, -3.0f, 3.0f, false, kExact},
    {BinaryOp::Div, "div", -3.0f, 3.0f, 0.5f, 2.0f, false, kUlps},        // b away from 0
    {BinaryOp::Maximum, "maximum", -3.0f, 3.0f, -3.0f, 3.0f, true, kExact},
    {BinaryOp::Minimum, "minimum", -3.0f, 3.0f, -3.0f, 3.0f, true, kExact},
    {BinaryOp::Pow, "pow", 0.1f, 3.0f, -2.0f, 2.0f, false, kUlps},        // positive bases
    {BinaryOp::Eq, "eq", 0.0f, 4.0f, 0.0f, 4.0f, true, kExact},           // 1 pair in 4 equal
    {BinaryOp::Gt, "gt", 0.0f, 4.0f, 0.0f, 4.0f, true, kExact},
    {BinaryOp::ReluBackward, "relu_backward", -3.0f, 3.0f, -1.0f, 1.0f, false, kExact},
};
static_assert(std::size(kBinaryRows) == static_cast<std::size_t>(BinaryOp::kCount),
              "every BinaryOp needs a row in kBinaryRows (Note [Op enum sentinels])");
static_assert(in_enum_order(kBinaryRows), "kBinaryRows must follow BinaryOp's order");

/// A reduction and its tolerance over `r` terms.
struct ReduceRow {
  ReduceOp op;
  const char* name;
  bool exact;  // max and min pick an element: no rounding
};
constexpr ReduceRow kReduceRows[] = {
    {ReduceOp::Sum, "sum", false},
    {ReduceOp::Max, "max", true},
    {ReduceOp::Min, "min", true},
};
static_assert(std::size(kReduceRows) == static_cast<std::size_t>(ReduceOp::kCount),
              "every ReduceOp needs a row in kReduceRows (Note [Op enum sentinels])");
static_assert(in_enum_order(kReduceRows), "kReduceRows must follow ReduceOp's order");

// ---- small helpers -------------------------------------------------------------------------

/// Element count of the Check suite's flat cases: a prime above three times the CPU's
/// parallel grain (kSerialGrain = 32768), so every TBB path and a partial last CUDA
/// block run.
constexpr i64 kCheckN = 100003;
/// Element count of the Perf suite's flat cases: 16 Mi floats = 64 MiB per buffer, past
/// every cache (32 MiB of L3 on the 2-core host, 50 MiB of L2 on an H100), so GB/s
/// measures memory.
constexpr i64 kPerfN = i64{1} << 24;

/// Concatenates strings and integers. (std::string's operator+ with a literal on the
/// left trips GCC 12's -Wrestrict false positive, GCC bug 105651.)
template <typename... Parts>
std::string cat(const Parts&... parts) {
  std::string s;
  auto append = [&s](const auto& part) {
    if constexpr (std::is_integral_v<std::decay_t<decltype(part)>>) {
      s += std::to_string(part);
    } else {
      s += part;
    }
  };
  (append(parts), ...);
  return s;
}

std::string dims(std::initializer_list<i64> d) {
  std::string s;
  for (i64 v : d) s += cat(s.empty() ? "" : "x", v);
  return s;
}
std::string count(i64 n) { return cat("n=", n); }

constexpr double kF = sizeof(float);
constexpr double kL = sizeof(std::int64_t);

Indexer indexer(std::initializer_list<i64> sizes, std::initializer_list<i64> strides_a,
                std::initializer_list<i64> strides_b) {
  Indexer ix;
  ix.ndim = static_cast<int>(sizes.size());
  std::copy(sizes.begin(), sizes.end(), ix.sizes);
  std::copy(strides_a.begin(), strides_a.end(), ix.strides_a);
  std::copy(strides_b.begin(), strides_b.end(), ix.strides_b);
  return ix;
}
i64 numel(const Indexer& ix) {
  i64 n = 1;
  for (int d = 0; d < ix.ndim; ++d) n *= ix.sizes[d];
  return n;
}
/// Elements of an operand read through `strides` (broadcast dimensions count once):
/// the size of the buffer it needs.
i64 extent(const Indexer& ix, const i64* strides) {
  i64 last = 0;
  for (int d = 0; d < ix.ndim; ++d) last += (ix.sizes[d] - 1) * strides[d];
  return last + 1;
}

Conv2dShape conv(i64 N, i64 C, i64 H, i64 W, i64 K, i64 R, i64 S, i64 stride_h, i64 stride_w,
                 i64 pad_h, i64 pad_w) {
  Conv2dShape s{N, C, H, W, K, R, S, stride_h, stride_w, pad_h, pad_w, 0, 0};
  s.P = (H + 2 * pad_h - R) / stride_h + 1;
  s.Q = (W + 2 * pad_w - S) / stride_w + 1;
  return s;
}
/// conv(...) with x, y and their gradients N x H x W x C (Conv2dShape::channels_last).
Conv2dShape conv_cl(i64 N, i64 C, i64 H, i64 W, i64 K, i64 R, i64 S, i64 stride_h, i64 stride_w, i64 pad_h,
                    i64 pad_w) {
  Conv2dShape s = conv(N, C, H, W, K, R, S, stride_h, stride_w, pad_h, pad_w);
  s.channels_last = true;
  return s;
}
std::string conv_name(const Conv2dShape& s) {
  return cat("N", s.N, " ", s.C, "->", s.K, " ", dims({s.H, s.W}), " k", dims({s.R, s.S}), " s",
             dims({s.stride_h, s.stride_w}), " p", dims({s.pad_h, s.pad_w})) +
         (s.channels_last ? " channels-last" : "");
}

Pool2dShape pool(i64 N, i64 C, i64 H, i64 W, i64 kh, i64 kw, i64 sh, i64 sw, i64 ph, i64 pw) {
  Pool2dShape s{N, C, H, W, kh, kw, sh, sw, ph, pw, 0, 0};
  s.P = (H + 2 * ph - kh) / sh + 1;
  s.Q = (W + 2 * pw - kw) / sw + 1;
  return s;
}
std::string pool_name(const Pool2dShape& s) {
  return cat("N", s.N, " C", s.C, " ", dims({s.H, s.W}), " k", dims({s.kernel_h, s.kernel_w}),
             " s", dims({s.stride_h, s.stride_w}), " p", dims({s.pad_h, s.pad_w}));
}

/// FNV-1a: a case's inputs are a function of its name only.
std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64-bit offset basis and prime
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

/// splitmix64's finaliser of seed + i: a counter-based generator, so element i of an
/// input never depends on how the others were drawn, and it is cheap enough to fill
/// the Perf suite's 16 MiB buffers in milliseconds.
std::uint64_t mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// ---- the table -------------------------------------------------------------------------------

/// Collects rows; `suite` applies to the rows added next.
class Table {
 public:
  std::vector<OpCase> cases;
  Suite suite = Suite::Check;

  void add(Kernel kernel, DType dtype, std::string name, std::string shape, Tolerance tol, double flops,
           double bytes, std::function<void(OpRun&)> build) {
    cases.push_back(OpCase{kernel, dtype, std::move(name), std::move(shape), suite, tol, flops, bytes,
                           std::move(build)});
  }
  void add(Kernel kernel, std::string name, std::string shape, Tolerance tol, double flops,
           double bytes, std::function<void(OpRun&)> build) {
    add(kernel, DType::F32, std::move(name), std::move(shape), tol, flops, bytes, std::move(build));
  }
  void add(Kernel kernel, std::string shape, Tolerance tol, double flops, double bytes,
           std::function<void(OpRun&)> build) {
    add(kernel, kernel_name(kernel), std::move(shape), tol, flops, bytes, std::move(build));
  }
};

// Each add_* appends the cases of one family at one size. Builders capture shapes by
// value and device pointers into the call; the OpRun owns the memory.

void add_fill(Table& t, i64 n) {
  t.add(Kernel::Fill, count(n), kExact, 0, kF * n, [n](OpRun& r) {
    float* y = r.empty(n);
    r.output("y", y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Fill>(d, DType::F32, {y, n, 3.5f}); });
  });
}

void add_integer_and_cast(Table& t, i64 n) {
  t.add(Kernel::Fill, DType::I64, "fill_i64", count(n), kExact, 0, kL * n, [n](OpRun& r) {
    std::int64_t* y = r.empty_i64(n);
    r.output("y", y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Fill>(d, DType::I64, {y, n, i64{-7}}); });
  });
  t.add(Kernel::AddScalar, DType::I64, "add_i64", count(n), kExact, 0, 2 * kL * n, [n](OpRun& r) {
    // Values near 2^40: exact in int64 only, so a float detour would show.
    std::vector<std::int64_t> v(static_cast<std::size_t>(n));
    for (i64 i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = (i64{1} << 40) + 3 * i - 5;
    std::int64_t* y = r.upload(v);
    r.output("y", y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::AddScalar>(d, DType::I64, {y, n, i64{7}}); });
  });
  t.add(Kernel::Arange, count(n), kExact, 0, kF * n, [n](OpRun& r) {
    float* y = r.empty(n);
    r.output("y", y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Arange>(d, DType::F32, {y, n, -2.0f, 0.25f}); });
  });
  t.add(Kernel::Arange, DType::I64, "arange_i64", count(n), kExact, 0, kL * n, [n](OpRun& r) {
    std::int64_t* y = r.empty_i64(n);
    r.output("y", y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Arange>(d, DType::I64, {y, n, i64{-7}, i64{3}}); });
  });
  {
    // copy_ of an integer source broadcast (Note [Sources of in-place writes]): a row of
    // values near 2^40, exact in int64 only, down every row of a (rows, cols) result.
    const i64 cols = 331, rows = n / cols;
    const Indexer ix = indexer({rows, cols}, {0, 1}, {0, 0});
    t.add(Kernel::StridedCopy, DType::I64, "strided_copy_i64", dims({cols}) + " broadcast to " + dims({rows, cols}),
          kExact, 0, kL * (rows * cols + cols), [=](OpRun& r) {
            std::vector<std::int64_t> v(static_cast<std::size_t>(cols));
            for (i64 i = 0; i < cols; ++i) v[static_cast<std::size_t>(i)] = (i64{1} << 40) - 7 * i;
            const std::int64_t* a = r.upload(v);
            std::int64_t* out = r.empty_i64(rows * cols);
            r.output("out", out, rows * cols);
            r.set_call([=](Backend& b, Device d) { b.run<Op::StridedCopy>(d, DType::I64, {ix, a, out}); });
          });
  }
  t.add(Kernel::Cast, DType::F32, "cast_i64_to_f32", count(n), kExact, 0, (kL + kF) * n, [n](OpRun& r) {
    // Up to ±2^30: beyond float's 24-bit mantissa, so rounding to nearest is checked.
    std::vector<std::int64_t> v(static_cast<std::size_t>(n));
    for (i64 i = 0; i < n; ++i)
      v[static_cast<std::size_t>(i)] = static_cast<i64>(mix(static_cast<std::uint64_t>(i)) >> 33) -
                                       (i64{1} << 30);
    std::int64_t* x = r.upload(v);
    float* y = r.empty(n);
    r.output("y", y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Cast>(d, DType::F32, {x, DType::I64, y, n}); });
  });
  t.add(Kernel::Cast, DType::I64, "cast_f32_to_i64", count(n), kExact, 0, (kF + kL) * n, [n](OpRun& r) {
    float* x = r.uniform(n, -1e6f, 1e6f);  // fractional parts: truncation toward 0
    std::int64_t* y = r.empty_i64(n);
    r.output("y", y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Cast>(d, DType::I64, {x, DType::F32, y, n}); });
  });
}

void add_int32_casts(Table& t, i64 n) {
  // Values spread over the whole int32 range, negatives included, and int64 values
  // beyond it: narrowing keeps the low 32 bits.
  t.add(Kernel::Cast, DType::I64, "cast_i32_to_i64", count(n), kExact, 0, (4 + kL) * n, [n](OpRun& r) {
    std::vector<std::int32_t> v(static_cast<std::size_t>(n));
    for (i64 i = 0; i < n; ++i)
      v[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(mix(static_cast<std::uint64_t>(i)) >> 32);
    const std::int32_t* x = r.upload(v);
    std::int64_t* y = r.empty_i64(n);
    r.output("y", y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Cast>(d, DType::I64, {x, DType::I32, y, n}); });
  });
  t.add(Kernel::Cast, DType::I32, "cast_i64_to_i32", count(n), kExact, 0, (kL + 4) * n, [n](OpRun& r) {
    std::vector<std::int64_t> v(static_cast<std::size_t>(n));
    for (i64 i = 0; i < n; ++i)
      v[static_cast<std::size_t>(i)] = static_cast<i64>(mix(static_cast<std::uint64_t>(i)) >> 20) -
                                       (i64{1} << 43);
    const std::int64_t* x = r.upload(v);
    std::int32_t* y = r.upload(std::vector<std::int32_t>(static_cast<std::size_t>(n), -1));
    r.output("y", y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Cast>(d, DType::I32, {x, DType::I64, y, n}); });
  });
}

/// gather and scatter_add (Note [Gather geometry] in ops.h) on x (outer, r, inner)
/// along dim 1: index (outer, m, inner) as torch.gather has it, or a 1-d index of m
/// rows broadcast as index_select has it. Integer-valued sources keep scatter_add's
/// sums exact in any order (CUDA adds with atomics).
void add_gather(Table& t, i64 outer, i64 r_, i64 inner, i64 m, bool select) {
  const Indexer ix = indexer({outer, m, inner}, {r_ * inner, inner, 1},
                             select ? std::initializer_list<i64>{0, 1, 0}
                                    : std::initializer_list<i64>{m * inner, inner, 1});
  const i64 nidx = select ? m : outer * m * inner;
  const i64 nout = outer * m * inner;
  const std::string shape = dims({outer, r_, inner}) + (select ? " select " : " gather ") +
                            std::to_string(m) + " on dim 1";
  auto indices = [=](OpRun& r) {
    std::vector<float> u = r.host_uniform(nidx, 0, static_cast<float>(r_), true);
    return std::vector<std::int64_t>(u.begin(), u.end());
  };
  t.add(Kernel::Gather, shape, kExact, 0, kF * nout * 2 + kL * nidx, [=](OpRun& r) {
    const float* x = r.uniform(outer * r_ * inner, -1, 1);
    const std::int64_t* idx = r.upload(indices(r));
    float* out = r.empty(nout);
    r.output("out", out, nout);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Gather>(d, DType::F32, {ix, 1, x, idx, out}); });
  });
  t.add(Kernel::ScatterAdd, shape, kExact, 0, kF * nout * 3 + kL * nidx, [=](OpRun& r) {
    const float* src = r.uniform(nout, -4, 4, true);
    const std::int64_t* idx = r.upload(indices(r));
    float* y = r.uniform(outer * r_ * inner, -4, 4, true);
    r.output("y", y, outer * r_ * inner);
    r.set_call([=](Backend& b, Device d) { b.run<Op::ScatterAdd>(d, DType::F32, {ix, 1, src, idx, y}); });
  });
}

/// scatter_add of whole rows along dim 0 (an embedding's backward: (n, cols) rows onto
/// a (v, cols) table): non-integer values with indices repeated in long runs, so the
/// sums are exact only in one order — the CPU's, which CUDA's sorted path keeps (Note
/// [Row scatter-add in position order]).
void add_scatter_rows(Table& t, i64 n, i64 v, i64 cols) {
  const Indexer ix = indexer({n, cols}, {cols, 1}, {1, 0});
  const std::string shape = dims({n, cols}) + " rows onto " + std::to_string(v);
  t.add(Kernel::ScatterAdd, shape, kExact, 0, kF * n * cols * 3 + kL * n, [=](OpRun& r) {
    const float* src = r.uniform(n * cols, -1, 1);
    std::vector<std::int64_t> ids(static_cast<std::size_t>(n));
    for (i64 p = 0; p < n; ++p)  // every third position index 1 (a long run), the rest spread
      ids[static_cast<std::size_t>(p)] = p % 3 == 0 ? 1 : (p * 7919) % v;
    const std::int64_t* idx = r.upload(ids);
    float* y = r.uniform(v * cols, -1, 1);
    r.output("y", y, v * cols);
    r.set_call([=](Backend& b, Device d) { b.run<Op::ScatterAdd>(d, DType::F32, {ix, 0, src, idx, y}); });
  });
}

void add_eq_i64(Table& t, i64 rows, i64 cols) {
  const Indexer ix = indexer({rows, cols}, {cols, 1}, {0, 1});  // (R, C) == (C)
  t.add(Kernel::Binary, DType::I64, "eq_i64", dims({rows, cols}) + " == " + std::to_string(cols), kExact, 0,
        kL * (rows * cols + cols) + kF * rows * cols, [=](OpRun& r) {
          auto to_i64 = [](const std::vector<float>& v) {
            return std::vector<std::int64_t>(v.begin(), v.end());
          };
          const std::int64_t* a = r.upload(to_i64(r.host_uniform(rows * cols, 0, 4, true)));
          const std::int64_t* b = r.upload(to_i64(r.host_uniform(cols, 0, 4, true)));
          float* out = r.empty(rows * cols);
          r.output("out", out, rows * cols);
          r.set_call([=](Backend& be, Device d) { be.run<Op::Binary>(d, DType::I64, {BinaryOp::Eq, ix, a, b, out}); });
        });
}

void add_copies(Table& t, i64 n) {
  const std::size_t nbytes = static_cast<std::size_t>(n) * sizeof(float);
  t.add(Kernel::Copy, count(n), kExact, 0, 2 * kF * n, [=](OpRun& r) {
    const float* x = r.uniform(n, -1, 1);
    float* y = r.empty(n);
    r.output("y", y, n);
    r.set_call([=](Backend& b, Device d) { b.copy(y, d, x, d, nbytes); });
  });
  t.add(Kernel::MemsetZero, count(n), kExact, 0, kF * n, [=](OpRun& r) {
    float* y = r.uniform(n, -1, 1);
    r.output("y", y, n);
    r.set_call([=](Backend& b, Device d) { b.memset_zero(y, d, nbytes); });
  });
  t.add(Kernel::CopyFromHost, count(n) + " pinned", kExact, 0, 2 * kF * n, [=](OpRun& r) {
    auto* host = static_cast<float*>(r.pinned(nbytes));
    const std::vector<float> v = r.host_uniform(n, -1, 1);
    std::memcpy(host, v.data(), nbytes);
    float* y = r.empty(n);
    r.output("y", y, n);
    r.set_call([=](Backend& b, Device d) { b.copy_from_host(y, d, host, nbytes); });
  });
  t.add(Kernel::CopyToHost, count(n) + " pinned", kExact, 0, 2 * kF * n, [=](OpRun& r) {
    const float* x = r.uniform(n, -1, 1);
    auto* host = static_cast<float*>(r.pinned(nbytes));
    std::fill(host, host + n, std::nanf(""));
    r.output([=] { return Output{"host", std::vector<float>(host, host + n), {}}; });
    r.set_call([=](Backend& b, Device d) { b.copy_to_host(host, x, d, nbytes); });
  });
}

void add_unary(Table& t, const UnaryRow& u, i64 n) {
  t.add(Kernel::Unary, cat("unary ", u.name), count(n), u.tol, 0, 2 * kF * n,
        [=](OpRun& r) {
          const float* x = r.uniform(n, u.lo, u.hi);
          float* y = r.empty(n);
          r.output("y", y, n);
          r.set_call([=](Backend& b, Device d) { b.run<Op::Unary>(d, DType::F32, {u.op, x, y, n}); });
        });
}

void add_elementwise_misc(Table& t, i64 n) {
  // y may alias x: tanh keeps repeated in-place calls (the benchmark's) finite.
  t.add(Kernel::Unary, "unary tanh", count(n) + " in place", kUlps, 0, 2 * kF * n,
        [=](OpRun& r) {
          float* x = r.uniform(n, -3, 3);
          r.output("x", x, n);
          r.set_call([=](Backend& b, Device d) { b.run<Op::Unary>(d, DType::F32, {UnaryOp::Tanh, x, x, n}); });
        });
  t.add(Kernel::Affine, count(n), kFma, 0, 2 * kF * n, [=](OpRun& r) {
    const float* x = r.uniform(n, -3, 3);
    float* y = r.empty(n);
    r.output("y", y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Affine>(d, DType::F32, {x, y, n, 1.5f, -0.25f}); });
  });
  t.add(Kernel::Axpy, count(n), kFma, 0, 3 * kF * n, [=](OpRun& r) {
    const float* x = r.uniform(n, -3, 3);
    float* y = r.uniform(n, -3, 3);
    r.output("y", y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Axpy>(d, DType::F32, {-0.75f, x, y, n}); });
  });
}

/// The fused LayerNorm (Note [Fused LayerNorm] in cpu_nn.cpp), forward and backward,
/// with and without the affine. Another backend sums in its own order (Note [Fused
/// LayerNorm on CUDA]); the backward's weight and bias gradients are sums over the rows,
/// so its tolerance grows with them (sum_tol).
constexpr Tolerance kLayerNormTol{1e-4, 1e-5};

void add_layer_norm(Table& t, i64 rows, i64 cols) {
  const Tolerance backward_tol = sum_tol(kLayerNormTol, static_cast<double>(rows));
  const i64 n = rows * cols;
  for (bool affine : {true, false}) {
    const std::string tag = cat(" ", rows, "x", cols, affine ? "" : " no affine");
    // No rows: only the affine backward writes anything (gw = gb = 0, its bytes).
    if (rows > 0) {
      t.add(Kernel::LayerNorm, "layer_norm" + tag, count(n), kLayerNormTol, 0, 2 * kF * n, [=](OpRun& r) {
        const float* x = r.uniform(n, -3, 3);
        const float* w = affine ? r.uniform(cols, 0.5f, 1.5f) : nullptr;
        const float* b = affine ? r.uniform(cols, -1, 1) : nullptr;
        float* y = r.empty(n);
        float* mean = r.empty(rows);
        float* rstd = r.empty(rows);
        r.output("y", y, n);
        r.output("mean", mean, rows);
        r.output("rstd", rstd, rows);
        r.set_call([=](Backend& bk, Device d) {
          bk.run<Op::LayerNorm>(d, DType::F32, {x, w, b, y, mean, rstd, rows, cols, 1e-5f});
        });
      });
    }
    if (rows == 0 && !affine) continue;
    t.add(Kernel::LayerNormBackward, "layer_norm_backward" + tag, count(n), backward_tol, 0,
          rows > 0 ? 3 * kF * n : 2 * kF * cols,
          [=](OpRun& r) {
            const float* x = r.uniform(n, -3, 3);
            const float* w = affine ? r.uniform(cols, 0.5f, 1.5f) : nullptr;
            const float* mean = r.uniform(rows, -0.1f, 0.1f);
            const float* rstd = r.uniform(rows, 0.5f, 1.0f);
            const float* gy = r.uniform(n, -1, 1);
            float* gx = r.empty(n);
            float* gw = affine ? r.empty(cols) : nullptr;
            float* gb = affine ? r.empty(cols) : nullptr;
            r.output("gx", gx, n);
            if (affine) {
              r.output("gw", gw, cols);
              r.output("gb", gb, cols);
            }
            r.set_call([=](Backend& bk, Device d) {
              bk.run<Op::LayerNormBackward>(d, DType::F32, {x, w, mean, rstd, gy, gx, gw, gb, rows, cols});
            });
          });
  }
}

/// The fused GELU (Note [Fused GELU] in functors.h), tanh form and exact, forward and
/// backward: tanh_approx, erff and exp_approx, where CUDA contracts FMAs,
/// differ by an ulp or two in a few roundings.
constexpr Tolerance kGeluTol{4e-6, 1e-6};

void add_gelu(Table& t, i64 n) {
  for (bool tanh : {true, false}) {
    const std::string form = tanh ? " tanh" : " exact";
    t.add(Kernel::Gelu, cat("gelu", form), count(n), kGeluTol, 0, 2 * kF * n, [=](OpRun& r) {
      const float* x = r.uniform(n, -6, 6);
      float* y = r.empty(n);
      r.output("y", y, n);
      r.set_call([=](Backend& b, Device d) { b.run<Op::Gelu>(d, DType::F32, {x, y, n, tanh}); });
    });
    t.add(Kernel::GeluBackward, cat("gelu_backward", form), count(n), kGeluTol, 0, 3 * kF * n, [=](OpRun& r) {
      const float* x = r.uniform(n, -6, 6);
      const float* gy = r.uniform(n, -1, 1);
      float* gx = r.empty(n);
      r.output("gx", gx, n);
      r.set_call([=](Backend& b, Device d) { b.run<Op::GeluBackward>(d, DType::F32, {x, gy, gx, n, tanh}); });
    });
  }
}

void add_binary(Table& t, const BinaryRow& row, const std::string& layout, const Indexer& ix) {
  const i64 n = numel(ix), na = extent(ix, ix.strides_a), nb = extent(ix, ix.strides_b);
  t.add(Kernel::Binary, cat("binary ", row.name), layout, row.tol, 0,
        kF * (n + na + nb), [=](OpRun& r) {
          const float* a = r.uniform(na, row.a_lo, row.a_hi, row.integers);
          const float* b = r.uniform(nb, row.b_lo, row.b_hi, row.integers);
          float* out = r.empty(n);
          r.output("out", out, n);
          r.set_call([=](Backend& be, Device d) { be.run<Op::Binary>(d, DType::F32, {row.op, ix, a, b, out}); });
        });
}

/// Every binary op over (R, C) with b of the same shape (the contiguous path), a row
/// (C) and a column (R, 1): the broadcasts of bias adds and per-row scales.
void add_binary_layouts(Table& t, const BinaryRow& row, i64 R, i64 C) {
  add_binary(t, row, dims({R, C}) + " op " + dims({R, C}), indexer({R, C}, {C, 1}, {C, 1}));
  add_binary(t, row, dims({R, C}) + " op " + std::to_string(C), indexer({R, C}, {C, 1}, {0, 1}));
  add_binary(t, row, dims({R, C}) + " op " + dims({R, 1}), indexer({R, C}, {C, 1}, {1, 0}));
}

/// where over ix (a and b strided by it) with cond read through `strides_cond`: cond
/// holds 0, 1, 2 and NaN (every nonzero, NaN included, selects a).
void add_where(Table& t, const std::string& layout, const Indexer& ix, std::initializer_list<i64> strides_cond) {
  dp::backend::WhereArgs w;
  w.ix = ix;
  std::copy(strides_cond.begin(), strides_cond.end(), w.strides_cond);
  const i64 n = numel(ix), na = extent(ix, ix.strides_a), nb = extent(ix, ix.strides_b);
  const i64 nc = extent(ix, w.strides_cond);
  t.add(Kernel::Where, layout, kExact, 0, kF * (n + na + nb + nc), [=](OpRun& r) {
    std::vector<float> c = r.host_uniform(nc, 0, 4, true);
    for (float& v : c) v = v == 3.0f ? std::nanf("") : v;
    dp::backend::WhereArgs args = w;
    args.cond = r.upload(c);
    args.a = r.uniform(na, -3, 3);
    args.b = r.uniform(nb, -3, 3);
    float* out = r.empty(n);
    args.out = out;
    r.output("out", out, n);
    r.set_call([=](Backend& be, Device d) { be.run<Op::Where>(d, DType::F32, args); });
  });
}

void add_strided_copy(Table& t, const std::string& what, const Indexer& ix) {
  const i64 n = numel(ix), na = extent(ix, ix.strides_a);
  t.add(Kernel::StridedCopy, what, kExact, 0, kF * (n + na), [=](OpRun& r) {
    const float* a = r.uniform(na, -1, 1);
    float* out = r.empty(n);
    r.output("out", out, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::StridedCopy>(d, DType::F32, {ix, a, out}); });
  });
}

void add_random(Table& t, i64 n) {
  t.add(Kernel::FillUniform, count(n), kExact, 0, kF * n, [=](OpRun& r) {
    float* y = r.empty(n);
    r.output("y", y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::FillUniform>(d, DType::F32, {y, n, -1.0f, 3.0f, 1234, 77}); });
  });
  // Box-Muller's logf/cosf differ by a few ulps between CPU and CUDA.
  t.add(Kernel::FillNormal, count(n), {4e-6, 4e-6}, 0, kF * n, [=](OpRun& r) {
    float* y = r.empty(n);
    r.output("y", y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::FillNormal>(d, DType::F32, {y, n, 0.5f, 2.0f, 42, 0}); });
  });
  t.add(Kernel::Dropout, count(n) + " p=0.3", kExact, 0, 3 * kF * n, [=](OpRun& r) {
    const float* x = r.uniform(n, -1, 1);
    float* y = r.empty(n);
    float* mask = r.empty(n);
    r.output("y", y, n);
    r.output("mask", mask, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Dropout>(d, DType::F32, {x, y, mask, n, 0.3f, 99, 5}); });
  });
}

void add_reduce(Table& t, const ReduceRow& row, i64 outer, i64 r, i64 inner) {
  const Tolerance tol = row.exact ? kExact : sum_tol({1e-5, 1e-4}, static_cast<double>(r));
  t.add(Kernel::Reduce, cat("reduce ", row.name), cat(dims({outer, r, inner}), " over dim 1"),
        tol, 0, kF * (outer * r * inner + outer * inner), [=](OpRun& run) {
          const float* x = run.uniform(outer * r * inner, -1, 1);
          float* y = run.empty(outer * inner);
          run.output("y", y, outer * inner);
          run.set_call([=](Backend& b, Device d) {
            b.run<Op::Reduce>(d, DType::F32, {row.op, x, y, outer, r, inner});
          });
        });
}

void add_argmax(Table& t, i64 outer, i64 r, i64 inner) {
  t.add(Kernel::Argmax, cat(dims({outer, r, inner}), " over dim 1"), kExact, 0,
        kF * outer * r * inner + kL * outer * inner, [=](OpRun& run) {
          // Whole numbers in [0, 8): ties are common, and the first maximum must win.
          const float* x = run.uniform(outer * r * inner, 0, 8, true);
          std::int64_t* y = run.empty_i64(outer * inner);
          run.output("y", y, outer * inner);
          run.set_call([=](Backend& b, Device d) { b.run<Op::Argmax>(d, DType::F32, {x, y, outer, r, inner}); });
        });
}

void add_count_nonfinite(Table& t, i64 n, bool with_nonfinite) {
  t.add(Kernel::CountNonfinite, count(n) + (with_nonfinite ? " 3 non-finite" : ""), kExact, 0,
        kF * n, [=](OpRun& r) {
          std::vector<float> v = r.host_uniform(n, -1, 1);
          if (with_nonfinite) {
            v[5] = std::nanf("");
            v[static_cast<std::size_t>(n / 2)] = INFINITY;
            v[static_cast<std::size_t>(n - 1)] = -INFINITY;
          }
          const float* x = r.upload(v);
          auto result = std::make_shared<std::int64_t>(OpRun::kUnwritten);
          r.output([result] { return Output{"count", {}, {*result}}; });
          r.set_call([=](Backend& b, Device d) { b.run<Op::CountNonfinite>(d, DType::F32, {x, n, result.get()}); });
        });
}

/// x *= scale in place with the shared flag; with non-finite elements (a NaN, an
/// infinity, and the last element) the outputs are the finite runs between them and
/// the flag, so every output stays finite. The Perf case scales by -1: timing calls it
/// again and again, and x keeps its magnitude (no drift into subnormals).
void add_scale_find_nonfinite(Table& t, i64 n, float scale, bool with_nonfinite) {
  char by[32];
  std::snprintf(by, sizeof by, " by %g", scale);
  t.add(Kernel::ScaleFindNonfinite, cat(count(n), by, with_nonfinite ? " 3 non-finite" : ""), kExact, 0,
        2 * kF * n, [=](OpRun& r) {
          std::vector<float> v = r.host_uniform(n, -1, 1);
          const i64 mid = n / 2;
          if (with_nonfinite) {
            v[5] = std::nanf("");
            v[static_cast<std::size_t>(mid)] = INFINITY;
            v[static_cast<std::size_t>(n - 1)] = -INFINITY;
          }
          float* x = r.upload(v);
          float* found = r.upload(std::vector<float>{0.0f});
          if (with_nonfinite) {
            r.output("x[0, 5)", x, 5);
            r.output("x(5, n/2)", x + 6, mid - 6);
            r.output("x(n/2, n-1)", x + mid + 1, n - 2 - mid);
          } else {
            r.output("x", x, n);
          }
          r.output("found", found, 1);
          r.set_call([=](Backend& b, Device d) {
            b.run<Op::ScaleFindNonfinite>(d, DType::F32, {x, n, scale, found});
          });
        });
}

/// C(m×n) = alpha·op(A)·op(B) + beta·C with every leading dimension `pad` elements
/// longer than its row; C's padding must come back untouched.
void add_gemm(Table& t, i64 m, i64 n, i64 k, bool ta, bool tb, i64 pad, float alpha,
              float beta, const std::string& note = "") {
  const i64 lda = (ta ? m : k) + pad, ldb = (tb ? k : n) + pad, ldc = n + pad;
  const i64 na = (ta ? k : m) * lda, nb = (tb ? n : k) * ldb, nc = m * ldc;
  std::string shape = dims({m, n, k}) + " " + (ta ? "T" : "N") + (tb ? "T" : "N");
  if (pad > 0) shape += " ld+" + std::to_string(pad);
  if (!note.empty()) shape += " " + note;
  t.add(Kernel::Gemm, shape, sum_tol(kGemmBase, static_cast<double>(k)), 2.0 * m * n * k,
        kF * (m * k + k * n + (beta != 0.0f ? 2 : 1) * m * n), [=](OpRun& r) {
          const float* a = r.uniform(na, -1, 1);
          const float* b = r.uniform(nb, -1, 1);
          float* c = r.uniform(nc, -1, 1);
          r.output("c", c, nc);
          r.set_call([=](Backend& be, Device d) {
            be.run<Op::Gemm>(d, DType::F32, {ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, {}});
          });
        });
}

void add_softmax_nll(Table& t, i64 rows, i64 cols) {
  const std::string shape = dims({rows, cols});
  const i64 rc = rows * cols;
  t.add(Kernel::LogSoftmax, shape, {1e-5, 1e-5}, 0, 2 * kF * rc, [=](OpRun& r) {
    const float* x = r.uniform(rc, -6, 6);
    float* y = r.empty(rc);
    r.output("y", y, rc);
    r.set_call([=](Backend& b, Device d) { b.run<Op::LogSoftmax>(d, DType::F32, {x, y, rows, cols}); });
  });
  t.add(Kernel::LogSoftmaxBackward, shape, {1e-5, 1e-5}, 0, 3 * kF * rc, [=](OpRun& r) {
    const float* gy = r.uniform(rc, -1, 1);
    const float* y = r.uniform(rc, -5, 0);  // log-probabilities
    float* gx = r.empty(rc);
    r.output("gx", gx, rc);
    r.set_call([=](Backend& b, Device d) { b.run<Op::LogSoftmaxBackward>(d, DType::F32, {gy, y, gx, rows, cols}); });
  });
  auto targets = [rows, cols] {
    std::vector<std::int64_t> v(static_cast<std::size_t>(rows));
    for (i64 i = 0; i < rows; ++i) v[static_cast<std::size_t>(i)] = (i * 7) % cols;
    return v;
  };
  // Without ignore_index, then with it on every third row: a class in range (every row
  // with that class is ignored: loss 0, no gradient entry) and -100, PyTorch's default,
  // out of range.
  for (const std::int64_t ignore : {be::kNoIgnoreIndex, std::int64_t{3} % cols, std::int64_t{-100}}) {
    const bool none = ignore == be::kNoIgnoreIndex;
    auto with_ignored = [rows, targets, ignore, none] {
      std::vector<std::int64_t> v = targets();
      for (i64 i = 0; i < rows && !none; i += 3) v[static_cast<std::size_t>(i)] = ignore;
      return v;
    };
    const std::string name = none ? shape : shape + " ignore_index " + std::to_string(ignore);
    t.add(Kernel::NllForward, name, kExact, 0, (2 * kF + kL) * rows, [=](OpRun& r) {
      const float* logp = r.uniform(rc, -5, 0);
      const std::int64_t* target = r.upload(with_ignored());
      float* loss = r.uniform(rows, -1, 1);
      r.output("loss", loss, rows);
      r.set_call([=](Backend& b, Device d) {
        b.run<Op::NllForward>(d, DType::F32, {logp, target, loss, rows, cols, ignore});
      });
    });
    t.add(Kernel::NllBackward, name, kExact, 0, (kF + kL) * rows + kF * rc, [=](OpRun& r) {
      const float* gloss = r.uniform(rows, -1, 1);
      const std::int64_t* target = r.upload(with_ignored());
      float* gx = r.uniform(rc, -1, 1);
      r.output("gx", gx, rc);
      r.set_call([=](Backend& b, Device d) {
        b.run<Op::NllBackward>(d, DType::F32, {gloss, target, gx, rows, cols, ignore});
      });
    });
  }
}

/// The three passes of one convolution; without `bias`, only the passes that take
/// one (forward and backward-weight), with a null bias.
/// Winners for pool `s` in the format the run's backend keeps (defined with the pools).
const void* upload_winners(OpRun& r, const be::Pool2dShape& s);

void add_conv(Table& t, const Conv2dShape& s, bool bias = true) {
  const i64 nx = s.N * s.C * s.H * s.W, nw = s.K * s.C * s.R * s.S, ny = s.N * s.K * s.P * s.Q;
  const double flops = 2.0 * s.N * s.K * s.P * s.Q * s.C * s.R * s.S;  // the same for all three
  const std::string shape = conv_name(s) + (bias ? "" : " no bias");
  const double nb = bias ? static_cast<double>(s.K) : 0.0;
  // The forward, and the forward with its ReLU: the inputs' sums are about half
  // negative, so about half the outputs are clipped.
  for (bool relu : {false, true}) {
    t.add(Kernel::Conv2d, DType::F32, relu ? "conv2d_relu_forward" : "conv2d_forward", shape,
          sum_tol(kGemmBase, static_cast<double>(s.C * s.R * s.S)), flops, kF * (nx + nw + nb + ny), [=](OpRun& r) {
            const float* x = r.uniform(nx, -1, 1);
            const float* w = r.uniform(nw, -1, 1);
            const float* b = bias ? r.uniform(s.K, -1, 1) : nullptr;
            float* y = r.empty(ny);
            r.output("y", y, ny);
            r.set_call([=](Backend& be, Device d) { be.run<Op::Conv2d>(d, DType::F32, {s, x, w, b, y, relu}); });
          });
  }
  if (bias) t.add(Kernel::Conv2dBackwardData, conv_name(s),
        sum_tol(kGemmBase, static_cast<double>(s.K * s.R * s.S)), flops, kF * (ny + nw + nx),
        [=](OpRun& r) {
          const float* gy = r.uniform(ny, -1, 1);
          const float* w = r.uniform(nw, -1, 1);
          float* gx = r.empty(nx);
          r.output("gx", gx, nx);
          r.set_call([=](Backend& be, Device d) { be.run<Op::Conv2dBackwardData>(d, DType::F32, {s, gy, w, gx}); });
        });
  t.add(Kernel::Conv2dBackwardWeight, shape,
        sum_tol(kGemmBase, static_cast<double>(s.N * s.P * s.Q)), flops, kF * (nx + ny + nw + nb),
        [=](OpRun& r) {
          const float* x = r.uniform(nx, -1, 1);
          const float* gy = r.uniform(ny, -1, 1);
          float* gw = r.empty(nw);
          float* gb = bias ? r.empty(s.K) : nullptr;
          r.output("gw", gw, nw);
          if (bias) r.output("gbias", gb, s.K);
          r.set_call([=](Backend& be, Device d) {
            be.run<Op::Conv2dBackwardWeight>(d, DType::F32, {s, x, gy, gw, gb});
          });
        });
  // Both passes in one call: the tolerances of the passes.
  if (bias) t.add(Kernel::Conv2dBackward, DType::F32, "conv2d_backward", conv_name(s),
        sum_tol(kGemmBase, static_cast<double>(std::max(s.K * s.R * s.S, s.N * s.P * s.Q))), 2 * flops,
        kF * (nx + ny + nw + nx + nw + nb), [=](OpRun& r) {
          const float* x = r.uniform(nx, -1, 1);
          const float* w = r.uniform(nw, -1, 1);
          const float* gy = r.uniform(ny, -1, 1);
          float* gx = r.empty(nx);
          float* gw = r.empty(nw);
          float* gb = r.empty(s.K);
          r.output("gx", gx, nx);
          r.output("gw", gw, nw);
          r.output("gbias", gb, s.K);
          r.set_call([=](Backend& be, Device d) {
            be.run<Op::Conv2dBackward>(d, DType::F32, {s, gy, x, w, gx, gw, gb});
          });
        });
  // The weight pass alone without a bias, and both passes after the forward's ReLU and
  // 2x2 max-pool (the winners in whichever format the backend keeps: room for int64s).
  if (bias) t.add(Kernel::Conv2dBackward, DType::F32, "conv2d_backward weight only", conv_name(s) + " no bias",
        sum_tol(kGemmBase, static_cast<double>(s.N * s.P * s.Q)), flops, kF * (nx + ny + nw), [=](OpRun& r) {
          const float* x = r.uniform(nx, -1, 1);
          const float* gy = r.uniform(ny, -1, 1);
          float* gw = r.empty(nw);
          r.output("gw", gw, nw);
          r.set_call([=](Backend& be, Device d) {
            be.run<Op::Conv2dBackward>(d, DType::F32, {s, gy, x, nullptr, nullptr, gw, nullptr});
          });
        });
  if (bias && s.P >= 2 && s.Q >= 2 && !s.channels_last) {  // pooled calls are NCHW (nn pools channels-last apart)
    const be::Pool2dShape ps{s.N, s.K, s.P, s.Q, 2, 2, 2, 2, 0, 0, s.P / 2, s.Q / 2};
    const i64 npool = s.N * s.K * ps.P * ps.Q;
    t.add(Kernel::Conv2dBackward, DType::F32, "conv2d_relu_maxpool2d_backward", conv_name(s),
          sum_tol(kGemmBase, static_cast<double>(std::max(s.K * s.R * s.S, s.N * s.P * s.Q))), 2 * flops,
          kF * (nx + nw + 2 * npool + nx + nw + s.K) + npool, [=](OpRun& r) {
            const float* x = r.uniform(nx, -1, 1);
            const float* w = r.uniform(nw, -1, 1);
            const float* gy = r.uniform(npool, -1, 1);
            const float* relu_y = r.uniform(npool, -1, 1);  // about half the windows masked
            const void* winners = upload_winners(r, ps);
            float* gx = r.empty(nx);
            float* gw = r.empty(nw);
            float* gb = r.empty(s.K);
            r.output("gx", gx, nx);
            r.output("gw", gw, nw);
            r.output("gbias", gb, s.K);
            r.set_call([=](Backend& bk, Device d) {
              bk.run<Op::Conv2dBackward>(d, DType::F32, {s, gy, x, w, gx, gw, gb,
                                                         be::ConvPoolBackward{.on = true, .s = ps, .winners = winners,
                                                                              .relu_y = relu_y}});
            });
          });
  }
}

/// One unit in the last place of `dtype` relative to the value: 2^-7 (bf16), 2^-10 (f16).
Tolerance ulp16(DType dtype) { return dtype == DType::BF16 ? Tolerance{0x1.0p-7, 1e-30} : Tolerance{0x1.0p-10, 1e-7}; }

/// `batch` products C_i = op(A_i)·op(B_i) + 0.5·C_i in one call (GemmArgs::batch, a bmm):
/// matrix i of A and of C `gap` elements past the end of matrix i - 1 (strides longer
/// than a matrix); `shared_b`: one B for every product (stride_b 0). float32, or 16-bit
/// with one ulp of the 16-bit type on top of float32's tolerance.
void add_gemm_batched(Table& t, DType dt, i64 batch, i64 m, i64 n, i64 k, bool ta, bool shared_b, i64 gap) {
  const i64 lda = ta ? m : k, ldb = n, ldc = n;
  const i64 sa = m * k + gap, sb = shared_b ? 0 : k * n, sc = m * n + gap;
  const i64 na = batch * sa, nb = shared_b ? k * n : batch * sb, nc = batch * sc;
  const bool f32 = dt == DType::F32;
  const Tolerance sum = sum_tol(kGemmBase, static_cast<double>(k));
  const Tolerance tol = f32 ? sum : Tolerance{ulp16(dt).rtol + sum.rtol, sum.atol};
  const std::string tag = f32 ? std::string("gemm") : "gemm_" + std::string(dp::backend::dtype_name(dt));
  const std::string shape = cat(batch, " x ", dims({m, n, k}), ta ? " TN" : " NN", shared_b ? " one B" : "",
                                gap > 0 ? " gap " + std::to_string(gap) : std::string());
  const double bytes = (f32 ? kF : 2.0) * static_cast<double>(na + nb + 2 * nc);
  t.add(Kernel::Gemm, dt, tag + " batched", shape, tol, 2.0 * batch * m * n * k, bytes, [=](OpRun& r) {
    const void* a = f32 ? static_cast<const void*>(r.uniform(na, -1, 1)) : r.uniform16(dt, na, -1, 1);
    const void* b = f32 ? static_cast<const void*>(r.uniform(nb, -1, 1)) : r.uniform16(dt, nb, -1, 1);
    void* c = f32 ? static_cast<void*>(r.uniform(nc, -1, 1)) : r.uniform16(dt, nc, -1, 1);
    if (f32) {
      r.output("c", static_cast<float*>(c), nc);  // the gaps too: they must come back untouched
    } else {
      r.output16("c", dt, c, nc);
    }
    r.set_call([=](Backend& be, Device d) {
      dp::backend::GemmArgs args{ta, false, m, n, k, 1.0f, a, lda, b, ldb, 0.5f, c, ldc, {}};
      args.batch = batch;
      args.stride_a = sa;
      args.stride_b = sb;
      args.stride_c = sc;
      be.run<Op::Gemm>(d, dt, args);
    });
  });
}

/// Flat h*W + w indices of one element inside each pooling window (clipped to the
/// input), as maxpool2d_forward would return for some input.
std::vector<std::int64_t> window_indices(OpRun& r, const Pool2dShape& s) {
  const i64 ny = s.N * s.C * s.P * s.Q;
  const std::vector<float> u = r.host_uniform(2 * ny, 0, 1);
  std::vector<std::int64_t> idx(static_cast<std::size_t>(ny));
  for (i64 i = 0; i < ny; ++i) {
    const i64 p = (i / s.Q) % s.P, q = i % s.Q;
    const i64 h0 = std::max<i64>(0, p * s.stride_h - s.pad_h);
    const i64 h1 = std::min(s.H, p * s.stride_h - s.pad_h + s.kernel_h);
    const i64 w0 = std::max<i64>(0, q * s.stride_w - s.pad_w);
    const i64 w1 = std::min(s.W, q * s.stride_w - s.pad_w + s.kernel_w);
    const i64 h = std::min(h1 - 1, h0 + static_cast<i64>(u[2 * i] * (h1 - h0)));
    const i64 w = std::min(w1 - 1, w0 + static_cast<i64>(u[2 * i + 1] * (w1 - w0)));
    idx[static_cast<std::size_t>(i)] = h * s.W + w;
  }
  return idx;
}

/// A block for MaxPool2d's winners of `s` in the format the run's backend picks (Note
/// [Max-pool winners] in backend/ops.h), read back as the flat indices they stand for:
/// a byte place k of window (p, q) is 2pW + 2q + (k / 2)W + k % 2, and a byte the call
/// did not write (the block starts as 0xff) reads as OpRun::kUnwritten.
void* winners_output(OpRun& r, const Pool2dShape& s) {
  const i64 ny = s.N * s.C * s.P * s.Q;
  if (!r.backend().max_pool2d_byte_winners(s)) {
    std::int64_t* idx = r.empty_i64(ny);
    r.output("indices", idx, ny);
    return idx;
  }
  std::int32_t* words = r.upload(std::vector<std::int32_t>(static_cast<std::size_t>((ny + 3) / 4), -1));
  r.output([&r, s, ny, words] {
    std::vector<std::uint8_t> bytes(static_cast<std::size_t>((ny + 3) / 4 * 4));
    if (ny > 0) r.backend().copy_to_host(bytes.data(), words, r.device(), bytes.size());
    Output o{"indices", {}, std::vector<std::int64_t>(static_cast<std::size_t>(ny))};
    for (i64 i = 0; i < ny; ++i) {
      const i64 p = (i / s.Q) % s.P, q = i % s.Q, k = bytes[static_cast<std::size_t>(i)];
      o.i64[static_cast<std::size_t>(i)] = k > 3 ? OpRun::kUnwritten : 2 * p * s.W + 2 * q + (k / 2) * s.W + k % 2;
    }
    return o;
  });
  return words;
}

/// The winners of window_indices(r, s), uploaded in the format the run's backend picks.
const void* upload_winners(OpRun& r, const Pool2dShape& s) {
  const std::vector<std::int64_t> idx = window_indices(r, s);
  if (!r.backend().max_pool2d_byte_winners(s)) return r.upload(idx);
  std::vector<std::int32_t> words((idx.size() + 3) / 4, 0);
  for (std::size_t i = 0; i < idx.size(); ++i) {
    const i64 o = static_cast<i64>(i), p = (o / s.Q) % s.P, q = o % s.Q;
    const i64 h = idx[i] / s.W, w = idx[i] % s.W;
    const i64 k = 2 * (h - 2 * p) + (w - 2 * q);  // the place in a 2x2 window
    words[i / 4] |= static_cast<std::int32_t>(k << (8 * (i % 4)));
  }
  return r.upload(words);
}

/// A Conv2d with a ReLU and a max-pool after it (Conv2dArgs::pool): the pooled output.
/// The winners are not compared: near-ties may pick another winner on another backend.
void add_conv_pool(Table& t, const Conv2dShape& s, const Pool2dShape& ps, DType dt = DType::F32) {
  const bool f32 = dt == DType::F32;
  const double es = f32 ? kF : 2;
  const i64 nx = s.N * s.C * s.H * s.W, nw = s.K * s.C * s.R * s.S, ny = ps.N * ps.C * ps.P * ps.Q;
  const double flops = 2.0 * s.N * s.K * s.P * s.Q * s.C * s.R * s.S;
  Tolerance tol = sum_tol(kGemmBase, static_cast<double>(s.C * s.R * s.S));
  if (!f32) tol.rtol += ulp16(dt).rtol;
  t.add(Kernel::Conv2d, dt, f32 ? "conv2d_relu_maxpool2d_forward" : "conv2d_relu_maxpool2d_forward_bfloat16",
        conv_name(s) + " pool " + pool_name(ps), tol, flops, es * (nx + nw + s.K + ny) + ny, [=](OpRun& r) {
          const void* x = f32 ? r.uniform(nx, -1, 1) : r.uniform16(dt, nx, -1, 1);
          const void* w = f32 ? r.uniform(nw, -1, 1) : r.uniform16(dt, nw, -1, 1);
          const void* b = f32 ? r.uniform(s.K, -1, 1) : r.uniform16(dt, s.K, -1, 1);
          void* y = f32 ? static_cast<void*>(r.empty(ny)) : r.empty16(dt, ny);
          if (f32) {
            r.output("y", static_cast<const float*>(y), ny);
          } else {
            r.output16("y", dt, y, ny);
          }
          const i64 nwin = max_pool2d_winner_bytes(r.backend(), ps);
          void* winners = r.upload(std::vector<std::int32_t>(static_cast<std::size_t>((nwin + 3) / 4), -1));
          r.set_call([=](Backend& be, Device d) {
            be.run<Op::Conv2d>(d, dt, {s, x, w, b, y, true, be::ConvPool{.on = true, .s = ps, .winners = winners}});
          });
        });
}

/// A max-pool, forward and backward (without and with the ReLU mask), in the dtype dt:
/// the winners in the backend's format (Note [Max-pool winners]).
void add_pool_dtype(Table& t, const Pool2dShape& s, DType dt) {
  const bool f32 = dt == DType::F32;
  const std::string tag = f32 ? "" : std::string("_") + dp::backend::dtype_name(dt);
  const double es = f32 ? kF : 2;
  const i64 nx = s.N * s.C * s.H * s.W, ny = s.N * s.C * s.P * s.Q;
  const std::string shape = pool_name(s);
  // Overlapping windows add several gradients into one input, in a different order on
  // each backend.
  constexpr Tolerance kPoolTol{1e-6, 1e-6};
  auto input = [=](OpRun& r, i64 n) { return f32 ? static_cast<const void*>(r.uniform(n, -1, 1)) : r.uniform16(dt, n, -1, 1); };
  auto output = [=](OpRun& r, const char* name, i64 n) {
    void* p = f32 ? static_cast<void*>(r.empty(n)) : r.empty16(dt, n);
    if (f32) {
      r.output(name, static_cast<const float*>(p), n);
    } else {
      r.output16(name, dt, p, n);
    }
    return p;
  };
  t.add(Kernel::MaxPool2d, dt, "maxpool2d_forward" + tag, shape, kExact, 0, es * (nx + ny) + kL * ny, [=](OpRun& r) {
    const void* x = input(r, nx);
    void* y = output(r, "y", ny);
    void* winners = winners_output(r, s);
    r.set_call([=](Backend& b, Device d) { b.run<Op::MaxPool2d>(d, dt, {s, x, y, winners}); });
  });
  for (bool masked : {false, true}) {
    t.add(Kernel::MaxPool2dBackward, dt, "maxpool2d_backward" + tag, shape + (masked ? " relu mask" : ""),
          f32 ? kPoolTol : ulp16(dt), 0, es * (ny * (masked ? 2 : 1) + nx) + kL * ny, [=](OpRun& r) {
            const void* gy = input(r, ny);
            const void* winners = upload_winners(r, s);
            const void* relu_y = masked ? input(r, ny) : nullptr;
            void* gx = output(r, "gx", nx);
            r.set_call([=](Backend& b, Device d) { b.run<Op::MaxPool2dBackward>(d, dt, {s, gy, winners, relu_y, gx}); });
          });
  }
}

/// A fused attention's forward and backward (a fusion the CPU and CUDA backends offer); with
/// `masked`, an additive (L, S) mask broadcast over B and H. The backward's out and lse
/// are random: its outputs are the kernel's function of any inputs.
void add_attention(Table& t, const be::AttentionShape& s, bool causal, bool masked) {
  const std::string shape = dims({s.B, s.H, s.L, s.S, s.E, s.Ev}) + (causal ? " causal" : "") +
                            (masked ? " mask LxS" : "");
  const i64 nq = s.B * s.H * s.L * s.E, nk = s.B * s.H * s.S * s.E, nv = s.B * s.H * s.S * s.Ev,
            no = s.B * s.H * s.L * s.Ev, rows = s.B * s.H * s.L;
  const double flops = 2.0 * s.B * s.H * s.L * s.S * (s.E + s.Ev) / (causal ? 2 : 1);
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.E));
  auto mask = [=](OpRun& r) {
    be::AttentionMask m;
    if (masked) m = {.p = r.uniform(s.L * s.S, -2, 0), .sb = 0, .sh = 0, .sl = s.S, .ss = 1, .keep = false, .dtype = DType::F32};
    return m;
  };
  const Tolerance tol = sum_tol(kGemmBase, static_cast<double>(s.S));
  t.add(Kernel::AttentionForward, shape, tol, flops, kF * (nq + nk + nv + no + rows), [=](OpRun& r) {
    const float* q = r.uniform(nq, -1, 1);
    const float* k = r.uniform(nk, -1, 1);
    const float* v = r.uniform(nv, -1, 1);
    const be::AttentionMask m = mask(r);
    float* out = r.empty(no);
    float* lse = r.empty(rows);
    r.output("out", out, no);
    r.output("lse", lse, rows);
    r.set_call([=](Backend& b, Device d) {
      b.run<Op::AttentionForward>(d, DType::F32, {s, q, k, v, m, causal, scale, {}, out, lse});
    });
  });
  t.add(Kernel::AttentionBackward, shape, tol, 2.5 * flops, kF * 2 * (nq + nk + nv + no + rows), [=](OpRun& r) {
    const float* q = r.uniform(nq, -1, 1);
    const float* k = r.uniform(nk, -1, 1);
    const float* v = r.uniform(nv, -1, 1);
    const be::AttentionMask m = mask(r);
    const float* out = r.uniform(no, -1, 1);
    const float* lse = r.uniform(rows, 2, 4);
    const float* gout = r.uniform(no, -1, 1);
    float* gq = r.empty(nq);
    float* gk = r.empty(nk);
    float* gv = r.empty(nv);
    r.output("gq", gq, nq);
    r.output("gk", gk, nk);
    r.output("gv", gv, nv);
    r.set_call([=](Backend& b, Device d) {
      b.run<Op::AttentionBackward>(d, DType::F32, {s, q, k, v, m, causal, scale, {}, out, lse, gout, gq, gk, gv});
    });
  });
}

void add_pool(Table& t, const Pool2dShape& s) {
  const i64 nx = s.N * s.C * s.H * s.W, ny = s.N * s.C * s.P * s.Q;
  const std::string shape = pool_name(s);
  constexpr Tolerance kPoolTol{1e-6, 1e-6};
  add_pool_dtype(t, s, DType::F32);
  t.add(Kernel::AvgPool2d, shape, kPoolTol, 0, kF * (nx + ny), [=](OpRun& r) {
    const float* x = r.uniform(nx, -1, 1);
    float* y = r.empty(ny);
    r.output("y", y, ny);
    r.set_call([=](Backend& b, Device d) { b.run<Op::AvgPool2d>(d, DType::F32, {s, x, y}); });
  });
  t.add(Kernel::AvgPool2dBackward, shape, kPoolTol, 0, kF * (ny + nx), [=](OpRun& r) {
    const float* gy = r.uniform(ny, -1, 1);
    float* gx = r.empty(nx);
    r.output("gx", gx, nx);
    r.set_call([=](Backend& b, Device d) { b.run<Op::AvgPool2dBackward>(d, DType::F32, {s, gy, gx}); });
  });
}

/// `shift`: every (N, C, HW) tensor starts that many elements into its buffer, as a view
/// may (CUDA: the kernels' unaligned path, Note [Per-channel maps]). `dt`: the dtype of
/// x, y, gy and gx (Note [Batch norm in 16 bits]); the statistics and parameters float32.
/// With `cl`, x, y, gy and gx lie N x HW x C (BatchNormTrainArgs::channels_last).
void add_batchnorm(Table& t, i64 N, i64 C, i64 HW, i64 shift = 0, DType dt = DType::F32, bool cl = false) {
  const bool f32 = dt == DType::F32;
  const std::string tag = f32 ? "" : std::string("_") + dp::backend::dtype_name(dt);
  const double es = f32 ? kF : 2;
  const i64 n = N * C * HW;
  const std::string shape = cat("N", N, " C", C, " HW", HW) + (shift ? cat(" at +", shift) : std::string()) +
                            (cl ? " channels-last" : "");
  // Statistics are sums over N·HW values per channel; a 16-bit result may round the
  // other way on top of that.
  const Tolerance sums = sum_tol({1e-4, 1e-5}, static_cast<double>(N * HW));
  const Tolerance tol = f32 ? sums : Tolerance{ulp16(dt).rtol + sums.rtol, sums.atol};
  const Tolerance eval_tol = f32 ? Tolerance{1e-4, 1e-5} : Tolerance{ulp16(dt).rtol + 1e-4, 1e-5};
  constexpr float kEps = 1e-5f, kMomentum = 0.1f;  // PyTorch's defaults
  // An (N, C, HW) tensor of dt, `shift` elements into its buffer: uploaded values, or an
  // output read back.
  auto at_shift = [=](void* p) { return static_cast<void*>(static_cast<char*>(p) + shift * (f32 ? 4 : 2)); };
  auto upload = [=](OpRun& r, const std::vector<float>& v) {
    std::vector<float> padded(static_cast<std::size_t>(shift), 0.0f);
    padded.insert(padded.end(), v.begin(), v.end());
    return at_shift(f32 ? static_cast<void*>(r.upload(padded)) : r.upload16(dt, padded));
  };
  auto output = [=](OpRun& r, const char* name) {
    void* p = at_shift(f32 ? static_cast<void*>(r.empty(n + shift)) : r.empty16(dt, n + shift));
    if (f32) {
      r.output(name, static_cast<const float*>(p), n);
    } else {
      r.output16(name, dt, p, n);
    }
    return p;
  };
  for (bool running : {true, false}) {
    t.add(Kernel::BatchNormTrain, dt, "batchnorm_forward_train" + tag, shape + (running ? "" : " no running stats"),
          tol, 0, es * 2 * n + kF * 8 * C, [=](OpRun& r) {
            const void* x = upload(r, r.host_uniform(n, -4, 4));
            const float* gamma = r.uniform(C, 0.1f, 2);
            const float* beta = r.uniform(C, -1, 1);
            float* rmean = running ? r.uniform(C, -1, 1) : nullptr;
            float* rvar = running ? r.uniform(C, 0.1f, 2) : nullptr;
            void* y = output(r, "y");
            float* mean = r.empty(C);
            float* invstd = r.empty(C);
            r.output("save_mean", mean, C);
            r.output("save_invstd", invstd, C);
            if (running) {
              r.output("running_mean", rmean, C);
              r.output("running_var", rvar, C);
            }
            r.set_call([=](Backend& b, Device d) {
              b.run<Op::BatchNormTrain>(d, dt,
                                        {N, C, HW, x, gamma, beta, kEps, kMomentum, rmean, rvar, y, mean, invstd, cl});
            });
          });
  }
  t.add(Kernel::BatchNormEval, dt, "batchnorm_forward_eval" + tag, shape, eval_tol, 0, es * 2 * n + kF * 4 * C,
        [=](OpRun& r) {
          const void* x = upload(r, r.host_uniform(n, -4, 4));
          const float* gamma = r.uniform(C, 0.1f, 2);
          const float* beta = r.uniform(C, -1, 1);
          const float* rmean = r.uniform(C, -1, 1);
          const float* rvar = r.uniform(C, 0.1f, 2);
          void* y = output(r, "y");
          r.set_call([=](Backend& b, Device d) {
            b.run<Op::BatchNormEval>(d, dt, {N, C, HW, x, gamma, beta, kEps, rmean, rvar, y, cl});
          });
        });
  t.add(Kernel::BatchNormBackward, dt, "batchnorm_backward" + tag, shape, tol, 0, es * 3 * n + kF * 5 * C,
        [=](OpRun& r) {
          // The saved statistics are x's own (computed here in double, from the values x
          // holds in dt), as after a forward.
          std::vector<float> xh = r.host_uniform(n, -4, 4);
          if (!f32) {
            for (float& v : xh) v = dt == DType::BF16 ? float(dp::BFloat16(v)) : float(dp::Float16(v));
          }
          std::vector<float> mean(static_cast<std::size_t>(C)), invstd(static_cast<std::size_t>(C));
          for (i64 c = 0; c < C; ++c) {
            double s = 0, ss = 0;
            for (i64 i = 0; i < N; ++i)
              for (i64 j = 0; j < HW; ++j) {
                const double v = xh[static_cast<std::size_t>(cl ? (i * HW + j) * C + c : (i * C + c) * HW + j)];
                s += v;
                ss += v * v;
              }
            const double m = s / static_cast<double>(N * HW);
            mean[static_cast<std::size_t>(c)] = static_cast<float>(m);
            invstd[static_cast<std::size_t>(c)] =
                static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(N * HW) - m * m + kEps));
          }
          const void* x = upload(r, xh);
          const void* gy = upload(r, r.host_uniform(n, -1, 1));
          const float* gamma = r.uniform(C, 0.1f, 2);
          const float* save_mean = r.upload(mean);
          const float* save_invstd = r.upload(invstd);
          void* gx = output(r, "gx");
          float* ggamma = r.empty(C);
          float* gbeta = r.empty(C);
          r.output("ggamma", ggamma, C);
          r.output("gbeta", gbeta, C);
          r.set_call([=](Backend& b, Device d) {
            b.run<Op::BatchNormBackward>(d, dt,
                                         {N, C, HW, gy, x, gamma, save_mean, save_invstd, gx, ggamma, gbeta, cl});
          });
        });
}

void add_optim(Table& t, i64 n, bool all_variants) {
  constexpr Tolerance kOptimTol{1e-5, 1e-6};
  struct Sgd {
    const char* what;
    float momentum;
    bool nesterov, first_step;
  };
  std::vector<Sgd> sgds{{"momentum", 0.9f, false, false}};
  if (all_variants)
    sgds = {{"no momentum", 0.0f, false, false}, {"momentum first step", 0.9f, false, true},
            {"momentum", 0.9f, false, false}, {"nesterov", 0.9f, true, false}};
  for (const Sgd& v : sgds) {
    const int buffers = v.momentum != 0.0f ? 3 : 2;  // param, grad (, momentum buffer)
    t.add(Kernel::SgdStep, count(n) + " " + v.what, kOptimTol, 0,
          kF * n * (buffers + buffers - 1), [=](OpRun& r) {
            float* p = r.uniform(n, -1, 1);
            const float* g = r.uniform(n, -1, 1);
            float* buf = v.momentum != 0.0f ? r.uniform(n, -1, 1) : nullptr;
            r.output("param", p, n);
            if (buf) r.output("momentum_buf", buf, n);
            r.set_call([=](Backend& b, Device d) {
              b.run<Op::SgdStep>(d, DType::F32,
                                 {p, g, buf, n, 0.1f, v.momentum, 0.1f, 1e-4f, v.nesterov, v.first_step});
            });
          });
  }
  for (bool decoupled : {false, true}) {
    if (!all_variants && !decoupled) continue;
    t.add(Kernel::AdamStep, count(n) + (decoupled ? " AdamW" : " Adam") + " step 3", kOptimTol, 0,
          kF * n * 7, [=](OpRun& r) {
            float* p = r.uniform(n, -1, 1);
            const float* g = r.uniform(n, -1, 1);
            float* m = r.uniform(n, -1, 1);
            float* v = r.uniform(n, 0, 1);  // a second moment is non-negative
            r.output("param", p, n);
            r.output("exp_avg", m, n);
            r.output("exp_avg_sq", v, n);
            r.set_call([=](Backend& b, Device d) {
              b.run<Op::AdamStep>(d, DType::F32, {p, g, m, v, n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, decoupled, 3});
            });
          });
  }
}

/// Small and odd shapes that reach every code path; the tests run these.
// ---- 16-bit floating dtypes ------------------------------------------------------------------
// One case per (op, 16-bit dtype) the backends register (Note [Storage types] in
// backend/functors.h): the float math is float32's, so a backend may differ from the CPU
// by the one rounding of its result to the 16-bit dtype — one unit in the last place.


void add_16bit(Table& t, DType dt, i64 n) {
  const std::string tag = dp::backend::dtype_name(dt);
  const Tolerance ulp = ulp16(dt);
  constexpr double k2 = 2;  // bytes per element
  t.add(Kernel::Fill, dt, "fill_" + tag, count(n), kExact, 0, k2 * n, [=](OpRun& r) {
    void* y = r.empty16(dt, n);
    r.output16("y", dt, y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Fill>(d, dt, {y, n, 3.5f}); });
  });
  t.add(Kernel::Cast, dt, "cast_f32_to_" + tag, count(n), kExact, 0, (kF + k2) * n, [=](OpRun& r) {
    // Wide magnitudes, so that subnormals, overflow to infinity and ties all occur.
    std::vector<float> v = r.host_uniform(n, -1.0f, 1.0f);
    for (i64 i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] *= std::ldexp(1.0f, static_cast<int>(i % 40) - 26);
    const float* x = r.upload(v);
    void* y = r.empty16(dt, n);
    r.output16("y", dt, y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Cast>(d, dt, {x, DType::F32, y, n}); });
  });
  // One element into both buffers: pointers off their 16-byte packs, so the CUDA cast
  // moves elements one by one (Note [Packed elementwise access]).
  t.add(Kernel::Cast, dt, "cast_f32_to_" + tag, count(n) + " at an odd offset", kExact, 0, (kF + k2) * n,
        [=](OpRun& r) {
          const float* x = r.uniform(n + 1, -3.0f, 3.0f) + 1;
          void* y = static_cast<std::uint16_t*>(r.empty16(dt, n + 1)) + 1;
          r.output16("y", dt, y, n);
          r.set_call([=](Backend& b, Device d) { b.run<Op::Cast>(d, dt, {x, DType::F32, y, n}); });
        });
  t.add(Kernel::Cast, DType::F32, "cast_" + tag + "_to_f32", count(n), kExact, 0, (kF + k2) * n, [=](OpRun& r) {
    const void* x = r.uniform16(dt, n, -100.0f, 100.0f);
    float* y = r.empty(n);
    r.output("y", y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Cast>(d, DType::F32, {x, dt, y, n}); });
  });
  t.add(Kernel::Unary, dt, "unary exp " + tag, count(n), ulp, 0, 2 * k2 * n, [=](OpRun& r) {
    const void* x = r.uniform16(dt, n, -4.0f, 4.0f);
    void* y = r.empty16(dt, n);
    r.output16("y", dt, y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Unary>(d, dt, {UnaryOp::Exp, x, y, n}); });
  });
  for (bool tanh : {true, false}) {
    const std::string form = tanh ? "_tanh_" : "_exact_";
    t.add(Kernel::Gelu, dt, "gelu" + form + tag, count(n), ulp, 0, 2 * k2 * n, [=](OpRun& r) {
      const void* x = r.uniform16(dt, n, -6.0f, 6.0f);
      void* y = r.empty16(dt, n);
      r.output16("y", dt, y, n);
      r.set_call([=](Backend& b, Device d) { b.run<Op::Gelu>(d, dt, {x, y, n, tanh}); });
    });
    t.add(Kernel::GeluBackward, dt, "gelu_backward" + form + tag, count(n), ulp, 0, 3 * k2 * n, [=](OpRun& r) {
      const void* x = r.uniform16(dt, n, -6.0f, 6.0f);
      const void* gy = r.uniform16(dt, n, -1.0f, 1.0f);
      void* gx = r.empty16(dt, n);
      r.output16("gx", dt, gx, n);
      r.set_call([=](Backend& b, Device d) { b.run<Op::GeluBackward>(d, dt, {x, gy, gx, n, tanh}); });
    });
  }
  t.add(Kernel::Affine, dt, "affine_" + tag, count(n), ulp, 2.0 * n, 2 * k2 * n, [=](OpRun& r) {
    const void* x = r.uniform16(dt, n, -4.0f, 4.0f);
    void* y = r.empty16(dt, n);
    r.output16("y", dt, y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Affine>(d, dt, {x, y, n, 0.7f, -0.3f}); });
  });
  t.add(Kernel::Axpy, dt, "axpy_" + tag, count(n), ulp, 2.0 * n, 3 * k2 * n, [=](OpRun& r) {
    const void* x = r.uniform16(dt, n, -4.0f, 4.0f);
    void* y = r.uniform16(dt, n, -4.0f, 4.0f);
    r.output16("y", dt, y, n);
    r.set_call([=](Backend& b, Device d) { b.run<Op::Axpy>(d, dt, {-0.5f, x, y, n}); });
  });
  {
    const i64 rows = 331, cols = 127;  // (R, C) * (C): a row broadcast
    const Indexer ix = indexer({rows, cols}, {cols, 1}, {0, 1});
    t.add(Kernel::Binary, dt, "binary mul " + tag, dims({rows, cols}) + " op " + std::to_string(cols), ulp,
          double(rows * cols), k2 * (2 * rows * cols + cols), [=](OpRun& r) {
            const void* a = r.uniform16(dt, rows * cols, -4.0f, 4.0f);
            const void* b = r.uniform16(dt, cols, -4.0f, 4.0f);
            void* out = r.empty16(dt, rows * cols);
            r.output16("out", dt, out, rows * cols);
            r.set_call([=](Backend& be, Device d) { be.run<Op::Binary>(d, dt, {BinaryOp::Mul, ix, a, b, out}); });
          });
    t.add(Kernel::Where, dt, "where_" + tag, "cond " + dims({rows, cols}) + " ? a : " + std::to_string(cols),
          kExact, 0, (kF + 2 * k2) * rows * cols + k2 * cols, [=](OpRun& r) {
            dp::backend::WhereArgs w;
            w.ix = ix;
            w.strides_cond[0] = cols;
            w.strides_cond[1] = 1;
            w.cond = r.uniform(rows * cols, 0, 2, true);
            w.a = r.uniform16(dt, rows * cols, -4.0f, 4.0f);
            w.b = r.uniform16(dt, cols, -4.0f, 4.0f);
            void* out = r.empty16(dt, rows * cols);
            w.out = out;
            r.output16("out", dt, out, rows * cols);
            r.set_call([=](Backend& be, Device d) { be.run<Op::Where>(d, dt, w); });
          });
    const Indexer tix = indexer({cols, rows}, {1, cols}, {0, 0});
    t.add(Kernel::StridedCopy, dt, "strided_copy_" + tag, dims({rows, cols}) + " transposed", kExact, 0,
          2 * k2 * rows * cols, [=](OpRun& r) {
            const void* a = r.uniform16(dt, rows * cols, -4.0f, 4.0f);
            void* out = r.empty16(dt, rows * cols);
            r.output16("out", dt, out, rows * cols);
            r.set_call([=](Backend& be, Device d) { be.run<Op::StridedCopy>(d, dt, {tix, a, out}); });
          });
  }
  {
    // The layouts the CUDA kernels move in packs of 16 bytes (Note [Packed elementwise
    // access] in backend/elementwise_walk.h): a bias add, a per-channel scale whose
    // channel fills a pack, and a transformer's head split (B, T, H, D) -> (B, H, T, D).
    const i64 rows = 129, cols = 96, N = 3, C = 5, HW = 40, B = 2, T = 33, H = 3, D = 64;
    const Indexer bias = indexer({rows, cols}, {cols, 1}, {0, 1});
    t.add(Kernel::Binary, dt, "binary add " + tag, dims({rows, cols}) + " op " + std::to_string(cols) + " (packed)",
          ulp, double(rows * cols), k2 * (2 * rows * cols + cols), [=](OpRun& r) {
            const void* a = r.uniform16(dt, rows * cols, -4.0f, 4.0f);
            const void* b = r.uniform16(dt, cols, -4.0f, 4.0f);
            void* out = r.empty16(dt, rows * cols);
            r.output16("out", dt, out, rows * cols);
            r.set_call([=](Backend& be, Device d) { be.run<Op::Binary>(d, dt, {BinaryOp::Add, bias, a, b, out}); });
          });
    const Indexer channel = indexer({N, C, HW}, {C * HW, HW, 1}, {0, 1, 0});
    t.add(Kernel::Binary, dt, "binary mul " + tag, dims({N, C, HW}) + " op " + dims({C, 1}) + " (packed)", ulp,
          double(N * C * HW), k2 * (2 * N * C * HW + C), [=](OpRun& r) {
            const void* a = r.uniform16(dt, N * C * HW, -4.0f, 4.0f);
            const void* b = r.uniform16(dt, C, -4.0f, 4.0f);
            void* out = r.empty16(dt, N * C * HW);
            r.output16("out", dt, out, N * C * HW);
            r.set_call([=](Backend& be, Device d) { be.run<Op::Binary>(d, dt, {BinaryOp::Mul, channel, a, b, out}); });
          });
    const Indexer heads = indexer({B, H, T, D}, {T * H * D, D, H * D, 1}, {0, 0, 0, 0});
    const i64 nh = B * T * H * D;
    const std::string split = dims({B, T, H, D}) + " to " + dims({B, H, T, D}) + " (packed)";
    t.add(Kernel::StridedCopy, dt, "strided_copy_" + tag, split, kExact, 0, 2 * k2 * nh, [=](OpRun& r) {
      const void* a = r.uniform16(dt, nh, -4.0f, 4.0f);
      void* out = r.empty16(dt, nh);
      r.output16("out", dt, out, nh);
      r.set_call([=](Backend& be, Device d) { be.run<Op::StridedCopy>(d, dt, {heads, a, out}); });
    });
  }
  {
    const i64 outer = 7, r_ = 300, inner = 23, m = 211;  // index_select of m rows along dim 1
    const Indexer ix = indexer({outer, m, inner}, {r_ * inner, inner, 1}, {0, 1, 0});
    const i64 nout = outer * m * inner;
    auto indices = [=](OpRun& r) {
      std::vector<float> u = r.host_uniform(m, 0, static_cast<float>(r_), true);
      return std::vector<std::int64_t>(u.begin(), u.end());
    };
    const std::string shape = dims({outer, r_, inner}) + " select " + std::to_string(m) + " on dim 1";
    t.add(Kernel::Gather, dt, "gather_" + tag, shape, kExact, 0, 2 * k2 * nout + kL * m, [=](OpRun& r) {
      const void* x = r.uniform16(dt, outer * r_ * inner, -1, 1);
      const std::int64_t* idx = r.upload(indices(r));
      void* out = r.empty16(dt, nout);
      r.output16("out", dt, out, nout);
      r.set_call([=](Backend& b, Device d) { b.run<Op::Gather>(d, dt, {ix, 1, x, idx, out}); });
    });
    // Small integers: every partial sum is exact in the 16-bit dtype, in any order.
    t.add(Kernel::ScatterAdd, dt, "scatter_add_" + tag, shape, kExact, 0, 3 * k2 * nout + kL * m, [=](OpRun& r) {
      const void* src = r.uniform16(dt, nout, -2, 2, true);
      const std::int64_t* idx = r.upload(indices(r));
      void* y = r.uniform16(dt, outer * r_ * inner, -2, 2, true);
      r.output16("y", dt, y, outer * r_ * inner);
      r.set_call([=](Backend& b, Device d) { b.run<Op::ScatterAdd>(d, dt, {ix, 1, src, idx, y}); });
    });
  }
  for (bool ta : {false, true}) {
    const i64 m = 33, nn = 47, k = 29;
    const i64 lda = ta ? m : k, ldb = nn, ldc = nn;
    const Tolerance tol{ulp.rtol + kGemmBase.rtol, kGemmBase.atol};
    t.add(Kernel::Gemm, dt, "gemm_" + tag, dims({m, nn, k}) + (ta ? " TN" : " NN") + " beta 0.5", tol,
          2.0 * m * nn * k, k2 * (m * k + k * nn + 2 * m * nn), [=](OpRun& r) {
            const void* a = r.uniform16(dt, m * k, -1, 1);
            const void* b = r.uniform16(dt, k * nn, -1, 1);
            void* c = r.uniform16(dt, m * nn, -1, 1);
            r.output16("c", dt, c, m * nn);
            r.set_call([=](Backend& be, Device d) {
              be.run<Op::Gemm>(d, dt, {ta, false, m, nn, k, 1.0f, a, lda, b, ldb, 0.5f, c, ldc, {}});
            });
          });
  }
  // A Linear's forward, y = x·wᵀ + b (Note [16-bit Linear: the bias in the one rounding]
  // in src/tensor/ops.cpp), on values whose float32 sums are exact in any order: x in
  // eighths and w in sixteenths of [-4, 4) and b in sixteenths of [-8, 8) (all exact in
  // both 16-bit dtypes), so every product and partial sum is a multiple of 2^-7 below
  // 2^10 in size, 17 bits. The sum plus the
  // bias, rounded once, is then one value that every backend must give bit for bit,
  // where rounding it before the bias moves it (most outputs need more than bfloat16's
  // 8 bits). 40 x 80 x 63: two slabs of rows, and an odd k (Note [bf16 GEMMs with an odd
  // k on AMX]); 5 x 24 x 16: one slab, 16-byte rows.
  for (const auto& [m, nn, k] : {std::array<i64, 3>{40, 80, 63}, std::array<i64, 3>{5, 24, 16}}) {
    t.add(Kernel::Gemm, dt, "gemm_" + tag, dims({m, nn, k}) + " NT + bias (a Linear)", kExact, 2.0 * m * nn * k,
          k2 * (m * k + k * nn + m * nn + nn), [=](OpRun& r) {
            auto scaled = [&r](i64 n, float lo, float hi, float unit) {
              std::vector<float> v = r.host_uniform(n, lo, hi, true);
              for (float& x : v) x *= unit;
              return v;
            };
            const void* x = r.upload16(dt, scaled(m * k, -32, 32, 0x1p-3f));
            const void* w = r.upload16(dt, scaled(nn * k, -64, 64, 0x1p-4f));
            const void* bias = r.upload16(dt, scaled(nn, -128, 128, 0x1p-4f));
            void* y = r.empty16(dt, m * nn);
            r.output16("y", dt, y, m * nn);
            r.set_call([=](Backend& be, Device d) {
              be.run<Op::Gemm>(d, dt, {false, true, m, nn, k, 1.0f, x, k, w, k, 0.0f, y, nn, {bias}});
            });
          });
  }
}

/// The three passes of a bfloat16 convolution (the CPU's: Note [bf16 convolutions
/// through oneDNN]; CUDA's: Note [16-bit convolutions on CUDA]): each backend sums in
/// float32 in its own order and rounds once to bfloat16, so one bfloat16 ulp on top of
/// the float32 sum's tolerance.
void add_conv_bf16(Table& t, const Conv2dShape& s) {
  const DType dt = DType::BF16;
  const i64 nx = s.N * s.C * s.H * s.W, nw = s.K * s.C * s.R * s.S, ny = s.N * s.K * s.P * s.Q;
  const double flops = 2.0 * s.N * s.K * s.P * s.Q * s.C * s.R * s.S;
  constexpr double k2 = 2;  // bytes per element
  auto tol = [](double terms) {
    const Tolerance f = sum_tol(kGemmBase, terms);
    return Tolerance{f.rtol + ulp16(DType::BF16).rtol, f.atol};
  };
  for (bool relu : {false, true}) {
    t.add(Kernel::Conv2d, dt, relu ? "conv2d_relu_forward_bfloat16" : "conv2d_forward_bfloat16", conv_name(s),
          tol(static_cast<double>(s.C * s.R * s.S)), flops, k2 * (nx + nw + s.K + ny), [=](OpRun& r) {
            const void* x = r.uniform16(dt, nx, -1, 1);
            const void* w = r.uniform16(dt, nw, -1, 1);
            const void* b = r.uniform16(dt, s.K, -1, 1);
            void* y = r.empty16(dt, ny);
            r.output16("y", dt, y, ny);
            r.set_call([=](Backend& be, Device d) { be.run<Op::Conv2d>(d, dt, {s, x, w, b, y, relu}); });
          });
  }
  t.add(Kernel::Conv2dBackwardData, dt, "conv2d_backward_data_bfloat16", conv_name(s),
        tol(static_cast<double>(s.K * s.R * s.S)), flops, k2 * (ny + nw + nx), [=](OpRun& r) {
          const void* gy = r.uniform16(dt, ny, -1, 1);
          const void* w = r.uniform16(dt, nw, -1, 1);
          void* gx = r.empty16(dt, nx);
          r.output16("gx", dt, gx, nx);
          r.set_call([=](Backend& be, Device d) { be.run<Op::Conv2dBackwardData>(d, dt, {s, gy, w, gx}); });
        });
  t.add(Kernel::Conv2dBackwardWeight, dt, "conv2d_backward_weight_bfloat16", conv_name(s),
        tol(static_cast<double>(s.N * s.P * s.Q)), flops, k2 * (nx + ny + nw + s.K), [=](OpRun& r) {
          const void* x = r.uniform16(dt, nx, -1, 1);
          const void* gy = r.uniform16(dt, ny, -1, 1);
          void* gw = r.empty16(dt, nw);
          void* gb = r.empty16(dt, s.K);
          r.output16("gw", dt, gw, nw);
          r.output16("gbias", dt, gb, s.K);
          r.set_call([=](Backend& be, Device d) { be.run<Op::Conv2dBackwardWeight>(d, dt, {s, x, gy, gw, gb}); });
        });
  t.add(Kernel::Conv2dBackward, dt, "conv2d_backward_bfloat16", conv_name(s),
        tol(static_cast<double>(std::max(s.K * s.R * s.S, s.N * s.P * s.Q))), 2 * flops,
        k2 * (nx + ny + nw + nx + nw + s.K), [=](OpRun& r) {
          const void* x = r.uniform16(dt, nx, -1, 1);
          const void* w = r.uniform16(dt, nw, -1, 1);
          const void* gy = r.uniform16(dt, ny, -1, 1);
          void* gx = r.empty16(dt, nx);
          void* gw = r.empty16(dt, nw);
          void* gb = r.empty16(dt, s.K);
          r.output16("gx", dt, gx, nx);
          r.output16("gw", dt, gw, nw);
          r.output16("gbias", dt, gb, s.K);
          r.set_call([=](Backend& be, Device d) { be.run<Op::Conv2dBackward>(d, dt, {s, gy, x, w, gx, gw, gb}); });
        });
}

/// The fused attention in a 16-bit dtype (float32 inside, out and gradients rounded once:
/// Note [Fused attention]), causal, with a mask of the call's dtype and dropout: the
/// float32 case's tolerance plus one unit in the last place.
void add_attention_16bit(Table& t, DType dt, const be::AttentionShape& s) {
  const std::string tag = dp::backend::dtype_name(dt);
  const std::string shape = dims({s.B, s.H, s.L, s.S, s.E, s.Ev}) + " causal mask LxS dropout 0.25";
  const i64 nq = s.B * s.H * s.L * s.E, nk = s.B * s.H * s.S * s.E, nv = s.B * s.H * s.S * s.Ev,
            no = s.B * s.H * s.L * s.Ev, rows = s.B * s.H * s.L;
  const double flops = 2.0 * s.B * s.H * s.L * s.S * (s.E + s.Ev) / 2;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.E));
  constexpr double k2 = 2;  // bytes per element
  const be::AttentionDropout drop{.p = 0.25f, .seed = 11, .offset = 1000};
  auto mask = [=](OpRun& r) {
    return be::AttentionMask{.p = r.uniform16(dt, s.L * s.S, -2, 0), .sb = 0, .sh = 0, .sl = s.S, .ss = 1,
                             .keep = false, .dtype = dt};
  };
  const Tolerance f = sum_tol(kGemmBase, static_cast<double>(s.S));
  const Tolerance tol{f.rtol + ulp16(dt).rtol, f.atol + ulp16(dt).atol};
  t.add(Kernel::AttentionForward, dt, "attention_forward_" + tag, shape, tol, flops,
        k2 * (nq + nk + nv + no) + kF * rows, [=](OpRun& r) {
          const void* q = r.uniform16(dt, nq, -1, 1);
          const void* k = r.uniform16(dt, nk, -1, 1);
          const void* v = r.uniform16(dt, nv, -1, 1);
          const be::AttentionMask m = mask(r);
          void* out = r.empty16(dt, no);
          float* lse = r.empty(rows);
          r.output16("out", dt, out, no);
          r.output("lse", lse, rows);
          r.set_call([=](Backend& b, Device d) {
            b.run<Op::AttentionForward>(d, dt, {s, q, k, v, m, true, scale, drop, out, lse});
          });
        });
  t.add(Kernel::AttentionBackward, dt, "attention_backward_" + tag, shape, tol, 2.5 * flops,
        2 * (k2 * (nq + nk + nv + no) + kF * rows), [=](OpRun& r) {
          const void* q = r.uniform16(dt, nq, -1, 1);
          const void* k = r.uniform16(dt, nk, -1, 1);
          const void* v = r.uniform16(dt, nv, -1, 1);
          const be::AttentionMask m = mask(r);
          const void* out = r.uniform16(dt, no, -1, 1);
          const float* lse = r.uniform(rows, 2, 4);
          const void* gout = r.uniform16(dt, no, -1, 1);
          void* gq = r.empty16(dt, nq);
          void* gk = r.empty16(dt, nk);
          void* gv = r.empty16(dt, nv);
          r.output16("gq", dt, gq, nq);
          r.output16("gk", dt, gk, nk);
          r.output16("gv", dt, gv, nv);
          r.set_call([=](Backend& b, Device d) {
            b.run<Op::AttentionBackward>(d, dt, {s, q, k, v, m, true, scale, drop, out, lse, gout, gq, gk, gv});
          });
        });
}

void add_check_suite(Table& t) {
  t.suite = Suite::Check;
  add_fill(t, kCheckN);
  add_integer_and_cast(t, kCheckN);
  add_eq_i64(t, 331, 127);
  add_int32_casts(t, kCheckN);
  add_16bit(t, DType::BF16, kCheckN);
  add_16bit(t, DType::F16, kCheckN);
  add_conv_bf16(t, conv(5, 3, 11, 13, 8, 3, 3, 2, 1, 1, 0));  // odd sizes, stride and padding per axis
  // 7 x 300 x 23 gathered to 7 x 211 x 23 = 33971 elements: above the parallel grain.
  add_gather(t, 7, 300, 23, 211, false);
  add_gather(t, 7, 300, 23, 211, true);
  add_scatter_rows(t, 1000, 50, 37);
  add_scatter_rows(t, 3, 5, 1);
  add_copies(t, kCheckN);
  for (const UnaryRow& u : kUnaryRows) add_unary(t, u, kCheckN);
  add_elementwise_misc(t, kCheckN);
  add_gelu(t, kCheckN);
  // Rows of 127 (a lane tail; CUDA: a warp a row) and enough of them that the
  // backward's weight sums cross blocks (CPU: 64 rows, CUDA: 16-row tiles); 1029 columns
  // (CUDA: a block a row, in registers) and 4500 (over what a block holds: the row read
  // again each pass); one column; no rows (gw and gb written as 0); 20000 rows
  // (CUDA: the capped count of tiles, uneven, added in slices).
  add_layer_norm(t, 331, 127);
  add_layer_norm(t, 67, 1029);
  add_layer_norm(t, 40, 4500);
  add_layer_norm(t, 300, 1);
  add_layer_norm(t, 0, 127);
  add_layer_norm(t, 20001, 3);  // past the tile cap: an uneven last tile, uneven slices
  // Every register count of both kinds of team, and the thresholds between them.
  for (i64 cols : {64, 256, 512, 513, 768, 4096, 4097}) add_layer_norm(t, 19, cols);
  // 331 x 127 = 42037 elements: above the CPU's parallel grain.
  for (const BinaryRow& b : kBinaryRows) add_binary_layouts(t, b, 331, 127);
  // out (16, 11, 300) = a (16, 1, 300) + b (1, 11, 1): both sides broadcast, 3-d walk.
  add_binary(t, kBinaryRows[0], "16x1x300 op 1x11x1",
             indexer({16, 11, 300}, {300, 0, 1}, {0, 1, 0}));
  // out (7, 33, 70): a contiguous, b one value, cond (33, 70) broadcast over dim 0 (an
  // attention mask over heads); then cond and b transposed, a a row.
  add_where(t, "cond 33x70 ? 7x33x70 : scalar", indexer({7, 33, 70}, {33 * 70, 70, 1}, {0, 0, 0}), {0, 70, 1});
  add_where(t, "cond 70x33^T ? 70 : 70x33^T", indexer({33, 70}, {0, 1}, {1, 33}), {1, 33});
  add_strided_copy(t, "331x127 transposed", indexer({127, 331}, {1, 127}, {0, 0}));
  add_strided_copy(t, count(kCheckN) + " contiguous", indexer({kCheckN}, {1}, {0}));
  add_strided_copy(t, "8x33x70 permuted (2,0,1)",
                   indexer({70, 8, 33}, {1, 33 * 70, 70}, {0, 0, 0}));
  add_random(t, kCheckN);
  for (const ReduceRow& row : kReduceRows) {
    // Rows, long rows, a middle dimension, columns, and an empty reduction (sum only:
    // max and min have no identity).
    for (auto [outer, r, inner] : {std::array<i64, 3>{64, 10, 1}, {3, 5000, 1}, {8, 33, 70},
                                   {1, 1000, 3}, {5, 0, 4}}) {
      if (r == 0 && row.op != ReduceOp::Sum) continue;
      add_reduce(t, row, outer, r, inner);
    }
  }
  for (auto [outer, r, inner] : {std::array<i64, 3>{64, 10, 1}, {3, 5000, 1}, {8, 33, 70},
                                 {1, 1000, 3}})
    add_argmax(t, outer, r, inner);
  add_count_nonfinite(t, kCheckN, true);
  add_scale_find_nonfinite(t, kCheckN, 0.3f, true);  // products that round; the flag set
  add_scale_find_nonfinite(t, kCheckN, 0.3f, false);
  for (bool ta : {false, true})
    for (bool tb : {false, true}) add_gemm(t, 33, 47, 29, ta, tb, 3, 0.5f, -1.25f);
  add_gemm_batched(t, DType::F32, 5, 17, 24, 33, false, false, 0);
  add_gemm_batched(t, DType::F32, 4, 17, 24, 33, true, true, 7);
  add_gemm_batched(t, DType::BF16, 6, 16, 40, 24, false, false, 3);
  add_gemm_batched(t, DType::F16, 3, 9, 16, 20, true, true, 0);
  add_gemm_batched(t, DType::BF16, 70000, 4, 4, 4, false, true, 0);  // more matrices than a grid's y or z holds
  add_softmax_nll(t, 67, 13);
  add_conv(t, conv(3, 5, 11, 9, 7, 3, 2, 2, 1, 1, 1));  // odd kernel, strides, padding
  add_conv(t, conv(3, 5, 11, 9, 7, 3, 2, 2, 1, 1, 1), false);
  add_conv(t, conv(2, 3, 8, 8, 4, 3, 3, 1, 1, 1, 1));   // the CNN's 3x3 "same"
  // Channels-last (CUDA: NHWC descriptors, a K x R x S x C filter, the bias gradient as
  // column sums of N·P·Q rows, Note [Channels-last sums]).
  add_conv(t, conv_cl(3, 5, 11, 9, 7, 3, 2, 2, 1, 1, 1));
  add_conv(t, conv_cl(2, 16, 8, 8, 32, 3, 3, 1, 1, 1, 1));
  add_conv_bf16(t, conv_cl(2, 16, 8, 8, 32, 3, 3, 1, 1, 1, 1));
  add_pool(t, pool(2, 3, 9, 8, 3, 2, 2, 2, 1, 1));  // padded, non-square window
  add_pool(t, pool(2, 3, 8, 8, 2, 2, 2, 2, 0, 0));  // the CNN's 2x2/2 (CPU: its own path)
  add_pool(t, pool(2, 3, 7, 9, 2, 2, 2, 2, 0, 0));  // 2x2/2 on odd sizes: the last row and column in no window
  for (DType dt : {DType::BF16, DType::F16}) {  // Note [16-bit max-pool]
    add_pool_dtype(t, pool(2, 3, 7, 9, 2, 2, 2, 2, 0, 0), dt);
    add_pool_dtype(t, pool(2, 3, 7, 7, 3, 3, 1, 1, 1, 1), dt);
  }
  // The convolution, ReLU and pool in one call: the 2x2 tiling (CPU: one pass, Note
  // [Convolution, ReLU and max-pool in one pass]; odd sizes), and an overlapping pool
  // (the ops it fuses).
  add_conv_pool(t, conv(2, 3, 8, 8, 4, 3, 3, 1, 1, 1, 1), pool(2, 4, 8, 8, 2, 2, 2, 2, 0, 0));
  add_conv_pool(t, conv(2, 3, 7, 9, 4, 3, 3, 1, 1, 1, 1), pool(2, 4, 7, 9, 2, 2, 2, 2, 0, 0));
  add_conv_pool(t, conv(2, 3, 8, 8, 4, 3, 3, 1, 1, 1, 1), pool(2, 4, 8, 8, 3, 3, 2, 2, 1, 1));
  add_conv_pool(t, conv(2, 3, 8, 8, 4, 3, 3, 1, 1, 1, 1), pool(2, 4, 8, 8, 2, 2, 2, 2, 0, 0), DType::BF16);
  // 70 queries and 45 keys: partial 64-row blocks; odd head dims.
  add_attention(t, {.B = 2, .H = 3, .L = 70, .S = 45, .E = 5, .Ev = 7}, false, true);
  add_attention(t, {.B = 2, .H = 3, .L = 130, .S = 130, .E = 8, .Ev = 8}, true, false);
  for (DType dt : {DType::BF16, DType::F16})
    add_attention_16bit(t, dt, {.B = 2, .H = 2, .L = 70, .S = 67, .E = 5, .Ev = 7});
  add_pool(t, pool(2, 3, 7, 7, 3, 3, 1, 1, 1, 1));  // overlapping windows
  add_batchnorm(t, 6, 5, 49);
  add_batchnorm(t, 4, 3, 64);     // HW % 4 == 0 (CUDA: four elements a thread)
  add_batchnorm(t, 4, 3, 64, 1);  // the same, not 16-byte aligned
  add_batchnorm(t, 5, 7, 1);      // 1x1 planes
  for (DType dt : {DType::BF16, DType::F16}) {  // Note [Batch norm in 16 bits]
    add_batchnorm(t, 6, 5, 49, 0, dt);
    add_batchnorm(t, 4, 3, 64, 0, dt);  // HW % 8 == 0 (CUDA: eight elements a thread)
    add_batchnorm(t, 4, 3, 64, 3, dt);  // the same, not 16-byte aligned
  }
  // N·HW >= 8192 with few channels: CUDA splits a channel's statistics and gradient
  // sums over several blocks (partial sums, then their sum), every dtype.
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) add_batchnorm(t, 2, 3, 8192, 0, dt);
  // Channels-last (Note [Channels-last batch norm]; on CUDA column sums of N·HW rows, Note
  // [Channels-last sums]): packed loads (C a multiple of the lanes), several tiles of
  // channels, lane by lane (3 or 13 channels, unaligned), and (N, C) inputs (HW = 1).
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    add_batchnorm(t, 4, 24, 49, 0, dt, true);
    add_batchnorm(t, 2, 3, 8192, 1, dt, true);
    add_batchnorm(t, 3, 520, 9, 0, dt, true);
    add_batchnorm(t, 2, 13, 300, 0, dt, true);
    add_batchnorm(t, 600, 64, 1, 0, dt);
  }
  add_optim(t, kCheckN, true);
}

/// The training workloads' shapes (the Fashion-MNIST CNN at batch 256, the GEMMs of
/// docs/BENCHMARKS.md); kernels_bench times these.
void add_perf_suite(Table& t) {
  t.suite = Suite::Perf;
  const i64 n = kPerfN;
  add_fill(t, n);
  add_copies(t, n);
  add_unary(t, kUnaryRows[static_cast<int>(UnaryOp::Relu)], n);
  add_unary(t, kUnaryRows[static_cast<int>(UnaryOp::Exp)], n);
  add_elementwise_misc(t, n);
  add_gelu(t, n);
  add_layer_norm(t, 2048, 128);  // a GPT's activations (16 x 128 tokens, width 128)
  constexpr i64 kSide = 4096;  // kSide^2 = kPerfN
  const std::string square = dims({kSide, kSide});
  add_binary(t, kBinaryRows[static_cast<int>(BinaryOp::Add)], square + " op " + square,
             indexer({kSide, kSide}, {kSide, 1}, {kSide, 1}));
  add_binary(t, kBinaryRows[static_cast<int>(BinaryOp::Mul)], square + " op " + dims({kSide}),
             indexer({kSide, kSide}, {kSide, 1}, {0, 1}));
  add_strided_copy(t, square + " transposed", indexer({kSide, kSide}, {1, kSide}, {0, 0}));
  add_where(t, "cond " + square + " ? " + square + " : scalar", indexer({kSide, kSide}, {kSide, 1}, {0, 0}),
            {kSide, 1});
  add_random(t, n);
  add_reduce(t, kReduceRows[0], kSide, kSide, 1);  // row sums
  add_reduce(t, kReduceRows[0], 1, kSide, kSide);  // column sums (a bias gradient)
  add_reduce(t, kReduceRows[0], 1, 512, 1024);     // the MLP's bias gradient at batch 512
  add_argmax(t, kSide, kSide, 1);
  add_count_nonfinite(t, n, false);
  add_scale_find_nonfinite(t, n, -1.0f, false);
  add_gemm(t, 512, 1024, 1024, false, false, 0, 1.0f, 0.0f);
  add_gemm(t, 1024, 1024, 1024, false, false, 0, 1.0f, 0.0f);
  add_gemm(t, 256, 128, 3136, false, true, 0, 1.0f, 0.0f, "(CNN fc1 forward)");
  add_gemm(t, 128, 3136, 256, true, false, 0, 1.0f, 0.0f, "(CNN fc1 weight grad)");
  add_gemm(t, 256, 10, 128, false, true, 0, 1.0f, 0.0f, "(CNN fc2 forward)");
  // Batched products (Note [Batched GEMMs on the CPU]): an attention's math path at 96
  // heads of 128 tokens (one chunk a matrix), and large matrices.
  for (DType dt : {DType::F32, DType::BF16}) {
    add_gemm_batched(t, dt, 96, 128, 128, 64, false, false, 0);
    add_gemm_batched(t, dt, 48, 256, 256, 64, false, false, 0);
    add_gemm_batched(t, dt, 8, 512, 512, 512, false, false, 0);
  }
  add_softmax_nll(t, 256, 10);
  add_softmax_nll(t, 4096, 1000);
  add_conv(t, conv(256, 1, 28, 28, 32, 3, 3, 1, 1, 1, 1));
  add_conv(t, conv(256, 32, 14, 14, 64, 3, 3, 1, 1, 1, 1));
  add_conv_bf16(t, conv(256, 1, 28, 28, 32, 3, 3, 1, 1, 1, 1));  // the Fashion-MNIST CNN under bf16 autocast
  add_conv_bf16(t, conv(256, 32, 14, 14, 64, 3, 3, 1, 1, 1, 1));
  add_pool(t, pool(256, 32, 28, 28, 2, 2, 2, 2, 0, 0));
  add_pool(t, pool(256, 64, 14, 14, 2, 2, 2, 2, 0, 0));
  add_pool_dtype(t, pool(256, 32, 28, 28, 2, 2, 2, 2, 0, 0), DType::BF16);
  add_conv_pool(t, conv(256, 1, 28, 28, 32, 3, 3, 1, 1, 1, 1), pool(256, 32, 28, 28, 2, 2, 2, 2, 0, 0));
  add_conv_pool(t, conv(256, 1, 28, 28, 32, 3, 3, 1, 1, 1, 1), pool(256, 32, 28, 28, 2, 2, 2, 2, 0, 0),
                DType::BF16);
  add_attention(t, {.B = 8, .H = 8, .L = 512, .S = 512, .E = 64, .Ev = 64}, true, false);  // B·H = 64
  add_batchnorm(t, 256, 32, 784);
  add_batchnorm(t, 256, 64, 1024);  // ResNet-18 (CIFAR) at batch 256: its first stage
  add_batchnorm(t, 256, 512, 16);   // and its last
  add_batchnorm(t, 64, 64, 1024, 0, DType::BF16);  // its first stage under autocast, at batch 64
  add_batchnorm(t, 64, 64, 1024, 0, DType::BF16, true);  // ... channels-last
  add_optim(t, n, false);
}

}  // namespace

// ---- names ---------------------------------------------------------------------------------

const char* kernel_name(Kernel k) {
  DP_CHECK(k < Kernel::kCount, "kernel_name: expected a Kernel below kCount, got ",
           static_cast<int>(k));
  const int i = static_cast<int>(k);
  return i < dp::backend::kOpCount ? dp::backend::op_name(static_cast<dp::backend::Op>(i))
                                   : kKernelNames[i - dp::backend::kOpCount];
}
const char* op_name(UnaryOp op) {
  DP_CHECK(op < UnaryOp::kCount, "op_name: bad UnaryOp ", static_cast<int>(op));
  return kUnaryRows[static_cast<int>(op)].name;
}
const char* op_name(BinaryOp op) {
  DP_CHECK(op < BinaryOp::kCount, "op_name: bad BinaryOp ", static_cast<int>(op));
  return kBinaryRows[static_cast<int>(op)].name;
}
const char* op_name(ReduceOp op) {
  DP_CHECK(op < ReduceOp::kCount, "op_name: bad ReduceOp ", static_cast<int>(op));
  return kReduceRows[static_cast<int>(op)].name;
}

// ---- the table -----------------------------------------------------------------------------

const std::vector<OpCase>& op_cases() {
  static const std::vector<OpCase> cases = [] {
    Table t;
    add_check_suite(t);
    add_perf_suite(t);
    return std::move(t.cases);
  }();
  return cases;
}

std::vector<const OpCase*> op_cases(Suite suite) {
  std::vector<const OpCase*> out;
  for (const OpCase& c : op_cases())
    if (c.suite == suite) out.push_back(&c);
  return out;
}

// ---- OpRun ---------------------------------------------------------------------------------

OpRun::OpRun(const OpCase& c, Backend& backend, Device dev)
    : backend_(backend), dev_(dev), seed_(fnv1a(c.full_name())) {
  try {
    c.build(*this);
    DP_CHECK(call_ != nullptr, "op case '", c.full_name(), "': its builder set no call");
  } catch (...) {
    release();  // the destructor does not run when a constructor throws
    throw;
  }
}

OpRun::~OpRun() { release(); }

void OpRun::release() noexcept {
  for (const Block& b : blocks_) {
    if (b.pinned) {
      backend_.deallocate_pinned(b.ptr, b.nbytes);
    } else {
      backend_.deallocate(dev_, b.ptr, b.nbytes);
    }
  }
  blocks_.clear();
}

void OpRun::run() { call_(backend_, dev_); }

Outputs OpRun::read() {
  backend_.synchronize(dev_);
  Outputs outs;
  outs.reserve(readers_.size());
  for (const auto& read : readers_) outs.push_back(read());
  return outs;
}

void* OpRun::allocate(std::size_t nbytes) {
  // At least one element, so that empty buffers still get a distinct valid pointer.
  nbytes = std::max<std::size_t>(nbytes, sizeof(std::int64_t));
  void* p = backend_.allocate(dev_, nbytes);
  blocks_.push_back(Block{p, nbytes, false});
  return p;
}

void* OpRun::pinned(std::size_t nbytes) {
  void* p = backend_.allocate_pinned(nbytes);
  blocks_.push_back(Block{p, nbytes, true});
  return p;
}

std::vector<float> OpRun::host_uniform(i64 n, float lo, float hi, bool integers) {
  // Each call draws from its own stream of the case's seed.
  const std::uint64_t stream = mix(seed_ + 0x9e3779b97f4a7c15ull * ++next_stream_);
  std::vector<float> v(static_cast<std::size_t>(std::max<i64>(n, 0)));
  const double width = static_cast<double>(hi) - lo;
  for (std::size_t i = 0; i < v.size(); ++i) {
    // The top 53 bits as a double in [0, 1).
    const double u = static_cast<double>(mix(stream + i) >> 11) * 0x1.0p-53;
    float x = static_cast<float>(lo + u * width);
    if (x >= hi) x = std::nextafter(hi, lo);  // rounding to float can reach hi
    v[i] = integers ? std::floor(x) : x;
  }
  return v;
}

float* OpRun::uniform(i64 n, float lo, float hi, bool integers) {
  return upload(host_uniform(n, lo, hi, integers));
}

float* OpRun::upload(const std::vector<float>& host) {
  auto* p = static_cast<float*>(allocate(host.size() * sizeof(float)));
  if (!host.empty()) backend_.copy_from_host(p, dev_, host.data(), host.size() * sizeof(float));
  return p;
}

std::int64_t* OpRun::upload(const std::vector<std::int64_t>& host) {
  auto* p = static_cast<std::int64_t*>(allocate(host.size() * sizeof(std::int64_t)));
  if (!host.empty())
    backend_.copy_from_host(p, dev_, host.data(), host.size() * sizeof(std::int64_t));
  return p;
}

std::int32_t* OpRun::upload(const std::vector<std::int32_t>& host) {
  auto* p = static_cast<std::int32_t*>(allocate(host.size() * sizeof(std::int32_t)));
  if (!host.empty())
    backend_.copy_from_host(p, dev_, host.data(), host.size() * sizeof(std::int32_t));
  return p;
}

float* OpRun::empty(i64 n) {
  return upload(std::vector<float>(static_cast<std::size_t>(n), std::nanf("")));
}

std::int64_t* OpRun::empty_i64(i64 n) {
  return upload(std::vector<std::int64_t>(static_cast<std::size_t>(n), kUnwritten));
}

void OpRun::output(std::string name, const float* ptr, i64 n) {
  readers_.push_back([this, name = std::move(name), ptr, n] {
    Output o{name, std::vector<float>(static_cast<std::size_t>(n)), {}};
    if (n > 0) backend_.copy_to_host(o.f32.data(), ptr, dev_, o.f32.size() * sizeof(float));
    return o;
  });
}

void OpRun::output(std::string name, const std::int64_t* ptr, i64 n) {
  readers_.push_back([this, name = std::move(name), ptr, n] {
    Output o{name, {}, std::vector<std::int64_t>(static_cast<std::size_t>(n))};
    if (n > 0)
      backend_.copy_to_host(o.i64.data(), ptr, dev_, o.i64.size() * sizeof(std::int64_t));
    return o;
  });
}

void OpRun::output(std::string name, const std::int32_t* ptr, i64 n) {
  readers_.push_back([this, name = std::move(name), ptr, n] {
    std::vector<std::int32_t> host(static_cast<std::size_t>(n));
    if (n > 0) backend_.copy_to_host(host.data(), ptr, dev_, host.size() * sizeof(std::int32_t));
    return Output{name, {}, std::vector<std::int64_t>(host.begin(), host.end())};
  });
}

namespace {

std::vector<std::uint16_t> to_16bit(DType dtype, const std::vector<float>& host) {
  std::vector<std::uint16_t> bits(host.size());
  for (std::size_t i = 0; i < host.size(); ++i)
    bits[i] = dtype == DType::BF16 ? dp::BFloat16(host[i]).bits : dp::Float16(host[i]).bits;
  return bits;
}

}  // namespace

void* OpRun::upload16(DType dtype, const std::vector<float>& host) {
  DP_CHECK(dtype == DType::BF16 || dtype == DType::F16, "upload16: expected bfloat16 or float16");
  const std::vector<std::uint16_t> bits = to_16bit(dtype, host);
  void* p = allocate(bits.size() * 2);
  if (!bits.empty()) backend_.copy_from_host(p, dev_, bits.data(), bits.size() * 2);
  return p;
}

void* OpRun::uniform16(DType dtype, i64 n, float lo, float hi, bool integers) {
  return upload16(dtype, host_uniform(n, lo, hi, integers));
}

void* OpRun::empty16(DType dtype, i64 n) {
  return upload16(dtype, std::vector<float>(static_cast<std::size_t>(n), std::nanf("")));
}

void OpRun::output16(std::string name, DType dtype, const void* ptr, i64 n) {
  readers_.push_back([this, name = std::move(name), dtype, ptr, n] {
    std::vector<std::uint16_t> bits(static_cast<std::size_t>(n));
    if (n > 0) backend_.copy_to_host(bits.data(), ptr, dev_, bits.size() * 2);
    Output o{name, std::vector<float>(bits.size()), {}};
    for (std::size_t i = 0; i < bits.size(); ++i)
      o.f32[i] = dtype == DType::BF16 ? static_cast<float>(dp::BFloat16::from_bits(bits[i]))
                                      : dp::Float16::to_float(bits[i]);
    return o;
  });
}

void OpRun::output(std::function<Output()> read_host) { readers_.push_back(std::move(read_host)); }

// ---- comparisons ---------------------------------------------------------------------------

namespace {

std::string describe(const std::string& name, std::size_t i, double want, double got) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s[%zu]: want %.9g, got %.9g", name.c_str(), i, want, got);
  return buf;
}

}  // namespace

Comparison compare(const Outputs& want, const Outputs& got, Tolerance tol) {
  Comparison c;
  auto fail = [&c](std::string what) {
    if (c.bad++ == 0) c.first_bad = std::move(what);
    c.ok = false;
  };
  if (want.size() != got.size()) {
    fail(cat("expected ", want.size(), " outputs, got ", got.size()));
    return c;
  }
  for (std::size_t k = 0; k < want.size(); ++k) {
    const Output &w = want[k], &g = got[k];
    if (w.name != g.name || w.f32.size() != g.f32.size() || w.i64.size() != g.i64.size()) {
      fail(cat("output ", k, ": expected '", w.name, "' of ", w.f32.size() + w.i64.size(),
               " elements, got '", g.name, "' of ", g.f32.size() + g.i64.size()));
      continue;
    }
    for (std::size_t i = 0; i < w.f32.size(); ++i) {
      const double a = w.f32[i], b = g.f32[i];
      if (std::isnan(a) || std::isnan(b) || std::isinf(a) || std::isinf(b)) {
        if (!(a == b || (std::isnan(a) && std::isnan(b)))) fail(describe(w.name, i, a, b));
        continue;
      }
      const double err = std::abs(a - b);
      c.max_abs_err = std::max(c.max_abs_err, err);
      if (!(err <= tol.atol + tol.rtol * std::abs(a))) fail(describe(w.name, i, a, b));
    }
    for (std::size_t i = 0; i < w.i64.size(); ++i)
      if (w.i64[i] != g.i64[i])
        fail(cat(w.name, "[", i, "]: want ", w.i64[i], ", got ", g.i64[i]));
  }
  return c;
}

bool bitwise_equal(const Outputs& a, const Outputs& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t k = 0; k < a.size(); ++k) {
    const Output &x = a[k], &y = b[k];
    if (x.f32.size() != y.f32.size() || x.i64.size() != y.i64.size()) return false;
    if (!x.f32.empty() &&
        std::memcmp(x.f32.data(), y.f32.data(), x.f32.size() * sizeof(float)) != 0)
      return false;
    if (!x.i64.empty() &&
        std::memcmp(x.i64.data(), y.i64.data(), x.i64.size() * sizeof(std::int64_t)) != 0)
      return false;
  }
  return true;
}

std::string first_unwritten_or_nonfinite(const Outputs& outs) {
  for (const Output& o : outs) {
    for (std::size_t i = 0; i < o.f32.size(); ++i)
      if (!std::isfinite(o.f32[i]))
        return cat(o.name, "[", i, "] = ", std::to_string(o.f32[i]));
    for (std::size_t i = 0; i < o.i64.size(); ++i)
      if (o.i64[i] == OpRun::kUnwritten) return cat(o.name, "[", i, "] unwritten");
  }
  return {};
}

}  // namespace dp_test
