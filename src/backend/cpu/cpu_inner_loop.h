// src/backend/cpu/cpu_inner_loop.h — the innermost loop of the CPU backend's binary
// kernel, shared by its baseline build (cpu_elementwise.cpp) and its ISA clones
// (cpu_binary_clones.cpp, Note [Binary clones]), so that both run one loop. Internal.
#pragma once

#include <cstdint>

namespace dp::backend::cpu {

/// out[i] = f(a[i * sa], b[i * sb]) for i in [0, len), specialised on the common stride
/// patterns (Note [Collapsing strided dimensions] in backend/elementwise_walk.h) so each
/// one vectorises. Always inlined: only code inlined into a clone is compiled for the
/// clone's ISA.
template <typename T, typename F>
[[gnu::always_inline]] inline void inner_loop(F f, const T* a, std::int64_t sa, const T* b, std::int64_t sb, T* out,
                                              std::int64_t len) {
  using i64 = std::int64_t;
  if (sa == 1 && sb == 1) {
    for (i64 i = 0; i < len; ++i) out[i] = f(a[i], b[i]);
  } else if (sa == 1 && sb == 0) {
    const T bv = *b;
    for (i64 i = 0; i < len; ++i) out[i] = f(a[i], bv);
  } else if (sa == 0 && sb == 1) {
    const T av = *a;
    for (i64 i = 0; i < len; ++i) out[i] = f(av, b[i]);
  } else {
    for (i64 i = 0; i < len; ++i) out[i] = f(a[i * sa], b[i * sb]);
  }
}

}  // namespace dp::backend::cpu
