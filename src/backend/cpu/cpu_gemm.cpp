// CPU backend: GEMM as chunked single-threaded dnnl_sgemm calls in the device's arena, with
// the Linear epilogues (bias, ReLU, ReLU mask) applied to each chunk while it is in cache.
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

#include <oneapi/dnnl/dnnl.hpp>

#include "backend/cpu/cpu_backend.h"
#include "dp/core/error.h"

namespace dp::backend::cpu {
namespace {

using i64 = std::int64_t;

// Note [GEMM: operand rows 4 KiB apart]
// A row-major B whose rows lie a multiple of 2 KiB apart (ldb = 512, 1024, 2048
// floats: every Linear with 512·j input features, in its input-gradient GEMM dX = dY W)
// made oneDNN's single-threaded sgemm run at about half speed on an AVX2 machine, as two
// column slabs against one dnnl_sgemm call with its own threads, and the same values
// with ldb 1040 ran twice as fast as with ldb 1024 (figures: docs/benchmarks/kernel-notes.md,
// "GEMM: operand rows 4 KiB apart"). Strides that are multiples of 4 KiB map a column of B onto the same few sets of the 32 KiB L1 (64 sets of 64 bytes
// repeat every 4 KiB), so the kernel's reads of B evict each other; the multithreaded
// driver packs B first and never sees it.
// The same holds, less sharply, for the other operand a split cuts: a transposed B cut
// into column slabs (the forward y = x Wᵀ of a layer with 1024 inputs) and a transposed
// A cut into row slabs (the weight gradient dW = dYᵀ X of a layer with 1024 outputs).
// An operand every chunk reads whole gains less from the same padding than copying it
// once per chunk costs, and one thread reading whole operands sees no difference.
// So a chunk first copies the slab it alone reads (B's columns when C is cut by
// columns, a transposed A's columns when C is cut by rows) into a buffer whose row
// stride is an odd multiple of 64 bytes, and multiplies from that. The copy holds the
// same values, and for the shapes cpu_backend_test checks (every transpose, by rows and
// by columns, one thread and all cores) every element is computed as before, bit for
// bit. That rests on oneDNN picking the same driver for both strides, which it does not
// promise: with AVX-512 its choice also asks whether a stride is a multiple of 256 or
// 1024 floats (Note [GEMM: column slabs that fit L2] has the drivers), so some other
// shape may round differently with the copy than without. The copy is a function of the
// shape and the device's threads, so the designs over the same devices still make the
// same one and agree bit for bit. The copy moves 8 bytes per element of the slab, which the chunk
// uses in 2·w flops (w: the rows of C, for B; the columns, for A): it is made when
// w >= kPadMinRows and skipped below.

/// Leading dimensions (in floats) that are a multiple of this alias in L1.
constexpr i64 kAliasFloats = 512;  // 2 KiB
/// Rows (for a copy of B) or columns (of A) of C a chunk must have for the copy to pay
/// (Note [GEMM: operand rows 4 KiB apart]): the copy moves 8 bytes per element, the GEMM
/// does 2·rows (2·columns) flops per element.
constexpr i64 kPadMinRows = 128;

// Note [GEMM: a transposed B multiplied untransposed]
// A Linear's forward, y = x Wᵀ, is a GEMM whose B is transposed (N,T), and oneDNN's
// single-threaded sgemm runs N,T products slower than the same products from B stored
// untransposed (N,N), with the same bits for the shapes measured (figures: docs/benchmarks/kernel-notes.md,
// "GEMM: a transposed B multiplied untransposed"). So where C
// has at least kUntransposeMinRows rows and op(B) is at least kUntransposeMinWidth wide
// both ways, B is first copied transposed — 8x8 blocks transposed in registers
// (cpu_transpose.cpp), into a buffer whose row stride does not alias (Note [GEMM:
// operand rows 4 KiB apart]) — and multiplied N,N: cut by columns, each chunk copies
// its own slab, k rows of its width, while it is about to pack it; cut by rows, the
// chunks first copy all of B together, each a share of its rows, and then all read the
// one copy — unless that copy would exceed kMaxOperandCopyFloats (a whole large weight
// on one thread, or shared by row splits), when B is multiplied N,T where it lies.
// With the copy counted it pays for the Linear shapes of the MLP and the CNN; below 128
// rows the results were mixed, and with n or k of 10-16 the untransposed product itself
// ran slower — hence kUntransposeMinRows and kUntransposeMinWidth (docs/benchmarks/kernel-notes.md
// has the figures).
// The bits are oneDNN's N,N product of the copy: the same as N,T's for the MLP's and
// most shapes, not for all (in a survey of 300 random shapes with m >= 256, two — e.g.
// 556x585x1280 — summed in another order), so cpu_backend_test checks the forward
// against gemm of the same values stored untransposed, bit for bit, at one thread and
// at all cores.

/// C's rows from which a transposed B is multiplied from an untransposed copy (Note
/// [GEMM: a transposed B multiplied untransposed]), and op(B)'s narrowest width there.
constexpr i64 kUntransposeMinRows = 128;
constexpr i64 kUntransposeMinWidth = 32;

/// The most floats a GEMM copies an operand into (Note [GEMM: operand rows 4 KiB apart],
/// Note [GEMM: a transposed B multiplied untransposed]): a chunk's slab, or the copy of
/// B that row splits share. 32 MiB: far above any slab a split makes on several threads
/// (half an L2, or 128 columns of k), but on one thread a slab is all of B, and a
/// weight-sized temporary per call would double a large layer's memory; beyond it the
/// operand is read where it lies.
constexpr i64 kMaxOperandCopyFloats = i64{8} << 20;

/// A row stride of at least `w` floats that is an odd multiple of 64 bytes (16 floats).
i64 unaliased_ld(i64 w) {
  const i64 ld = (w + 15) / 16 * 16;
  return (ld / 16) % 2 == 0 ? ld + 16 : ld;
}

// Note [GEMM: column slabs that fit L2]
// Cut by columns (m < n: the forward y = x Wᵀ and the input gradient dX = dY W of a
// layer wider than the batch), each chunk multiplies all of A by its slab of op(B), k x
// w floats, which it packs, and first copies when B's rows alias (Note [GEMM: operand
// rows 4 KiB apart]). One slab per thread made that slab 2 MiB for the MLP
// 784-1024-1024-10 at batch 512 on 2 threads (k = 1024, w = 512): twice a core's L2 on
// the machine measured, so the copy and the packing went through L3 while the step's
// other data competed for it. Slabs of half the L2, several per thread, did best of
// the widths tried; cutting the row splits the same way gained nothing, and cutting dW
// by columns instead of rows did worse (figures: docs/benchmarks/kernel-notes.md,
// "GEMM: column slabs that fit L2"). So a column split takes slabs of at most half the
// L2 and at least kMinColumnSlab columns, in a multiple of the thread count (equal slabs
// per thread); row splits keep a chunk per thread.
// Every element of C is still one dot product over all of k, made by one dnnl_sgemm
// call: a split adds no partial sums. But the order that call sums in is oneDNN's, and
// a slab is a call of another shape. oneDNN 2.6 runs a float32 product through one of
// two drivers, picked per call: the copy-based one packs both operands and sums each
// element in k blocks of 192 (AVX2) or 384 (AVX-512); with AVX2 the no-copy kernels sum
// in k blocks of 256 (96 with A transposed) — each block from zero by fma in k order,
// then added to C (an emulation gives every element of the MLP's 512x1024 products, k =
// 784 and 1024, bit for bit, from whichever driver ran them). Within a driver the width
// changes nothing as long as slab edges are multiples of 16 (kAlign: the no-copy
// kernels' tails) and no slab is one column wide (oneDNN's gemv). oneDNN's first test
// sends a call to the no-copy kernels where 1/m + 1/w >= 0.0038 with AVX or AVX2,
// 0.00196 with AVX-512 (m the call's rows of C, w its columns; for a B that reaches it
// untransposed and at a stride that is no multiple of 1024 floats, as the copies of the
// Notes above leave it from m = 128 on); without AVX every call is copy-based. A slab
// only raises 1/w, so where the whole C passes that test every slab runs as the one
// call does and the chunk count changes no bits (gemm_slabs_keep_bits): with AVX-512
// for the MLP's products (1/512 + 1/1024 = 0.0029), with AVX2 for those with m <= 263.
// Elsewhere it can, and with AVX2 it does where it matters most: the MLP's 512x1024
// products run copy-based as one call and no-copy in any slab of 541 columns or fewer,
// so about 90 % of their elements take other bits, each within 2.5 u·Σ|a·b| (u =
// 2^-24) of the one call's, whatever the L2 (figures: docs/benchmarks/kernel-notes.md,
// "GEMM: column slabs that fit L2"). Keeping the one call's order there would take
// slabs of 542 columns or more: over 2 MiB at k = 1024, wider than even the one slab
// per thread this Note replaced (512 columns, itself under the threshold). With AVX-512
// larger products do the same (768x1536x1024: 84 % of the elements), and so do row
// splits (1024x512x1024 in two halves of rows, with AVX2: 90 %); in a survey of 200
// random shapes through CpuBackend::gemm (m 256-1155, n and k 32-1531), 15 gave other
// bits on two threads than on one, for B transposed and for B not, all of them large
// (m >= 780, k >= 850), with B transposed before Note [GEMM: a transposed B multiplied
// untransposed] as after it. A device's thread count (and its CPU) is part of its
// configuration, so DP, DDP and the sharded designs over the same devices cut every
// product alike and agree bit for bit; a device with other threads, or on another CPU,
// may round such products differently.

/// GEMM slab edges are multiples of this (the kernels' width).
constexpr i64 kAlign = 16;

/// The narrowest column slab a split makes (Note [GEMM: column slabs that fit L2]).
constexpr i64 kMinColumnSlab = 128;

/// Bytes of a core's L2 cache (1 MiB when the system does not say).
i64 l2_bytes() {
  static const i64 bytes = [] {
    const long b = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return b >= (64 << 10) ? static_cast<i64>(b) : i64{1} << 20;
  }();
  return bytes;
}

/// How many slabs a GEMM of m x n x k runs as on a device of `threads` threads (Note
/// [oneDNN in the device's arena], Note [GEMM: column slabs that fit L2]): a function
/// of the shape, the thread count and the L2's size only.
i64 gemm_chunks(i64 m, i64 n, i64 k, int threads) {
  if (threads <= 1 || m * n * k < 2 * kMinChunkMacs) return 1;
  const i64 extent = m >= n ? m : n;
  i64 want = threads;
  if (m < n) {
    const i64 widest = std::max(kMinColumnSlab, l2_bytes() / 2 / (k * static_cast<i64>(sizeof(float))) / kAlign * kAlign);
    const i64 slabs = (n + widest - 1) / widest;
    want = std::max<i64>(1, (slabs + threads - 1) / threads) * threads;
  }
  return std::min<i64>({want, (extent + kAlign - 1) / kAlign, m * n * k / kMinChunkMacs});
}

/// Elements of C a chunk of a small-k product writes at least (Note [GEMMs with a small k]).
constexpr i64 kSmallKChunkElems = i64{1} << 16;

/// Whether this CPU multiplies and adds in one rounding in hardware (Note [GEMMs with a
/// small k]): elsewhere std::fma is a libm call, and oneDNN runs those products.
bool small_k_gemm_fits() {
  static const bool fma = __builtin_cpu_supports("fma");
  return fma;
}

// Note [Linear epilogue]
// A Linear's forward is a GEMM, then the bias added to every row, then (in a Sequential
// whose Linear a ReLU follows) the ReLU: three passes over y, the last two reading
// back from L3 or memory what the GEMM just wrote. Here each chunk of the GEMM adds
// the bias and clips its own slab of y right after its dnnl_sgemm, while the slab is
// still in its core's cache, and no other task runs for them. Every element goes
// through the same float operations as the separate ops — the GEMM's value, then
// Binary<Add> with the bias, then Unary<Relu> — so y is the same bit for bit (NaN
// included: relu keeps it; cpu_backend_test checks this). The separate passes were a
// visible share of the MLP's step (figures: docs/benchmarks/kernel-notes.md, "Linear
// epilogue").
// The loops are in cpu_epilogue.cpp, with ISA clones (Note [Epilogue clones]).

/// The chunk of C at rows row0.., columns col0.. (rows × cols, C's rows ldc apart).
/// relu_y: a ReLU output laid out as C, to mask C by (Note [ReLU mask in the input gradient]).
void apply_epilogue(const float* bias, bool relu, const float* relu_y, float* c, i64 ldc, i64 row0, i64 rows,
                    i64 col0, i64 cols) {
  linear_epilogue(c + row0 * ldc + col0, ldc, rows, cols, bias ? bias + col0 : nullptr, relu,
                  relu_y ? relu_y + row0 * ldc + col0 : nullptr);
}

}  // namespace

void CpuBackend::linear_forward(Device dev, i64 m, i64 n, i64 k, const float* x, const float* w,
                                const float* bias, float* y, bool relu) {
  const GemmEpilogue ep{bias, relu};
  gemm_chunked(dev, false, true, m, n, k, 1.0f, x, std::max<i64>(1, k), w, std::max<i64>(1, k), 0.0f, y,
               std::max<i64>(1, n), &ep);
}

void CpuBackend::linear_backward_input(Device dev, i64 m, i64 n, i64 k, const float* gy, const float* w,
                                       const float* relu_y, float* gx) {
  // Note [ReLU mask in the input gradient]: each chunk masks its slab after its GEMM.
  const GemmEpilogue ep{.relu_y = relu_y};
  gemm_chunked(dev, false, false, m, n, k, 1.0f, gy, std::max<i64>(1, k), w, std::max<i64>(1, n), 0.0f, gx,
               std::max<i64>(1, n), relu_y ? &ep : nullptr);
}

// Note [Batched GEMMs on the CPU]
// A batched product (GemmArgs::batch > 1: dp::matmul with batch dims, the attention's
// math path) runs its matrices as tasks of the device's arena, each computed exactly as
// a call of its own computes it: its own chunks (gemm_chunks, a function of its shape
// and the device's thread count, not of the thread that runs it), its own oneDNN calls,
// nested in the batch's task. So the bits are a loop's over the matrices, and a batch
// of small matrices — each one chunk, run on the calling thread when called alone — now
// keeps every thread busy (figures: docs/benchmarks/kernel-notes.md, "Batched GEMMs").
// oneDNN's own batched matmul primitive would pick its kernels for the whole batch and
// give other bits than the single calls; this keeps them equal.

void CpuBackend::gemm_with_epilogue(Device dev, const GemmArgs& a) {
  // A batch: Note [Batched GEMMs on the CPU].
  if (gemm_batched(dev, a, sizeof(float), [&](const GemmArgs& m) { gemm_with_epilogue(dev, m); })) return;
  const GemmEpilogue ep{static_cast<const float*>(a.epilogue.bias), a.epilogue.relu,
                        static_cast<const float*>(a.epilogue.relu_y)};
  gemm_chunked(dev, a.trans_a, a.trans_b, a.m, a.n, a.k, a.alpha, static_cast<const float*>(a.a), a.lda,
               static_cast<const float*>(a.b), a.ldb, a.beta, static_cast<float*>(a.c), a.ldc,
               a.epilogue.empty() ? nullptr : &ep);
}

void CpuBackend::gemm(Device dev, bool trans_a, bool trans_b, i64 m, i64 n, i64 k, float alpha,
                      const float* a, i64 lda, const float* b, i64 ldb, float beta, float* c,
                      i64 ldc) {
  gemm_chunked(dev, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, nullptr);
}

void CpuBackend::gemm_chunked(Device dev, bool trans_a, bool trans_b, i64 m, i64 n, i64 k, float alpha,
                              const float* a, i64 lda, const float* b, i64 ldb, float beta, float* c,
                              i64 ldc, const GemmEpilogue* epilogue) {
  DP_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm: expected non-negative m, n, k, got ", m, ", ", n,
           ", ", k);
  // Row-major storage: A is m×k (or k×m when transposed), so its row length is k (or m).
  DP_CHECK(lda >= std::max<i64>(1, trans_a ? m : k) && ldb >= std::max<i64>(1, trans_b ? k : n) &&
               ldc >= std::max<i64>(1, n),
           "gemm: leading dimensions too small: lda=", lda, " (need >= ", trans_a ? m : k,
           "), ldb=", ldb, " (need >= ", trans_b ? k : n, "), ldc=", ldc, " (need >= ", n, ")");
  (void)state(dev);
  if (m == 0 || n == 0) return;
  if (k == 0) {  // C = beta * C; beta == 0 overwrites (NaN in C must not survive)
    for (i64 i = 0; i < m; ++i)
      for (i64 j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    if (epilogue) apply_epilogue(epilogue->bias, epilogue->relu, epilogue->relu_y, c, ldc, 0, m, 0, n);
    return;
  }
  // Note [GEMMs with a small k]: rows of C in order, each finished in one pass.
  if (k <= kSmallK && !trans_b && alpha == 1.0f && beta == 0.0f &&
      (!epilogue || (!epilogue->bias && !epilogue->relu)) && small_k_gemm_fits()) {
    const i64 chunks = std::clamp<i64>(m * n / kSmallKChunkElems, 1, std::min<i64>(m, threads_per_device(dev)));
    const float* relu_y = epilogue ? epilogue->relu_y : nullptr;
    parallel_chunks(dev, chunks, [&](i64 ch) {
      const i64 lo = m * ch / chunks, hi = m * (ch + 1) / chunks;
      small_k_gemm(trans_a, hi - lo, n, k, trans_a ? a + lo : a + lo * lda, lda, b, ldb, c + lo * ldc, ldc,
                   relu_y ? relu_y + lo * ldc : nullptr);
    });
    return;
  }
  // Note [oneDNN in the device's arena]: C is cut into `chunks` slabs of whole rows (or
  // columns, when there are more of them), each one single-threaded dnnl_sgemm in a task
  // of the device's arena. Every element of C is still one dot product over all of k,
  // so the split adds no partial sums (which order oneDNN sums each in: Note [GEMM:
  // column slabs that fit L2]); slab edges are multiples of 16 (the kernels' width).
  const bool by_rows = m >= n;
  const i64 extent = by_rows ? m : n;
  const i64 chunks = gemm_chunks(m, n, k, threads_per_device(dev));
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  // Note [GEMM: operand rows 4 KiB apart], Note [GEMM: a transposed B multiplied
  // untransposed]: which operand is copied, and how, is a function of the shape and the
  // chunk count only; each copy (a chunk's slab, or the one row splits share) is bounded
  // by kMaxOperandCopyFloats.
  const i64 b_copy_floats = by_rows ? k * n : k * ((n + chunks - 1) / chunks + kAlign);
  const i64 a_copy_floats = k * ((m + chunks - 1) / chunks + kAlign);
  const bool untranspose_b = trans_b && m >= kUntransposeMinRows && n >= kUntransposeMinWidth &&
                             k >= kUntransposeMinWidth && b_copy_floats <= kMaxOperandCopyFloats;
  const bool copy_b = !untranspose_b && !by_rows && ldb % kAliasFloats == 0 && m >= kPadMinRows &&
                      b_copy_floats <= kMaxOperandCopyFloats;
  const bool copy_a = by_rows && trans_a && lda % kAliasFloats == 0 && n >= kPadMinRows &&
                      a_copy_floats <= kMaxOperandCopyFloats;
  using Copy = std::unique_ptr<float, std::function<void(float*)>>;
  auto scratch = [&](i64 floats) {
    const std::size_t bytes = static_cast<std::size_t>(floats) * sizeof(float);
    return Copy{static_cast<float*>(allocate(dev, bytes)), [this, dev, bytes](float* p) { deallocate(dev, p, bytes); }};
  };
  // Cut by rows, every chunk reads all of op(B): one untransposed copy, made by the
  // chunks together (each the rows of B it is given), before any of them multiplies.
  Copy shared_bt;
  i64 shared_bt_ld = 0;
  if (untranspose_b && by_rows) {
    shared_bt_ld = unaliased_ld(n);
    shared_bt = scratch(k * shared_bt_ld);
    const i64 parts = std::min<i64>(threads_per_device(dev), (n + 7) / 8);
    parallel_chunks(dev, parts, [&](i64 p) {
      const i64 r0 = n * p / parts / 8 * 8, r1 = p + 1 == parts ? n : n * (p + 1) / parts / 8 * 8;
      transpose_copy(b + r0 * ldb, ldb, r1 - r0, k, shared_bt.get() + r0, shared_bt_ld);
    });
  }
  const char tb_call = untranspose_b ? 'N' : tb;
  parallel_chunks(dev, chunks, [&](i64 ch) {
    omp_set_num_threads(1);  // per thread: this thread's oneDNN calls make no team
    auto edge = [&](i64 i) { return std::min(extent, (extent * i / chunks + kAlign - 1) / kAlign * kAlign); };
    const i64 lo = ch == 0 ? 0 : edge(ch), hi = ch + 1 == chunks ? extent : edge(ch + 1);
    if (hi <= lo) return;
    // `rows` rows of `width` floats, `ld` apart, into a buffer whose stride does not alias.
    auto unaliased_copy = [&](const float* src, i64 ld, i64 rows, i64 width, i64& copy_ld) {
      copy_ld = unaliased_ld(width);
      Copy copy = scratch(rows * copy_ld);
      for (i64 r = 0; r < rows; ++r)
        std::memcpy(copy.get() + r * copy_ld, src + r * ld, static_cast<std::size_t>(width) * sizeof(float));
      return copy;
    };
    // op(B)'s columns this chunk reads: all of them by rows, its slab by columns.
    const i64 b_lo = by_rows ? 0 : lo, b_w = by_rows ? n : hi - lo;
    const float* bs = trans_b ? b + b_lo * ldb : b + b_lo;
    i64 bs_ld = ldb;
    Copy b_copy;
    if (untranspose_b && by_rows) {
      bs = shared_bt.get();
      bs_ld = shared_bt_ld;
    } else if (untranspose_b) {  // this chunk's b_w rows of k, as k rows of b_w
      bs_ld = unaliased_ld(b_w);
      b_copy = scratch(k * bs_ld);
      transpose_copy(b + b_lo * ldb, ldb, b_w, k, b_copy.get(), bs_ld);
      bs = b_copy.get();
    }
    if (copy_b) {  // stored as k rows of b_w, or (transposed) b_w rows of k
      b_copy = trans_b ? unaliased_copy(bs, ldb, b_w, k, bs_ld) : unaliased_copy(bs, ldb, k, b_w, bs_ld);
      bs = b_copy.get();
    }
    // op(A)'s rows this chunk reads: its slab by rows, all of them by columns.
    const i64 a_lo = by_rows ? lo : 0, a_h = by_rows ? hi - lo : m;
    const float* as = trans_a ? a + a_lo : a + a_lo * lda;
    i64 as_ld = lda;
    Copy a_copy;
    if (copy_a) {  // transposed: stored as k rows of a_h
      a_copy = unaliased_copy(as, lda, k, a_h, as_ld);
      as = a_copy.get();
    }
    const dnnl_status_t status =
        dnnl_sgemm(ta, tb_call, a_h, b_w, k, alpha, as, as_ld, bs, bs_ld, beta, c + a_lo * ldc + b_lo, ldc);
    DP_CHECK(status == dnnl_success, "gemm on ", dev.str(), ": dnnl_sgemm failed with status ",
             static_cast<int>(status), " for m=", m, " n=", n, " k=", k);
    if (epilogue)
      apply_epilogue(epilogue->bias, epilogue->relu, epilogue->relu_y, c, ldc, a_lo, a_h, b_lo, b_w);
  });
}

// Note [16-bit GEMMs on the CPU]
// A bfloat16 or float16 product widens op(A) and op(B) to float32 once (exact), runs the
// float32 GEMM above (float32 accumulation) and rounds each element of C once: the
// float32 product of the 16-bit values, rounded once, which is what a bf16 GEMM with
// float32 accumulation (oneDNN's, cuBLAS's with CUBLAS_COMPUTE_32F) gives up to the
// order of the sum; a bias (GemmEpilogue) is added to the float32 value before that
// rounding (Note [16-bit Linear: the bias in the one rounding] in src/tensor/ops.cpp).
// Any CPU runs it, with or without a bf16 ISA; it moves the 16-bit bytes once more than
// a native kernel would and computes at float32 speed. The widened copies are the
// device's memory while the call runs.

namespace {

/// Elements a row-major matrix of `rows` rows of `cols` used columns spans at stride ld.
i64 span(i64 rows, i64 cols, i64 ld) { return rows == 0 || cols == 0 ? 0 : (rows - 1) * ld + cols; }

template <typename T>
void gemm_16bit(CpuBackend& be, Device dev, const GemmArgs& a) {
  if (be.gemm_batched(dev, a, sizeof(T), [&](const GemmArgs& m) { gemm_16bit<T>(be, dev, m); })) return;
  check_16bit_epilogue(dtype_of<T>, a);
  DP_CHECK(a.m >= 0 && a.n >= 0 && a.k >= 0, "gemm: expected non-negative m, n, k, got ", a.m, ", ", a.n, ", ", a.k);
  const i64 na = a.trans_a ? span(a.k, a.m, a.lda) : span(a.m, a.k, a.lda);
  const i64 nb = a.trans_b ? span(a.n, a.k, a.ldb) : span(a.k, a.n, a.ldb);
  const i64 nc = span(a.m, a.n, a.ldc);
  auto widened = [&](const void* src, i64 n, bool copy = true) {
    const std::size_t bytes = static_cast<std::size_t>(std::max<i64>(n, 1)) * sizeof(float);
    std::unique_ptr<float, std::function<void(float*)>> out{
        static_cast<float*>(be.allocate(dev, bytes)), [&be, dev, bytes](float* p) { be.deallocate(dev, p, bytes); }};
    const T* from = static_cast<const T*>(src);
    float* to = out.get();
    if (copy)
      be.parallel_for(dev, n, kSerialGrain, [=](i64 lo, i64 hi) {
      for (i64 i = lo; i < hi; ++i) to[i] = static_cast<float>(from[i]);
    });
    return out;
  };
  auto wa = widened(a.a, na);
  auto wb = widened(a.b, nb);
  auto wc = widened(a.c, nc, a.beta != 0.0f);  // beta 0: C is only written
  be.gemm(dev, a.trans_a, a.trans_b, a.m, a.n, a.k, a.alpha, wa.get(), a.lda, wb.get(), a.ldb, a.beta, wc.get(),
          a.ldc);
  T* c = static_cast<T*>(a.c);
  const float* from = wc.get();
  const i64 n = a.n, ldc = a.ldc;
  const T* bias = static_cast<const T*>(a.epilogue.bias);  // added before the one rounding
  be.parallel_for(dev, a.m, std::max<i64>(1, kSerialGrain / std::max<i64>(1, n)), [=](i64 lo, i64 hi) {
    for (i64 r = lo; r < hi; ++r) {
      if (bias != nullptr) {
        for (i64 j = 0; j < n; ++j) c[r * ldc + j] = T(from[r * ldc + j] + static_cast<float>(bias[j]));
      } else {
        for (i64 j = 0; j < n; ++j) c[r * ldc + j] = T(from[r * ldc + j]);
      }
    }
  });
}

}  // namespace

// Note [bf16 GEMMs through oneDNN]
// Where oneDNN has a bfloat16 matmul for this CPU (avx512_bf16 or AMX natively; other
// AVX-512 CPUs by its own emulation), a bfloat16 product is oneDNN's matmul primitive on
// the 16-bit operands, accumulating in float32 and rounding C once, with beta through a
// sum post-op (C's old value widened, added in float32, rounded once) and a bias as the
// primitive's own (widened and added before that rounding). C is cut into
// slabs of rows, one single-threaded execution per task of the device's arena, as the
// float32 GEMM is (Note [oneDNN in the device's arena]): every element is one dot product
// over all of k. oneDNN may pick its kernel by the slab's shape, so a different thread
// count (other slabs) may add a dot product in another order: equal runs on equal
// devices give equal bits, which is what keeps the designs bitwise equal to each other;
// against float32 arithmetic a product is within one bfloat16 ulp. Primitives are cached by shape (a slab's rows, n, k, transposes, leading
// dimensions, alpha, beta); each execution brings its own scratchpad. Where oneDNN has
// no such matmul (AVX2-only CPUs), the widening path of Note [16-bit GEMMs on the CPU]
// runs. float16 always takes the widening path: oneDNN 2.x has no float16 matmul on CPUs.
//
// Note [bf16 GEMMs with an odd k on AMX]
// oneDNN 2.6's AMX matmul (brg:avx512_core_amx_bf16) runs some products whose k is odd
// (bfloat16 pairs are its VNNI unit) into an AMX instruction with no tile configuration
// loaded, and the process dies of SIGILL. On the AMX Xeon (family 6 model 167): k = 63
// with n ≡ 16 (mod 32), n ≥ 80 and m not a multiple of 16, and k = 4095; other odd k up
// to 301 and a sample up to 2047 ran (oneDNN issue 1661 reports k = 63, n = 80 on 2.7).
// The convolution scans found it through the backward passes' products (Note [Backward
// weight as one product]). Where the CPU's bfloat16 matmul is AMX's, a product with an
// odd k runs on copies padded to k + 1: A with a zero column, B with a zero row, both
// untransposed. The added products are +0, so C holds the same sums (their order is
// oneDNN's for k + 1, fixed by the shape as before); the copies cost (m + n) k moves
// against 2 m n k products.
//
// Note [bf16 GEMMs: a transposed A copied untransposed]
// A Linear's weight gradient, dW = dYᵀ X, is a product whose A is transposed. oneDNN
// 2.6's brgemm matmul (its AVX-512 bf16 and AMX kernels) takes no transposed A, so that
// product fell to its older `gemm:jit` kernel: on an AMX Xeon the CNN's fc1 weight
// gradient (64 x 256 x 3136 a slab) took 0.86-0.98 ms there, where the untransposed
// products of the same size take 0.41 ms on AMX (ONEDNN_VERBOSE). So where oneDNN picks
// `gemm:` for the transposed A of a slab and `brg` for the same slab untransposed, each
// chunk first copies its slab of A transposed (transpose_copy's 16x16 blocks: m x k
// 16-bit values, against 2mnk products) and multiplies that. Which kernel runs is fixed
// by the shape and the CPU, so equal runs still give equal bits.

namespace {

dnnl::engine& gemm_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

struct Bf16GemmKey {
  i64 m, n, k, lda, ldb, ldc;
  bool ta, tb;
  float alpha, beta;
  bool f32_out = false;  // C in float32 (gemm_bf16_f32out), not rounded to bfloat16
  bool bias = false;     // a bfloat16 bias per column of C, added before C's rounding
  auto tie() const { return std::tie(m, n, k, lda, ldb, ldc, ta, tb, alpha, beta, f32_out, bias); }
  bool operator<(const Bf16GemmKey& o) const { return tie() < o.tie(); }
};

struct Bf16Gemm {
  dnnl::matmul prim;
  dnnl::memory::desc a, b, c, scratch, bias;  // bias: empty without one
  std::string impl;  // oneDNN's name of the kernel it picked
  /// For a transposed A: the product of A's copy untransposed, where that runs a better
  /// kernel (Note [bf16 GEMMs: a transposed A copied untransposed]); else null.
  std::shared_ptr<const Bf16Gemm> untransposed;
};

/// A new primitive for `key`; null when oneDNN has no bfloat16 matmul here.
std::shared_ptr<Bf16Gemm> make_bf16_gemm(const Bf16GemmKey& key) {
  using md = dnnl::memory::desc;
  using dt = dnnl::memory::data_type;
  const md a({key.m, key.k}, dt::bf16, key.ta ? dnnl::memory::dims{1, key.lda} : dnnl::memory::dims{key.lda, 1});
  const md b({key.k, key.n}, dt::bf16, key.tb ? dnnl::memory::dims{1, key.ldb} : dnnl::memory::dims{key.ldb, 1});
  const md c({key.m, key.n}, key.f32_out ? dt::f32 : dt::bf16, dnnl::memory::dims{key.ldc, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (key.alpha != 1.0f) attr.set_output_scales(0, {key.alpha});
  if (key.beta != 0.0f) {
    dnnl::post_ops ops;
    ops.append_sum(key.beta);
    attr.set_post_ops(ops);
  }
  const md bias = key.bias ? md({1, key.n}, dt::bf16, dnnl::memory::dims{key.n, 1}) : md();
  try {
    const dnnl::matmul::desc desc = key.bias ? dnnl::matmul::desc(a, b, bias, c) : dnnl::matmul::desc(a, b, c);
    const dnnl::matmul::primitive_desc pd(desc, attr, gemm_engine());
    return std::make_shared<Bf16Gemm>(
        Bf16Gemm{dnnl::matmul(pd), a, b, c, pd.scratchpad_desc(), bias, pd.impl_info_str(), nullptr});
  } catch (const dnnl::error&) {
    return nullptr;  // unimplemented on this CPU: the widening path
  }
}

/// The cached primitive for `key`; null when oneDNN has no bfloat16 matmul here.
std::shared_ptr<const Bf16Gemm> bf16_gemm(const Bf16GemmKey& key) {
  static std::mutex mu;
  static std::map<Bf16GemmKey, std::shared_ptr<const Bf16Gemm>> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  std::shared_ptr<Bf16Gemm> entry = make_bf16_gemm(key);
  // Note [bf16 GEMMs: a transposed A copied untransposed].
  if (entry && key.ta && entry->impl.rfind("gemm:", 0) == 0) {
    Bf16GemmKey plain = key;
    plain.ta = false;
    plain.lda = key.k;
    auto alt = make_bf16_gemm(plain);
    if (alt && alt->impl.rfind("brg", 0) == 0) entry->untransposed = std::move(alt);
  }
  cache.emplace(key, entry);
  return entry;
}


/// Whether this CPU's bfloat16 matmul is AMX's (Note [bf16 GEMMs with an odd k on AMX]).
bool bf16_matmul_is_amx() {
  static const bool amx = [] {
    const auto g = bf16_gemm(Bf16GemmKey{32, 32, 32, 32, 32, 32, false, false, 1.0f, 0.0f});
    return g != nullptr && g->impl.find("amx") != std::string::npos;
  }();
  return amx;
}

/// A product's operands copied untransposed with k padded to k + 1 (a zero column of A,
/// a zero row of B: Note [bf16 GEMMs with an odd k on AMX]), in the device's memory.
class OddKPadding {
 public:
  OddKPadding(CpuBackend& be, Device dev, i64 m, i64 n, i64 k, const std::uint16_t* a, i64 lda, bool ta,
              const std::uint16_t* b, i64 ldb, bool tb)
      : be_(be), dev_(dev), bytes_(static_cast<std::size_t>((m + n) * (k + 1)) * sizeof(std::uint16_t)) {
    block_ = static_cast<std::uint16_t*>(be.allocate(dev, bytes_));
    a_ = block_;
    b_ = block_ + m * (k + 1);
    be.parallel_for(dev, m, std::max<i64>(1, 4096 / (k + 1)), [&](i64 r0, i64 r1) {
      for (i64 i = r0; i < r1; ++i) {
        std::uint16_t* row = a_ + i * (k + 1);
        for (i64 j = 0; j < k; ++j) row[j] = ta ? a[j * lda + i] : a[i * lda + j];
        row[k] = 0;  // +0
      }
    });
    be.parallel_for(dev, k + 1, std::max<i64>(1, 4096 / std::max<i64>(n, 1)), [&](i64 r0, i64 r1) {
      for (i64 j = r0; j < r1; ++j) {
        std::uint16_t* row = b_ + j * n;
        if (j == k) {
          std::fill_n(row, n, std::uint16_t{0});
        } else if (tb) {
          for (i64 c = 0; c < n; ++c) row[c] = b[c * ldb + j];
        } else {
          std::memcpy(row, b + j * ldb, static_cast<std::size_t>(n) * sizeof(std::uint16_t));
        }
      }
    });
  }
  ~OddKPadding() { be_.deallocate(dev_, block_, bytes_); }
  OddKPadding(const OddKPadding&) = delete;
  OddKPadding& operator=(const OddKPadding&) = delete;
  const std::uint16_t* a() const { return a_; }
  const std::uint16_t* b() const { return b_; }

 private:
  CpuBackend& be_;
  Device dev_;
  std::size_t bytes_;
  std::uint16_t* block_ = nullptr;
  std::uint16_t* a_ = nullptr;
  std::uint16_t* b_ = nullptr;
};

/// C = A B through g on this thread, with a block of the device's memory holding oneDNN's
/// scratchpad (poisoned first: Note [Poisoned memory]) and `extra` bytes after it;
/// prepare(extra) gives A's data (it may fill the extra bytes, or poison C).
template <typename Prepare>
void execute_bf16_gemm(CpuBackend& be, Device dev, const Bf16Gemm& g, std::size_t extra, Prepare&& prepare,
                       const void* b, void* c, const void* bias = nullptr) {
  const std::size_t onednn_bytes = (g.scratch.get_size() + 63) / 64 * 64;
  const std::size_t bytes = onednn_bytes + extra;
  void* scratch = bytes > 0 ? be.allocate(dev, bytes) : nullptr;
  try {
    thread_local dnnl::stream stream(gemm_engine());
    const void* a = prepare(static_cast<char*>(scratch) + onednn_bytes);
    if (Backend::poison_memory() && onednn_bytes > 0) std::memset(scratch, 0xff, onednn_bytes);
    dnnl::memory ma(g.a, gemm_engine(), const_cast<void*>(a));
    dnnl::memory mb(g.b, gemm_engine(), const_cast<void*>(b));
    dnnl::memory mc(g.c, gemm_engine(), c);
    dnnl::memory ms(g.scratch, gemm_engine(), g.scratch.get_size() > 0 ? scratch : nullptr);
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}, {DNNL_ARG_SCRATCHPAD, ms}};
    if (bias != nullptr) args.emplace(DNNL_ARG_BIAS, dnnl::memory(g.bias, gemm_engine(), const_cast<void*>(bias)));
    g.prim.execute(stream, args);
    stream.wait();
  } catch (...) {
    if (scratch) be.deallocate(dev, scratch, bytes);
    throw;
  }
  if (scratch) be.deallocate(dev, scratch, bytes);
}

void gemm_bf16_onednn(CpuBackend& be, Device dev, const GemmArgs& a) {
  if (be.gemm_batched(dev, a, sizeof(BFloat16), [&](const GemmArgs& m) { gemm_bf16_onednn(be, dev, m); })) {
    return;
  }
  if (!has_bf16_matmul() || a.m == 0 || a.n == 0 || a.k == 0) {
    gemm_16bit<BFloat16>(be, dev, a);
    return;
  }
  check_16bit_epilogue(DType::BF16, a);
  if (a.k % 2 == 1 && bf16_matmul_is_amx()) {  // Note [bf16 GEMMs with an odd k on AMX]
    const OddKPadding padded(be, dev, a.m, a.n, a.k, static_cast<const std::uint16_t*>(a.a), a.lda, a.trans_a,
                             static_cast<const std::uint16_t*>(a.b), a.ldb, a.trans_b);
    GemmArgs even = a;
    even.a = padded.a();
    even.b = padded.b();
    even.k = a.k + 1;
    even.lda = a.k + 1;
    even.ldb = a.n;
    even.trans_a = even.trans_b = false;
    gemm_bf16_onednn(be, dev, even);
    return;
  }
  const i64 chunks = std::clamp<i64>(a.m / 16, 1, be.threads_per_device(dev));
  const auto* pa = static_cast<const BFloat16*>(a.a);
  const auto* pb = static_cast<const BFloat16*>(a.b);
  auto* pc = static_cast<BFloat16*>(a.c);
  be.parallel_chunks(dev, chunks, [&](i64 ch) {
    omp_set_num_threads(1);  // per thread: this thread's oneDNN calls make no team
    const i64 lo = a.m * ch / chunks / 16 * 16, hi = ch + 1 == chunks ? a.m : a.m * (ch + 1) / chunks / 16 * 16;
    if (hi <= lo) return;
    const auto found = bf16_gemm({hi - lo, a.n, a.k, a.lda, a.ldb, a.ldc, a.trans_a, a.trans_b, a.alpha, a.beta,
                                  false, a.epilogue.bias != nullptr});
    DP_CHECK(found != nullptr, "gemm on ", dev.str(), ": oneDNN has a bfloat16 matmul for one shape and not for (",
             hi - lo, ", ", a.n, ", ", a.k, ")");
    // Note [bf16 GEMMs: a transposed A copied untransposed]: the slab's hi - lo columns
    // of the k x m A, as hi - lo rows of k, in the scratch block after oneDNN's.
    const Bf16Gemm* g = found->untransposed ? found->untransposed.get() : found.get();
    const std::size_t copy_bytes = found->untransposed ? std::size_t(hi - lo) * std::size_t(a.k) * sizeof(BFloat16) : 0;
    auto prepare = [&](void* extra) -> const void* {
      if (Backend::poison_memory() && a.beta == 0.0f)  // Note [Poisoned memory]
        for (i64 r = lo; r < hi; ++r) std::fill_n(pc + r * a.ldc, a.n, BFloat16::from_bits(0xffff));
      const BFloat16* as = a.trans_a ? pa + lo : pa + lo * a.lda;
      if (copy_bytes == 0) return as;
      transpose_copy(reinterpret_cast<const std::uint16_t*>(as), a.lda, a.k, hi - lo,
                     static_cast<std::uint16_t*>(extra), a.k);
      return extra;
    };
    execute_bf16_gemm(be, dev, *g, copy_bytes, prepare, pb, pc + lo * a.ldc, a.epilogue.bias);
  });
}

}  // namespace

bool has_bf16_matmul() {
  static const bool has = bf16_gemm(Bf16GemmKey{2, 2, 2, 2, 2, 2, false, false, 1.0f, 0.0f}) != nullptr;
  return has;
}

bool gemm_bf16_f32out(CpuBackend& be, Device dev, i64 m, i64 n, i64 k, const std::uint16_t* a, i64 lda,
                      const std::uint16_t* b, i64 ldb, float* c, i64 ldc) {
  if (!has_bf16_matmul()) return false;
  DP_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm_bf16_f32out: expected m, n, k >= 0, got (", m, ", ", n, ", ", k, ")");
  if (m == 0 || n == 0) return true;
  if (k == 0) {
    for (i64 r = 0; r < m; ++r) std::fill_n(c + r * ldc, n, 0.0f);
    return true;
  }
  if (k % 2 == 1 && bf16_matmul_is_amx()) {  // Note [bf16 GEMMs with an odd k on AMX]
    const OddKPadding padded(be, dev, m, n, k, a, lda, false, b, ldb, false);
    return gemm_bf16_f32out(be, dev, m, n, k + 1, padded.a(), k + 1, padded.b(), n, c, ldc);
  }
  // Slabs of rows as gemm_bf16_onednn's (Note [bf16 GEMMs through oneDNN]).
  const i64 chunks = std::clamp<i64>(m / 16, 1, be.threads_per_device(dev));
  be.parallel_chunks(dev, chunks, [&](i64 ch) {
    omp_set_num_threads(1);  // per thread: this thread's oneDNN calls make no team
    const i64 lo = m * ch / chunks / 16 * 16, hi = ch + 1 == chunks ? m : m * (ch + 1) / chunks / 16 * 16;
    if (hi <= lo) return;
    const auto g = bf16_gemm({hi - lo, n, k, lda, ldb, ldc, false, false, 1.0f, 0.0f, true});
    DP_CHECK(g != nullptr, "gemm on ", dev.str(), ": oneDNN has a bfloat16 matmul for one shape and not for (",
             hi - lo, ", ", n, ", ", k, ") with a float32 C");
    execute_bf16_gemm(be, dev, *g, 0, [&](void*) -> const void* { return a + lo * lda; }, b, c + lo * ldc);
  });
  return true;
}

bool gemm_slabs_keep_bits(i64 m, i64 n) {
  // Note [GEMM: column slabs that fit L2]: oneDNN 2.6's first test of its float32
  // driver (gemm_driver.cpp's nocopy_checker, in its column-major terms: 1/n + 1/m).
  static const unsigned isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  auto has = [](dnnl::cpu_isa f) { return (isa & static_cast<unsigned>(f)) == static_cast<unsigned>(f); };
  if (!has(dnnl::cpu_isa::avx)) return true;  // copy-based only
  const double no_copy_from = has(dnnl::cpu_isa::avx512_core) ? 0.00196 : 0.0038;
  return 1.0 / static_cast<double>(m) + 1.0 / static_cast<double>(n) >= no_copy_from;
}

std::string bf16_gemm_kernel(i64 m, i64 n, i64 k, i64 lda, i64 ldb, i64 ldc, bool trans_a, bool trans_b) {
  if (!has_bf16_matmul()) return "";
  const auto g = bf16_gemm({m, n, k, lda, ldb, ldc, trans_a, trans_b, 1.0f, 0.0f});
  if (!g) return "";
  return g->untransposed ? g->untransposed->impl + " (A copied untransposed)" : g->impl;
}

void CpuBackend::register_gemm_kernels() {
  register_typed<Op::Gemm, CpuBackend, &gemm_bf16_onednn>(DType::BF16);
  register_typed<Op::Gemm, CpuBackend, &gemm_16bit<Float16>>(DType::F16);
}

}  // namespace dp::backend::cpu
