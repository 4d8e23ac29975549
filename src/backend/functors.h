// src/backend/functors.h — elementwise math written once for every backend.
//
// The CPU backend calls these from TBB loops, the CUDA backend from kernels, so the
// arithmetic of every elementwise op, of the random number generator and of the fused
// optimizer updates is tested on CPU and is the same on both backends. This header
// must stay self-contained: only <cstdint>, <cmath> and backend.h (for the op enums);
// never CUDA headers, never tensors.
//
//   float y = dp::backend::Unary<dp::backend::UnaryOp::Exp>{}(x);
//   dp::backend::dispatch_binary(op, [&](auto f) { for (...) out[i] = f(a[i], b[i]); });
//   float u = dp::backend::uniform_from(seed, i);   // same value on CPU and CUDA
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "backend/backend.h"

#ifdef __CUDACC__
#define DP_HD __host__ __device__
#else
#define DP_HD
#endif

namespace dp::backend {

// ---- unary ops ---------------------------------------------------------------------
// One functor per op (rather than a switch inside the loop) so that every loop body
// the compiler sees is branch-free and vectorises. NaN propagates where PyTorch
// propagates it (relu, maximum, minimum).

/// y = op(x) for one element; specialised per UnaryOp below.
// Note [Storage types]
// Elementwise math runs in float whatever a tensor stores: a kernel over storage type T
// widens each value it loads to acc_t<T> (float), applies the float functors below, and
// rounds what it stores back to T. For T = float both steps are the identity, so the
// float32 kernels compile to the plain loops they always were; a 16-bit dtype adds its
// two conversions (AccOf, load_acc, store_acc) and its kernels are instantiations.

/// The type elementwise math of storage type T runs in.
template <typename T>
struct AccOf {
  using type = float;
};
template <typename T>
using acc_t = typename AccOf<T>::type;

template <typename T>
DP_HD inline acc_t<T> load_acc(T v) {
  return static_cast<acc_t<T>>(v);
}
template <typename T>
DP_HD inline T store_acc(acc_t<T> v) {
  return static_cast<T>(v);
}

/// x converted to Dst: as static_cast for built-in types; a 16-bit float (dp/core/half.h)
/// goes through float, exact when widening and rounded once when narrowing to one.
template <typename Dst, typename Src>
DP_HD inline Dst convert(Src x) {
  if constexpr (std::is_arithmetic_v<Dst> && std::is_arithmetic_v<Src>) {
    return static_cast<Dst>(x);
  } else if constexpr (std::is_arithmetic_v<Dst>) {
    return static_cast<Dst>(static_cast<float>(x));
  } else {
    return Dst(static_cast<float>(x));
  }
}

/// A float functor F (a Unary<...> or Binary<...>) over storage type T.
template <typename T, typename F>
struct OnStorage {
  F f;
  DP_HD T operator()(T x) const { return store_acc<T>(f(load_acc(x))); }
  DP_HD T operator()(T a, T b) const { return store_acc<T>(f(load_acc(a), load_acc(b))); }
};

template <UnaryOp Op>
struct Unary;

template <> struct Unary<UnaryOp::Neg> { DP_HD float operator()(float x) const { return -x; } };
template <> struct Unary<UnaryOp::Exp> { DP_HD float operator()(float x) const { return ::expf(x); } };
template <> struct Unary<UnaryOp::Log> { DP_HD float operator()(float x) const { return ::logf(x); } };
template <> struct Unary<UnaryOp::Sqrt> { DP_HD float operator()(float x) const { return ::sqrtf(x); } };
template <> struct Unary<UnaryOp::Rsqrt> {
  DP_HD float operator()(float x) const { return 1.0f / ::sqrtf(x); }
};
template <> struct Unary<UnaryOp::Abs> { DP_HD float operator()(float x) const { return ::fabsf(x); } };
template <> struct Unary<UnaryOp::Square> { DP_HD float operator()(float x) const { return x * x; } };
template <> struct Unary<UnaryOp::Reciprocal> {
  DP_HD float operator()(float x) const { return 1.0f / x; }
};
template <> struct Unary<UnaryOp::Relu> {
  // `x < 0 ? 0 : x` keeps NaN (PyTorch's relu propagates it).
  DP_HD float operator()(float x) const { return x < 0.0f ? 0.0f : x; }
};
template <> struct Unary<UnaryOp::Sigmoid> {
  DP_HD float operator()(float x) const { return 1.0f / (1.0f + ::expf(-x)); }
};
template <> struct Unary<UnaryOp::Tanh> { DP_HD float operator()(float x) const { return ::tanhf(x); } };
template <> struct Unary<UnaryOp::Sign> {
  // Returns x itself for ±0 and NaN, like torch.sign.
  DP_HD float operator()(float x) const { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x); }
};

template <> struct Unary<UnaryOp::Erf> { DP_HD float operator()(float x) const { return ::erff(x); } };

/// Calls f(Unary<op>{}) with the functor of a runtime op: one switch per kernel launch,
/// none per element. Calls nothing for UnaryOp::kCount.
template <typename F>
DP_HD inline void dispatch_unary(UnaryOp op, F&& f) {
  switch (op) {
    case UnaryOp::Neg: f(Unary<UnaryOp::Neg>{}); return;
    case UnaryOp::Exp: f(Unary<UnaryOp::Exp>{}); return;
    case UnaryOp::Log: f(Unary<UnaryOp::Log>{}); return;
    case UnaryOp::Sqrt: f(Unary<UnaryOp::Sqrt>{}); return;
    case UnaryOp::Rsqrt: f(Unary<UnaryOp::Rsqrt>{}); return;
    case UnaryOp::Abs: f(Unary<UnaryOp::Abs>{}); return;
    case UnaryOp::Square: f(Unary<UnaryOp::Square>{}); return;
    case UnaryOp::Reciprocal: f(Unary<UnaryOp::Reciprocal>{}); return;
    case UnaryOp::Relu: f(Unary<UnaryOp::Relu>{}); return;
    case UnaryOp::Sigmoid: f(Unary<UnaryOp::Sigmoid>{}); return;
    case UnaryOp::Tanh: f(Unary<UnaryOp::Tanh>{}); return;
    case UnaryOp::Sign: f(Unary<UnaryOp::Sign>{}); return;
    case UnaryOp::Erf: f(Unary<UnaryOp::Erf>{}); return;
    case UnaryOp::kCount: return;  // not an op: callers check (Note [Op enum sentinels])
  }
}

/// y = op(x) for a runtime op (slow path: one switch per element).
DP_HD inline float apply_unary(UnaryOp op, float x) {
  float y = 0.0f;
  dispatch_unary(op, [&](auto f) { y = f(x); });
  return y;
}

// ---- binary ops --------------------------------------------------------------------

/// out = op(a, b) for one element; specialised per BinaryOp below.
template <BinaryOp Op>
struct Binary;

template <> struct Binary<BinaryOp::Add> { DP_HD float operator()(float a, float b) const { return a + b; } };
template <> struct Binary<BinaryOp::Sub> { DP_HD float operator()(float a, float b) const { return a - b; } };
template <> struct Binary<BinaryOp::Mul> { DP_HD float operator()(float a, float b) const { return a * b; } };
template <> struct Binary<BinaryOp::Div> { DP_HD float operator()(float a, float b) const { return a / b; } };
template <> struct Binary<BinaryOp::Maximum> {
  // a + b is NaN when either is: torch.maximum propagates NaN.
  DP_HD float operator()(float a, float b) const {
    return (a != a || b != b) ? a + b : (a > b ? a : b);
  }
};
template <> struct Binary<BinaryOp::Minimum> {
  DP_HD float operator()(float a, float b) const {
    return (a != a || b != b) ? a + b : (a < b ? a : b);
  }
};
template <> struct Binary<BinaryOp::Pow> {
  DP_HD float operator()(float a, float b) const { return ::powf(a, b); }
};
template <> struct Binary<BinaryOp::Eq> {
  DP_HD float operator()(float a, float b) const { return a == b ? 1.0f : 0.0f; }
};
template <> struct Binary<BinaryOp::Gt> {
  DP_HD float operator()(float a, float b) const { return a > b ? 1.0f : 0.0f; }
};
template <> struct Binary<BinaryOp::ReluBackward> {
  DP_HD float operator()(float a, float b) const { return b > 0.0f ? a : 0.0f; }
};

/// Calls f(Binary<op>{}) with the functor of a runtime op; nothing for BinaryOp::kCount.
template <typename F>
DP_HD inline void dispatch_binary(BinaryOp op, F&& f) {
  switch (op) {
    case BinaryOp::Add: f(Binary<BinaryOp::Add>{}); return;
    case BinaryOp::Sub: f(Binary<BinaryOp::Sub>{}); return;
    case BinaryOp::Mul: f(Binary<BinaryOp::Mul>{}); return;
    case BinaryOp::Div: f(Binary<BinaryOp::Div>{}); return;
    case BinaryOp::Maximum: f(Binary<BinaryOp::Maximum>{}); return;
    case BinaryOp::Minimum: f(Binary<BinaryOp::Minimum>{}); return;
    case BinaryOp::Pow: f(Binary<BinaryOp::Pow>{}); return;
    case BinaryOp::Eq: f(Binary<BinaryOp::Eq>{}); return;
    case BinaryOp::Gt: f(Binary<BinaryOp::Gt>{}); return;
    case BinaryOp::ReluBackward: f(Binary<BinaryOp::ReluBackward>{}); return;
    case BinaryOp::kCount: return;  // not an op: callers check (Note [Op enum sentinels])
  }
}

/// out = op(a, b) for a runtime op (slow path: one switch per element).
DP_HD inline float apply_binary(BinaryOp op, float a, float b) {
  float y = 0.0f;
  dispatch_binary(op, [&](auto f) { y = f(a, b); });
  return y;
}

// ---- Philox4x32-10 counter-based RNG -----------------------------------------------
// Note [Counter-based random numbers]
// Element i of a random fill is a pure function of (seed, i): Philox4x32-10 (Salmon et
// al., SC'11) with counter = {lo32(i), hi32(i), 0, 0} and key = {lo32(seed),
// hi32(seed)}. No generator state is shared between threads, so any partition of the
// work — TBB chunks on CPU, a CUDA grid — draws the same numbers, and a tensor filled
// on one device equals the same fill on another. Each element uses lanes 0 and 1 of its
// own block; the other lanes are dropped, which costs some speed but keeps the mapping
// trivially identical everywhere.

/// Four 32-bit words: a Philox counter or output block.
struct Philox4 {
  std::uint32_t v[4];
};

// Multipliers and Weyl key increments of Philox4x32 (Random123 reference values).
inline constexpr std::uint32_t kPhiloxM0 = 0xD2511F53u;
inline constexpr std::uint32_t kPhiloxM1 = 0xCD9E8D57u;
inline constexpr std::uint32_t kPhiloxW0 = 0x9E3779B9u;  // golden ratio
inline constexpr std::uint32_t kPhiloxW1 = 0xBB67AE85u;  // sqrt(3) - 1
/// Rounds of Philox4x32-10: the variant Random123 recommends (passes BigCrush with margin).
inline constexpr int kPhiloxRounds = 10;

/// Philox4x32-10 of `counter` under the key {key0, key1}.
DP_HD constexpr Philox4 philox4x32(Philox4 counter, std::uint32_t key0, std::uint32_t key1) {
  std::uint32_t c0 = counter.v[0], c1 = counter.v[1], c2 = counter.v[2], c3 = counter.v[3];
  for (int round = 0; round < kPhiloxRounds; ++round) {
    const std::uint64_t p0 = static_cast<std::uint64_t>(kPhiloxM0) * c0;
    const std::uint64_t p1 = static_cast<std::uint64_t>(kPhiloxM1) * c2;
    const std::uint32_t hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    const std::uint32_t hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    c0 = hi1 ^ c1 ^ key0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ key1;
    c3 = lo0;
    key0 += kPhiloxW0;
    key1 += kPhiloxW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

/// The Philox block of element `index` under `seed` (Note [Counter-based random numbers]).
DP_HD constexpr Philox4 philox_block(std::uint64_t seed, std::uint64_t index) {
  return philox4x32(Philox4{{static_cast<std::uint32_t>(index),
                             static_cast<std::uint32_t>(index >> 32), 0u, 0u}},
                    static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
}

/// 2^-24: the spacing of floats in [0.5, 1); 24 random bits fill a float mantissa exactly.
inline constexpr float kTwoPowMinus24 = 1.0f / 16777216.0f;

/// Uniform in [0, 1) from the top 24 bits of a word (exactly representable, never 1).
DP_HD constexpr float uniform_open1(std::uint32_t bits) {
  return static_cast<float>(bits >> 8) * kTwoPowMinus24;
}
/// Uniform in (0, 1] (never 0, so its logarithm is finite).
DP_HD constexpr float uniform_open0(std::uint32_t bits) {
  return static_cast<float>((bits >> 8) + 1u) * kTwoPowMinus24;
}

/// Uniform in [0, 1) for element `index` under `seed`; bitwise identical on every backend.
DP_HD constexpr float uniform_from(std::uint64_t seed, std::uint64_t index) {
  return uniform_open1(philox_block(seed, index).v[0]);
}

inline constexpr float kTwoPi = 6.28318530717958647692f;

/// Box-Muller on two words of a Philox block (lanes 0 and 1): a standard normal.
DP_HD inline float normal_from_words(std::uint32_t w0, std::uint32_t w1) {
  const float u1 = uniform_open0(w0);
  const float u2 = uniform_open1(w1);
  return ::sqrtf(-2.0f * ::logf(u1)) * ::cosf(kTwoPi * u2);
}

/// Standard normal for element `index` under `seed` by Box-Muller on lanes 0 and 1.
/// CPU and CUDA agree to a few ulps (their logf/cosf may round differently).
DP_HD inline float normal_from(std::uint64_t seed, std::uint64_t index) {
  const Philox4 r = philox_block(seed, index);
  return normal_from_words(r.v[0], r.v[1]);
}

// ---- fused optimizer updates ----------------------------------------------------------
// The per-element formulas of torch.optim.SGD and torch.optim.Adam/AdamW (single-tensor
// implementation), as documented in backend.h. Scalars that do not depend on the element
// are computed once on the host by the make_* helpers.

/// Per-step scalars of SGD.
struct SgdParams {
  float lr, momentum, dampening, weight_decay;
  bool nesterov, first_step;
};

/// One SGD element update: p, and buf when momentum != 0 (buf may be null otherwise).
struct SgdUpdate {
  SgdParams s;
  DP_HD void operator()(float& p, float g, float* buf) const {
    if (s.weight_decay != 0.0f) g += s.weight_decay * p;
    if (s.momentum != 0.0f) {
      float b = s.first_step ? g : s.momentum * *buf + (1.0f - s.dampening) * g;
      *buf = b;
      g = s.nesterov ? g + s.momentum * b : b;
    }
    p -= s.lr * g;
  }
};

/// Per-step scalars of Adam/AdamW, bias corrections included.
struct AdamParams {
  float lr, beta1, beta2, eps, weight_decay;
  bool decoupled;
  float step_size;  // lr / (1 - beta1^step)
  float bc2_sqrt;   // sqrt(1 - beta2^step)
};

/// Computes the step-dependent scalars (in double, then rounded, as PyTorch does on the
/// host) for 1-based `step`.
inline AdamParams make_adam_params(float lr, float beta1, float beta2, float eps,
                                   float weight_decay, bool decoupled, std::int64_t step) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
  return AdamParams{lr, beta1, beta2, eps, weight_decay, decoupled,
                    static_cast<float>(static_cast<double>(lr) / bc1),
                    static_cast<float>(std::sqrt(bc2))};
}

/// One Adam/AdamW element update of p, m (exp_avg) and v (exp_avg_sq).
struct AdamUpdate {
  AdamParams s;
  DP_HD void operator()(float& p, float g, float& m, float& v) const {
    if (s.decoupled) {
      p *= 1.0f - s.lr * s.weight_decay;
    } else if (s.weight_decay != 0.0f) {
      g += s.weight_decay * p;
    }
    // m.lerp_(g, 1 - beta1), with PyTorch's two-sided lerp formula (exact at both ends).
    const float w = 1.0f - s.beta1;
    m = w < 0.5f ? m + w * (g - m) : g - (g - m) * (1.0f - w);
    v = s.beta2 * v + (1.0f - s.beta2) * g * g;
    const float denom = ::sqrtf(v) / s.bc2_sqrt + s.eps;
    p -= s.step_size * (m / denom);
  }
};

}  // namespace dp::backend
