// src/backend/cpu/cpu_backend.h — the CPU backend: virtual devices on oneTBB + oneDNN.
//
// Each CPU virtual device cpu(i) (docs/architecture.md, "CPU virtual devices") owns a tbb::task_arena sized to its share
// of the cores, its own allocation counters and its own oneDNN primitive cache. Every
// parallel loop of a kernel on cpu(i) runs inside arena i, oneDNN's convolutions and
// GEMMs included (single-threaded chunks: Note [oneDNN in the device's arena] in
// cpu_backend.h), so N devices used from N worker threads never oversubscribe the
// machine. Only the backend's own sources and
// tests/benchmarks include this header; it knows nothing about tensors.
//
//   auto& be = static_cast<dp::backend::cpu::CpuBackend&>(dp::backend::get(dp::cpu(0)));
//   be.set_concurrent_devices(2);                       // two devices, one core each
//   be.parallel_for(dp::cpu(1), n, kSerialGrain, [&](std::int64_t b, std::int64_t e) { ... });
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include "backend/backend.h"

namespace dp::backend::cpu {

/// Elements below which a loop runs serially on the calling thread: about 32K floats
/// (128 KiB) is where a TBB fork/join (a few microseconds) costs less than the work
/// saved on a second core for a memory-bound loop, measured on the 2-core AVX-512 host.
inline constexpr std::int64_t kSerialGrain = 32768;

/// Layout policy for oneDNN convolutions (Note [CPU convolution: measured choice] in cpu_conv.cpp).
enum class ConvLayout : std::uint8_t {
  Plain,    // NCHW/KCRS memory handed to oneDNN as is
  Blocked,  // format_tag::any: oneDNN picks blocked layouts, we reorder in and out
  Auto,     // per shape, pass and thread count, the faster of the two, measured on first
            // use and recorded (Note [CPU convolution: measured choice]); the default
  Gemm,     // a backward pass as one matrix product over im2col rows (Note
            // [Backward weight as one product]); forced, the passes it does not apply to run Blocked
};

/// The largest |v| of n floats as the bits of |v|, which order like |v| for finite
/// values and put an infinity (0x7f800000) above them and a NaN above that. Branch-free,
/// vectorised, with ISA clones (cpu_scan.cpp, Note [Scan clones]).
std::uint32_t max_abs_bits(const float* p, std::int64_t n);

/// The ISA clones of the loops below that the optimizer-loop library builds
/// (src/backend/cpu/meson.build): x86-64-v4 (AVX-512), x86-64-v3 (AVX2, FMA) and the
/// baseline, one picked by the loader for the CPU at hand; none where the build has no
/// clones (sanitizer builds).
#if defined(DP_CPU_TARGET_CLONES)
#define DP_CPU_V4_V3_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DP_CPU_V4_V3_CLONES
#endif

/// Rows [0, rows) x columns [0, cols) of C (rows ldc apart) after a Linear's GEMM:
/// masked by the ReLU output relu_y (laid out as C) when it is not null, then + bias (per
/// column) when it is not null, then relu when asked — the element ops of
/// Binary<ReluBackward>, Binary<Add> and Unary<Relu>, bit for bit, vectorised with ISA
/// clones (cpu_epilogue.cpp, Note [Epilogue clones]).
void linear_epilogue(float* c, std::int64_t ldc, std::int64_t rows, std::int64_t cols, const float* bias, bool relu,
                     const float* relu_y);

/// A batch norm channel's statistics (Note [Batch norm's sums in lanes] in cpu_nn.cpp): of
/// N planes of HW values of dtype dt (F32, BF16 or F16), plane n at x + n * stride, Σ x
/// into *sum and Σ (x − Σx / (N·HW))² into *sq, in double lanes, with ISA clones that give
/// the same bits (cpu_norm_clones.cpp).
void batch_norm_stats(DType dt, const void* x, std::int64_t N, std::int64_t HW, std::int64_t stride, double* sum,
                      double* sq);
/// Its backward's Σ gy into *sum_gy and Σ gy (x − mean) into *sum_gy_xc, likewise.
void batch_norm_grad_sums(DType dt, const void* gy, const void* x, std::int64_t N, std::int64_t HW,
                          std::int64_t stride, float mean, double* sum_gy, double* sum_gy_xc);

/// A channels-last batch norm's sums over rows [r0, r1) of C values of dtype dt (Note
/// [Channels-last batch norm] in cpu_nn.cpp), into double accumulators a row at a time:
/// what = 0: acc[c] += x; 1: acc[c] += (x − mean_d[c])²; 2: acc[c] += gy and acc[C + c]
/// += gy (x − mean_f[c]). ISA clones with the same bits (cpu_norm_clones.cpp).
void batch_norm_rows_sums(DType dt, int what, const void* x, const void* gy, std::int64_t r0, std::int64_t r1,
                          std::int64_t C, const double* mean_d, const float* mean_f, double* acc);
/// Its outputs over rows [r0, r1), each rounded once to dt: what = 0: out = x·a[c] + b[c];
/// 1: out = a[c]·(gy − b[c] − (x − m[c])·p[c]).
void batch_norm_rows_apply(DType dt, int what, const void* x, const void* gy, std::int64_t r0, std::int64_t r1,
                           std::int64_t C, const float* a, const float* b, const float* m, const float* p, void* out);

/// Whether unary_clone_f32 runs op: the ops whose functors are polynomials (Note
/// [Vectorisable exp and tanh] in functors.h).
constexpr bool has_unary_clone(UnaryOp op) {
  return op == UnaryOp::Exp || op == UnaryOp::Tanh || op == UnaryOp::Sigmoid;
}

/// y[i] = Unary<op>(x[i]) for i in [0, n), float32, for an op with has_unary_clone; y may
/// alias x. Bit for bit the loop of the unary kernel, vectorised with ISA clones
/// (cpu_unary_clones.cpp, Note [Unary clones]).
void unary_clone_f32(UnaryOp op, const float* x, float* y, std::int64_t n);
/// Whether unary_clone_bf16 runs op: ReLU, a CNN's under autocast.
constexpr bool has_unary_clone_bf16(UnaryOp op) { return op == UnaryOp::Relu; }
/// unary_clone_f32 over bfloat16 storage (the float functor on the widened value, one
/// rounding), bit for bit the unary kernel's loop, for an op with has_unary_clone_bf16.
void unary_clone_bf16(UnaryOp op, const BFloat16* x, BFloat16* y, std::int64_t n);

/// y[i] = Gelu<tanh>(x[i]) and gx[i] = GeluBackward<tanh>(x[i], gy[i]) for i in [0, n),
/// float32 (Note [Fused GELU] in functors.h); y may alias x, gx gy. Vectorised with ISA
/// clones (cpu_unary_clones.cpp, Note [Unary clones]).
void gelu_f32(bool tanh, const float* x, float* y, std::int64_t n);
void gelu_backward_f32(bool tanh, const float* x, const float* gy, float* gx, std::int64_t n);

/// Whether binary_clone_f32 runs op: the single IEEE operations +, -, *, /.
constexpr bool has_binary_clone(BinaryOp op) {
  return op == BinaryOp::Add || op == BinaryOp::Sub || op == BinaryOp::Mul || op == BinaryOp::Div ||
         op == BinaryOp::ReluBackward;
}

/// out[i] = Binary<op>(a[i * sa], b[i * sb]) for i in [0, len), float32, for an op with
/// has_binary_clone; out may alias a or b where their strides are 1. Bit for bit the
/// binary kernel's inner loop, vectorised with ISA clones (cpu_binary_clones.cpp, Note
/// [Binary clones]).
void binary_clone_f32(BinaryOp op, const float* a, std::int64_t sa, const float* b, std::int64_t sb, float* out,
                      std::int64_t len);
/// binary_clone_f32 over bfloat16 storage (float math, one rounding), bit for bit.
void binary_clone_bf16(BinaryOp op, const BFloat16* a, std::int64_t sa, const BFloat16* b, std::int64_t sb,
                       BFloat16* out, std::int64_t len);
/// y[i] = alpha * x[i] + beta (y may alias x), and y[i] += alpha * x[i]: the affine
/// and axpy kernels' loops, bit for bit, with ISA clones (cpu_binary_clones.cpp).
void affine_f32(const float* x, float* y, std::int64_t n, float alpha, float beta);
void affine_bf16(const BFloat16* x, BFloat16* y, std::int64_t n, float alpha, float beta);
void axpy_f32(float alpha, const float* x, float* y, std::int64_t n);
/// x[i] = scale * x[i] + 0 in place (affine_f32's bits with beta 0), and whether some
/// x[i] was NaN or infinite before: the ScaleFindNonfinite op's loop, one pass, with ISA
/// clones (cpu_binary_clones.cpp).
bool scale_find_nonfinite_f32(float* x, std::int64_t n, float scale);
/// The cast kernel's float32 <-> bfloat16 loops, bit for bit, with ISA clones.
void cast_f32_to_bf16(const float* x, BFloat16* y, std::int64_t n);
void cast_bf16_to_f32(const BFloat16* x, float* y, std::int64_t n);

/// The largest inner dimension CpuBackend::gemm runs in small_k_gemm.
inline constexpr std::int64_t kSmallK = 16;

/// Rows [0, rows) of C (ldc apart; all n columns) = op(A)'s rows [0, rows) times B,
/// for k <= kSmallK, B not transposed, alpha 1 and beta 0 — each element the products
/// summed by std::fma in k order from +0 — then masked by the ReLU output relu_y (laid
/// out as C) when it is not null, as linear_epilogue masks. op(A)'s row i is
/// a[i * lda + p] (a[p * lda + i] when trans_a). Vectorised with ISA clones
/// (cpu_small_gemm.cpp, Note [GEMMs with a small k]).
void small_k_gemm(bool trans_a, std::int64_t rows, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
                  const float* b, std::int64_t ldb, float* c, std::int64_t ldc, const float* relu_y);

/// x[i] = e^(x[i] - shift) for i in [0, n), 0 where x[i] - shift < -87.33 (-inf
/// included), NaN for NaN: within 2 ulp of expf, vectorised with ISA clones
/// (cpu_attention_exp.cpp, Note [Attention exponentials]).
void exp_shifted(float* x, std::int64_t n, float shift);

/// dst's rows [0, cols) (ldd floats apart) = the columns of src's rows [0, rows) (lds
/// apart): dst[c * ldd + r] = src[r * lds + c]. In 8x8 blocks transposed in AVX2
/// registers where the CPU has them (cpu_transpose.cpp).
void transpose_copy(const float* src, std::int64_t lds, std::int64_t rows, std::int64_t cols, float* dst,
                    std::int64_t ldd);
/// The same over 16-bit elements, in 16x16 blocks (Note [bfloat16 blocked reorders] in
/// cpu_conv.cpp).
void transpose_copy(const std::uint16_t* src, std::int64_t lds, std::int64_t rows, std::int64_t cols,
                    std::uint16_t* dst, std::int64_t ldd);

/// Whether a float32 product with C of m x n (m, n >= 1), cut into column slabs, sums
/// every element in the order one call over all n columns does: oneDNN sends the whole
/// C, and so every narrower slab, to the same kernels (Note [GEMM: column slabs that fit
/// L2] in cpu_gemm.cpp; for a B that reaches oneDNN untransposed, at a stride that is no
/// multiple of 1024 floats). For tests.
bool gemm_slabs_keep_bits(std::int64_t m, std::int64_t n);

class CpuBackend;

/// Whether this CPU has oneDNN's bfloat16 matmul (probed once with a tiny product; Note
/// [bf16 GEMMs through oneDNN] in cpu_gemm.cpp).
bool has_bf16_matmul();

/// c (m x n, ldc floats apart) = a (m x k bfloat16, row-major) b (k x n bfloat16): oneDNN's
/// bfloat16 matmul in slabs of rows (Note [bf16 GEMMs through oneDNN]), C in float32, not
/// rounded. False, having done nothing, where this CPU has no such matmul.
bool gemm_bf16_f32out(CpuBackend& be, Device dev, std::int64_t m, std::int64_t n, std::int64_t k,
                      const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b, std::int64_t ldb, float* c,
                      std::int64_t ldc);

/// oneDNN's name of the kernel a bfloat16 product of this shape runs on, with " (A
/// copied untransposed)" where Note [bf16 GEMMs: a transposed A copied untransposed]
/// applies (cpu_gemm.cpp); empty where the product widens to float32. For tests.
std::string bf16_gemm_kernel(std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t lda, std::int64_t ldb,
                             std::int64_t ldc, bool trans_a, bool trans_b);

/// Elements [begin, end) of fill_uniform, fill_normal and dropout, on the calling
/// thread (cpu_random.cpp, Note [Vectorised random fills]): element i is
/// lo + (hi - lo) * uniform_from(seed, offset + i), mean + std * normal_from(seed,
/// offset + i), and x[i] * (uniform_from(seed, offset + i) >= p ? scale : 0) (into
/// mask[i] too when mask is not null), bit for bit.
void uniform_range(float* y, std::int64_t begin, std::int64_t end, float lo, float hi, std::uint64_t seed,
                   std::uint64_t offset);
void normal_range(float* y, std::int64_t begin, std::int64_t end, float mean, float std, std::uint64_t seed,
                  std::uint64_t offset);
void dropout_range(const float* x, float* y, float* mask, std::int64_t begin, std::int64_t end, float p,
                   float scale, std::uint64_t seed, std::uint64_t offset);

/// Planes [begin, end) of a 2x2, stride-2, unpadded max-pool whose windows lie inside
/// the input, with byte places (Note [Max-pool winners in a byte]), on the calling
/// thread: what maxpool2d_2x2_forward runs per task, in AVX-512 registers where the CPU
/// has them (maxpool_2x2_avx512 below), with the same bits. s.N is not read.
void maxpool_2x2_planes(const Pool2dShape& s, const float* x, float* y, std::uint8_t* where, std::int64_t begin,
                        std::int64_t end);
/// Planes [begin, end) of that pool's input gradient from the byte places, masked by
/// the pool's output ry (> 0) when it is not null: what maxpool2d_2x2_backward runs per
/// task, with the same bits.
void maxpool_2x2_backward_planes(const Pool2dShape& s, const float* gy, const std::uint8_t* where, const float* ry,
                                 float* gx, std::int64_t begin, std::int64_t end);
/// The same over bfloat16 planes, each pooled in float32 and rounded (Note [16-bit
/// max-pool]): the bits of the float32 pool of the widened planes, rounded.
void maxpool_2x2_planes(const Pool2dShape& s, const BFloat16* x, BFloat16* y, std::uint8_t* where,
                        std::int64_t begin, std::int64_t end, bool relu = false);

/// `planes` planes (H x W in, P x Q out, contiguous) of a 2x2, stride-2 max-pool over
/// bfloat16 bits, with byte places, after a ReLU of each input when `relu`; and its
/// input gradient, masked by the pool's output relu_y when it is not null. The bits of
/// the float32 kernels on the widened planes, rounded (Note [bfloat16 max-pool on its
/// bits] in cpu_pool_clones.cpp): in AVX-512 registers where the CPU has AVX-512BW
/// (Note [bfloat16 max-pool in AVX-512] in cpu_pool_avx512.cpp), else the ISA clones
/// below, with the same bits.
void maxpool_2x2_bf16(const std::uint16_t* x, std::uint16_t* y, std::uint8_t* where, std::int64_t planes,
                      std::int64_t H, std::int64_t W, std::int64_t P, std::int64_t Q, bool relu);
void maxpool_2x2_backward_bf16(const std::uint16_t* gy, const std::uint8_t* where, const std::uint16_t* relu_y,
                               std::uint16_t* gx, std::int64_t planes, std::int64_t H, std::int64_t W,
                               std::int64_t P, std::int64_t Q);
void maxpool_2x2_bf16_clones(const std::uint16_t* x, std::uint16_t* y, std::uint8_t* where, std::int64_t planes,
                             std::int64_t H, std::int64_t W, std::int64_t P, std::int64_t Q, bool relu);
void maxpool_2x2_backward_bf16_clones(const std::uint16_t* gy, const std::uint8_t* where,
                                      const std::uint16_t* relu_y, std::uint16_t* gx, std::int64_t planes,
                                      std::int64_t H, std::int64_t W, std::int64_t P, std::int64_t Q);

/// `planes` planes (H x W in, P x Q out, contiguous) of the float32 2x2, stride-2 max-pool
/// with byte places, and its input gradient (masked by the pool's output relu_y when it
/// is not null), in AVX-512 registers (Note [float32 max-pool in AVX-512] in
/// cpu_pool_avx512.cpp), with the bits of cpu_nn.cpp's portable loops. Return false,
/// having written nothing, where the CPU lacks AVX-512 or the AVX-512 paths are off
/// (DP_CPU_POOL_AVX512=0, set_pool_avx512): the caller then runs the portable loops.
bool maxpool_2x2_avx512(const float* x, float* y, std::uint8_t* where, std::int64_t planes, std::int64_t H,
                        std::int64_t W, std::int64_t P, std::int64_t Q);
bool maxpool_2x2_backward_avx512(const float* gy, const std::uint8_t* where, const float* relu_y, float* gx,
                                 std::int64_t planes, std::int64_t H, std::int64_t W, std::int64_t P,
                                 std::int64_t Q);
/// Turns the pools' AVX-512 paths (bfloat16 and float32) on or off for the whole process,
/// as DP_CPU_POOL_AVX512=0 does at start, and returns the previous setting. For tests
/// that compare the paths; not while a pool runs.
bool set_pool_avx512(bool on);
/// Whether the pools' AVX-512 paths run: the setting above, on a CPU with AVX-512.
bool pool_avx512();

// Note [oneDNN in the device's arena]
// Debian's oneDNN threads with OpenMP. Called with a team of the device's T threads, it
// left OpenMP workers spinning (libgomp's default wait policy) for a while after every
// convolution and GEMM, while the device's TBB arena ran the next kernels (ReLU, pooling,
// the optimizer) on the same cores: three busy threads on two cores, and on a machine
// shared with other work far worse (perf showed much of the step spent in libgomp's
// spin). The wait policy is read once, from the
// environment, when libgomp loads, so the library cannot change it. Instead no OpenMP
// team is made at all: each call is cut into chunks that run as tasks of the device's
// arena, each chunk one single-threaded oneDNN call (omp_set_num_threads(1) on the
// calling thread, then no worker exists to spin). Convolutions are cut along the batch
// (forward and backward-data outputs are per sample; backward-weight chunks write
// partial gradients that are summed in chunk order), GEMMs along the rows or columns of
// C. The chunk count is a function of the shape and the device's thread count, so
// results are reproducible run to run and equal on every device of a DP/DDP run.

/// Multiply-adds below which a GEMM or a convolution is not cut into chunks (Note
/// [oneDNN in the device's arena]): a chunk should outweigh a task hand-over (a few
/// microseconds) by far, and 2^20 multiply-adds take tens of microseconds on one core.
inline constexpr std::int64_t kMinChunkMacs = std::int64_t{1} << 20;

/// The three passes of a convolution.
enum class ConvPass : std::uint8_t { Forward, BackwardData, BackwardWeight };

/// Per-device oneDNN primitive cache; defined in cpu_conv.cpp (keeps dnnl.hpp out
/// of this header).
struct ConvCache;
struct ConvCacheDeleter {
  void operator()(ConvCache* cache) const noexcept;
};
/// A fresh, empty primitive cache for one device.
ConvCache* new_conv_cache();

/// Freed large blocks of one device kept for reuse, by size class (Note [CPU caching
/// allocator] in cpu_backend.cpp). Frees every cached block when destroyed.
struct BlockCache {
  BlockCache() = default;
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;
  ~BlockCache();
  /// Frees every cached block; returns the bytes given back.
  std::size_t release();

  std::mutex mu;
  std::unordered_map<std::size_t, std::vector<void*>> free;  // size class -> blocks
  std::size_t cached_bytes = 0;
};

/// Everything one CPU virtual device owns.
struct DeviceState {
  std::unique_ptr<tbb::task_arena> arena;
  /// Arena size: the threads one kernel on this device may use.
  std::atomic<int> threads{1};
  std::atomic<std::size_t> allocated{0};
  std::atomic<std::size_t> peak{0};
  std::unique_ptr<ConvCache, ConvCacheDeleter> conv;
  BlockCache blocks;
};

/// The CPU implementation of dp::backend::Backend (see backend.h for every contract).
class CpuBackend final : public Backend {
 public:
  CpuBackend();
  ~CpuBackend() override;

  DeviceType type() const override { return DeviceType::CPU; }
  int device_count() override;

  void set_current_device(Device dev) override;
  void set_concurrent_devices(int count) override;
  int threads_per_device(Device dev) override;
  void host_parallel_for(Device dev, std::int64_t n, RangeFn f) override;
  void synchronize(Device dev) override;
  std::unique_ptr<Event> create_event(Device dev) override;
  void record_event(Event& ev, Device dev) override;
  void wait_event(Event& ev, Device dev) override;
  // Nothing on CPU: the Chrome trace shows CPU phases (Note [Profiler ranges]).
  void range_push(Device, const char*) override {}
  void range_pop(Device) noexcept override {}

  void* allocate(Device dev, std::size_t nbytes) override;
  void deallocate(Device dev, void* ptr, std::size_t nbytes) noexcept override;
  std::size_t memory_allocated(Device dev) override;
  std::size_t max_memory_allocated(Device dev) override;
  void reset_peak_memory(Device dev) override;
  void* allocate_pinned(std::size_t nbytes) override;
  void deallocate_pinned(void* ptr, std::size_t nbytes) noexcept override;
  std::size_t pinned_memory_allocated() override;
  void copy(void* dst, Device dst_dev, const void* src, Device src_dev,
            std::size_t nbytes) override;
  void copy_from_host(void* dst, Device dev, const void* host_src, std::size_t nbytes) override;
  void copy_to_host(void* host_dst, const void* src, Device dev, std::size_t nbytes) override;
  void memset_zero(void* ptr, Device dev, std::size_t nbytes) override;
  void copy_rows(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch, std::size_t row_bytes,
                 std::size_t rows, Device dev) override;

  // The float32 kernels of these ops (Note [The op list] in ops.h) are these members,
  // registered through method_kernels.h; tests call them directly too.
  void fill_uniform(Device dev, float* y, std::int64_t n, float lo, float hi,
                    std::uint64_t seed, std::uint64_t offset);
  void fill_normal(Device dev, float* y, std::int64_t n, float mean, float std,
                   std::uint64_t seed, std::uint64_t offset);
  void dropout(Device dev, const float* x, float* y, float* mask, std::int64_t n, float p,
               std::uint64_t seed, std::uint64_t offset);

  void gemm(Device dev, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
            std::int64_t k, float alpha, const float* a, std::int64_t lda, const float* b,
            std::int64_t ldb, float beta, float* c, std::int64_t ldc);
  /// The Gemm op: gemm with the epilogue applied per chunk (Note [Linear epilogue]).
  void gemm_with_epilogue(Device dev, const GemmArgs& a);
  void linear_forward(Device dev, std::int64_t m, std::int64_t n, std::int64_t k, const float* x,
                      const float* w, const float* bias, float* y, bool relu);
  void linear_backward_input(Device dev, std::int64_t m, std::int64_t n, std::int64_t k, const float* gy,
                             const float* w, const float* relu_y, float* gx);

  void log_softmax(Device dev, const float* x, float* y, std::int64_t rows,
                   std::int64_t cols);
  void log_softmax_backward(Device dev, const float* gy, const float* y, float* gx,
                            std::int64_t rows, std::int64_t cols);
  void nll_forward(Device dev, const float* logp, const std::int64_t* target, float* loss,
                   std::int64_t rows, std::int64_t cols, std::int64_t ignore_index = kNoIgnoreIndex);
  void nll_backward(Device dev, const float* gloss, const std::int64_t* target, float* gx,
                    std::int64_t rows, std::int64_t cols, std::int64_t ignore_index = kNoIgnoreIndex);

  void conv2d_forward(Device dev, const Conv2dShape& s, const float* x, const float* w,
                      const float* bias, float* y);
  void conv2d_relu_forward(Device dev, const Conv2dShape& s, const float* x, const float* w,
                           const float* bias, float* y);
  void conv2d_backward_data(Device dev, const Conv2dShape& s, const float* gy, const float* w,
                            float* gx);
  void conv2d_backward_weight(Device dev, const Conv2dShape& s, const float* x,
                              const float* gy, float* gw, float* gbias);
  // The bfloat16 convolutions: oneDNN's where this CPU has bfloat16 instructions, else
  // widened to float32 and rounded once (Note [bf16 convolutions through oneDNN]).
  void conv2d_bf16(Device dev, const Conv2dArgs& a);
  void conv2d_backward_data_bf16(Device dev, const Conv2dBackwardDataArgs& a);
  void conv2d_backward_weight_bf16(Device dev, const Conv2dBackwardWeightArgs& a);
  /// Both backward passes, sharing gy in the primitives' layout where they can (Note
  /// [Convolution backward in one call]).
  void conv2d_backward(Device dev, DType dt, const Conv2dBackwardArgs& a);
  /// Whether the bfloat16 convolutions run natively: this CPU has the instructions and
  /// set_native_bf16_conv(false) was not called.
  bool native_bf16_conv() const;
  /// false: the bfloat16 convolutions widen to float32 as on a CPU without bfloat16
  /// instructions (tests reach that path here); true (the default) undoes it.
  void set_native_bf16_conv(bool on);
  /// false: oneDNN's reorders move the 16-bit convolutions' activations between NCHW and
  /// its layouts, process-wide (tests compare the bits); true (the default): transpose_copy
  /// moves them where it can (Note [bfloat16 blocked reorders] in cpu_conv.cpp).
  static void set_own_conv_reorders(bool on);
  /// How many Conv2dBackward calls so far built gy once for both passes (Note
  /// [Convolution backward in one call]); for tests.
  static std::uint64_t shared_conv_backwards();
  void maxpool2d_forward(Device dev, const Pool2dShape& s, const float* x, float* y,
                         std::int64_t* indices);
  void maxpool2d_backward(Device dev, const Pool2dShape& s, const float* gy,
                          const std::int64_t* indices, float* gx);
  // The fused and specialised paths of the Conv2d and MaxPool2d kernels (Note [Fusions
  // are the backend's] in ops.h); tests call them directly too.
  void conv2d_relu_maxpool2x2_forward(Device dev, const Conv2dShape& s, const float* x, const float* w,
                                      const float* bias, float* y, std::uint8_t* where);
  void maxpool2d_2x2_forward(Device dev, const Pool2dShape& s, const float* x, float* y, std::uint8_t* where);
  void maxpool2d_2x2_backward(Device dev, const Pool2dShape& s, const float* gy, const std::uint8_t* where,
                              const float* relu_y, float* gx);
  /// True for a 2x2 tiling: the Conv2d and MaxPool2d kernels keep those winners in
  /// bytes (Note [Max-pool winners in a byte]).
  bool max_pool2d_byte_winners(const Pool2dShape& s) const override;
  void avgpool2d_forward(Device dev, const Pool2dShape& s, const float* x, float* y);
  void avgpool2d_backward(Device dev, const Pool2dShape& s, const float* gy,
                          float* gx);

  void batchnorm_forward_train(Device dev, std::int64_t N, std::int64_t C, std::int64_t HW,
                               const float* x, const float* gamma, const float* beta, float eps,
                               float momentum, float* running_mean, float* running_var,
                               float* y, float* save_mean, float* save_invstd);
  void batchnorm_forward_eval(Device dev, std::int64_t N, std::int64_t C, std::int64_t HW,
                              const float* x, const float* gamma, const float* beta, float eps,
                              const float* running_mean, const float* running_var,
                              float* y);
  void batchnorm_backward(Device dev, std::int64_t N, std::int64_t C, std::int64_t HW,
                          const float* gy, const float* x, const float* gamma,
                          const float* save_mean, const float* save_invstd, float* gx,
                          float* ggamma, float* gbeta);

  void sgd_step(Device dev, float* param, const float* grad, float* momentum_buf,
                std::int64_t n, double lr, double momentum, double dampening, double weight_decay,
                bool nesterov, bool first_step);
  void adam_step(Device dev, float* param, const float* grad, float* exp_avg,
                 float* exp_avg_sq, std::int64_t n, double lr, double beta1, double beta2,
                 double eps, double weight_decay, bool decoupled, std::int64_t step);

  // ---- helpers shared by the backend's sources, tests and benchmarks -------------------

  /// The state of `dev`; throws dp::Error when dev is not a valid CPU device.
  DeviceState& state(Device dev);

  /// Runs f(begin, end) over disjoint ranges covering [0, n) inside the arena of `dev`.
  /// Runs f(0, n) on the calling thread when n <= grain or the device has one thread,
  /// so tiny tensors pay nothing for parallelism. The ranges depend on scheduling: use
  /// it only where each output element is computed independently of the split, and
  /// parallel_chunks where a split decides a floating-point summation order.
  template <typename F>
  void parallel_for(Device dev, std::int64_t n, std::int64_t grain, F&& f) {
    DeviceState& st = state(dev);  // checks the device even when there is no work
    if (n <= 0) return;
    if (n <= grain || st.threads.load(std::memory_order_relaxed) <= 1) {
      f(std::int64_t{0}, n);
      return;
    }
    st.arena->execute([&] {
      tbb::parallel_for(tbb::blocked_range<std::int64_t>(0, n, grain),
                        [&](const tbb::blocked_range<std::int64_t>& r) { f(r.begin(), r.end()); });
    });
  }

  /// For a batched product `a` (GemmArgs::batch != 1): after check_gemm_batch, one(m)
  /// with m each matrix's own GemmArgs (gemm_matrix), the matrices in parallel over the
  /// device's threads, and true; false for one matrix. Each product is computed as a
  /// call of its own would compute it: the same bits (Note [Batched GEMMs on the CPU]).
  ///   if (gemm_batched(dev, a, sizeof(float), [&](const GemmArgs& m) { gemm_with_epilogue(dev, m); })) return;
  template <typename F>
  bool gemm_batched(Device dev, const GemmArgs& a, std::size_t elem, F&& one) {
    if (a.batch == 1) return false;
    check_gemm_batch(a);
    parallel_chunks(dev, a.batch, [&](std::int64_t i) { one(gemm_matrix(a, elem, i)); });
    return true;
  }

  /// Runs f(chunk) for chunk in [0, chunks) inside the arena of `dev`, one chunk per
  /// task: the partition is fixed by the caller, so results never depend on scheduling.
  template <typename F>
  void parallel_chunks(Device dev, std::int64_t chunks, F&& f) {
    DeviceState& st = state(dev);
    if (chunks <= 0) return;
    if (chunks == 1 || st.threads.load(std::memory_order_relaxed) <= 1) {
      for (std::int64_t c = 0; c < chunks; ++c) f(c);
      return;
    }
    st.arena->execute([&] {
      tbb::parallel_for(tbb::blocked_range<std::int64_t>(0, chunks, 1),
                        [&](const tbb::blocked_range<std::int64_t>& r) {
                          for (std::int64_t c = r.begin(); c < r.end(); ++c) f(c);
                        });
    });
  }

  /// Chooses the oneDNN convolution layout (benchmarks compare both; the default is
  /// the faster one measured here). Clears every device's primitive cache.
  void set_conv_layout(ConvLayout layout);
  ConvLayout conv_layout() const { return conv_layout_.load(); }
  /// The layout ConvLayout::Auto runs for this call on `dev` (its thread count), or
  /// Auto when it has not been chosen yet (Note [CPU convolution: measured choice]).
  ConvLayout chosen_conv_layout(Device dev, const Conv2dShape& s, ConvPass pass, bool bias);

  /// Bytes of freed blocks `dev` keeps for reuse (Note [CPU caching allocator]).
  std::size_t cached_bytes(Device dev);
  /// Gives every device's cached blocks back to the system.
  void empty_cache();

 private:
  // The kernel table's entries (Note [The op list] in ops.h), by source file; the
  // constructor calls each once.
  void register_elementwise_kernels();  // cpu_elementwise.cpp
  void register_reduce_kernels();       // cpu_reduce.cpp
  void register_gemm_kernels();         // cpu_gemm.cpp (16-bit; float32's is a method kernel)
  void register_conv_kernels();         // cpu_conv.cpp (float32's replaces the method kernel)
  void register_pool_kernels();         // cpu_nn.cpp (max-pool, every floating dtype)
  void register_layer_norm_kernels();   // cpu_nn.cpp (float32)
  void register_batch_norm_kernels();   // cpu_nn.cpp (16-bit; float32's are method kernels)
  void register_attention_kernels();    // cpu_attention.cpp (Note [Fused attention])
  void register_method_kernels();       // method_kernels.h, cpu_backend.cpp
  void resize_arenas(int threads);
  /// What a chunk of a GEMM applies to its slab of C after its product (Note [Linear
  /// epilogue]): C += bias (per column; null: none), then relu.
  struct GemmEpilogue {
    const float* bias = nullptr;
    bool relu = false;
    const float* relu_y = nullptr;  // mask C by this ReLU output, laid out as C (rows ldc apart)
  };
  // gemm, and linear_forward with an epilogue.
  void gemm_chunked(Device dev, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                    float alpha, const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta,
                    float* c, std::int64_t ldc, const GemmEpilogue* epilogue);
  // conv2d_forward and conv2d_relu_forward (Note [Convolution + ReLU]).
  void conv_forward(Device dev, const Conv2dShape& s, const float* x, const float* w, const float* bias,
                    float* y, bool relu);

  std::vector<std::unique_ptr<DeviceState>> devices_;
  std::mutex config_mu_;  // guards set_concurrent_devices / set_conv_layout
  std::atomic<ConvLayout> conv_layout_;
  std::atomic<bool> native_bf16_conv_{true};  // set_native_bf16_conv
  std::atomic<std::size_t> pinned_allocated_{0};
};

/// The process-wide CPU backend (same object as dp::backend::get(DeviceType::CPU)).
CpuBackend& cpu_backend_impl();

}  // namespace dp::backend::cpu
