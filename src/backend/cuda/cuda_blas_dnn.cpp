// CUDA backend: GEMM through cuBLAS, 2-d convolution through cuDNN.
//
// Note [Row-major GEMM on cuBLAS]
// dp stores matrices row-major; cuBLAS reads column-major. A row-major M×N matrix with
// row stride ld is, byte for byte, the column-major N×M matrix (its transpose) with
// leading dimension ld. So C = op(A) op(B) in row-major is C^T = op(B)^T op(A)^T in
// column-major: call cuBLAS with the operands swapped (B first), m and n swapped, and
// each operand's own transpose flag unchanged.
//
// Note [16-bit GEMMs on CUDA]
// A bfloat16 or float16 product is one cublasGemmEx over CUDA_R_16BF / CUDA_R_16F
// operands and C with CUBLAS_COMPUTE_32F: products and sums in float32, alpha and beta
// float32, each element of C rounded once to the 16-bit type — Note [16-bit GEMMs on the
// CPU] up to the order of the sum. The handle's math mode forbids reduced-precision
// reductions, so a split-K reduction sums in float32 too (cuBLAS allows 16-bit ones by
// default). A bias (GemmEpilogue; a Linear's: Note [16-bit Linear: the bias in the one
// rounding] in src/tensor/ops.cpp) joins that one rounding: C is first filled with the
// bias of its column and the product adds into it with beta = 1, so cuBLAS forms
// alpha · AB + C in float32 and rounds once — the bytes of the separate bias add it
// replaces (a write of C, then a read with the GEMM's epilogue, against a read and a
// write after it). cuBLASLt's CUBLASLT_EPILOGUE_BIAS, PyTorch's addmm path, would save
// the fill too. ReLU stays a separate op for 16-bit dtypes, as on the CPU.
//
// Note [cuDNN algorithm choice]
// Each convolution shape gets a plan — descriptors plus one algorithm per direction —
// built at its first use and cached per device. Algorithms come from the cudnnGet*_v7
// heuristics (no benchmarking, so no host sync and no extra cudaMalloc even on the
// first step), taking the first that succeeds, is DETERMINISTIC (DP promises bitwise
// reproducible gradients), uses the math the plan's dtype and the TF32 policy allow
// (Note [TF32 policy] in dp/core/device.h: a float32 plan with TF32 off takes
// CUDNN_FMA_MATH only — CUDNN_DEFAULT_MATH lets Ampere use TF32 — and has no fallback:
// a clear error instead; a 16-bit plan: Note [16-bit convolutions on CUDA]) and needs
// at most kMaxWorkspace. Plans are cached per (device, shape, dtype, policy), and each
// direction's choice with its plan, also a choice that found nothing. The workspace
// comes from the caching allocator on the current stream and is released right after
// the enqueue.
// With dp::set_cudnn_benchmark(true) (Note [cuDNN benchmark], dp/core/device.h) the
// candidates come from cudnnFind*AlgorithmEx instead, timed on the call's own tensors
// (it writes only the output, which the call then overwrites), sorted fastest first,
// and filtered by the same rules. It synchronises the device, once per shape and
// direction, so it runs without the cache's mutex: another device's thread must be
// able to enqueue its part of a collective that this device's stream waits for. A
// plan's fields need no lock of their own: the device's cuDNN handle lease, held for
// the whole call, serialises every use of that device's plans.
//
// Note [16-bit convolutions on CUDA]
// A bfloat16 or float16 convolution (the CNN under autocast) runs in its own dtype:
// x, w and y descriptors of CUDNN_DATA_BFLOAT16 / CUDNN_DATA_HALF and a convolution
// descriptor computing in CUDNN_DATA_FLOAT — cuDNN's PSEUDO_BFLOAT16_CONFIG and
// PSEUDO_HALF_CONFIG: products and sums in float32, alpha and beta float, each output
// rounded once — which is Note [bf16 convolutions through oneDNN] up to the order of
// the sums. The legacy API has no configuration with 16-bit inputs and a float32
// output, so the output cuDNN writes is already rounded; what happens around it keeps
// the CPU's rounding points:
//  - Forward: oneDNN adds the bias inside its primitive and rounds once. y is first
//    filled with the bias of its channel (cuda_kernels::channel_fill, the bits as they
//    are) and cuDNN blends with beta = 1: y = 1 · conv(x, w) + 1 · y, no pass of dp's
//    own. Whether cuDNN forms that from its float32 sums and rounds once is the
//    algorithm's affair, and the legacy API promises neither: on an H200 (cuDNN 9.14)
//    a small shape's algorithm rounded once and the tensor-op implicit-GEMM algorithms
//    of the CNN's second layer at batch 256 and of a strided shape rounded the sum
//    first, then added the bias and rounded again — what PyTorch's CUDA convolution
//    always does (the bias added to cuDNN's rounded output). Where the bias cancels
//    most of the sum that first rounding shows as half a unit of the sum, not of the
//    output; the op table's shapes stay within its one unit, and
//    tests/cuda/cuda_backend_test.cpp pins the bias to "added once, rounded once or
//    twice". The ReLU follows as Unary<Relu> on the rounded output (it commutes with the
//    rounding, Note [Convolution + ReLU]).
//  - Backward data: cuDNN's gx, rounded once.
//  - Backward weight: cuDNN's gw, rounded once; the bias gradient is dp's channel sums
//    over the 16-bit gy, widened as loaded, summed in float32, rounded once (Note
//    [Convolution bias gradient] in cuda_nn.cu).
// The TF32 policy does not apply (no float32 operand is rounded): a 16-bit plan asks
// for CUDNN_TENSOR_OP_MATH (tensor cores wherever the GPU has them; CUDNN_DEFAULT_MATH
// permits them from Ampere on only) and takes any math but
// CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION; the determinism and workspace rules are
// float32's. Where they leave no algorithm for a shape and direction, that call does
// not fail: it widens — the 16-bit operands cast to float32 blocks (exact), the float32
// pass on its own plan, the outputs rounded once: what nn's widening path computed
// before 16-bit kernels existed, at float32's speed. The TF32 policy applies to that
// pass and costs nothing there: a widened bfloat16 or float16 value is exact in TF32
// (10 mantissa bits). choose_algo says whether it found an algorithm and the plan keeps
// the answer, so the search runs once per shape and direction and no error is thrown
// to be caught; Backend::conv_passes tells which path each pass took.
// A Conv2d call with a pool runs the convolution (with its ReLU) into a 16-bit block,
// then the float32 max-pool of its widened values into y, rounded (exact: a maximum is
// one of its inputs, Note [16-bit max-pool] in cpu_nn.cpp): the CUDA backend has no
// 16-bit max-pool kernels, and these are the bits of conv2d_relu followed by
// max_pool2d, which is what nn runs on CUDA for a 16-bit chain.
#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_register.h"
#include "dp/core/device.h"
#include "dp/core/error.h"

namespace dp::backend {
namespace {

// Workspace cap for one convolution: large enough for the fast FFT/Winograd variants
// of ResNet-sized layers, small enough not to crowd out activations on a 40 GB GPU.
constexpr std::size_t kMaxWorkspace = std::size_t{1} << 30;
// Heuristic results asked for per direction: more than cuDNN has algorithms.
constexpr int kMaxAlgos = 16;

int to_int(std::int64_t v, const char* what) {
  DP_CHECK(v >= 0 && v <= INT_MAX, "conv2d: ", what, " = ", v,
           " exceeds cuDNN's 32-bit limit; split the batch");
  return static_cast<int>(v);
}

using ConvKey = std::array<std::int64_t, 14>;

ConvKey key_of(const Conv2dShape& s) {
  return {s.N, s.C, s.H, s.W, s.K, s.R, s.S, s.stride_h, s.stride_w, s.pad_h, s.pad_w, s.P, s.Q, s.channels_last ? 1 : 0};
}

// Note [Channels-last convolutions on CUDA]
// A channels-last call (Conv2dShape::channels_last) describes x, y and their gradients
// to cuDNN as NHWC, the layout its tensor-core kernels compute in, so cuDNN transposes
// nothing. Its NHWC kernels want the filter in that layout too (K x R x S x C), while
// the weight and its gradient stay KCRS as every other op reads them: the call makes a
// K x R x S x C copy of the weight (a backward-weight pass writes one and transposes it
// back), a pass over the weight's bytes, small beside the activations'. The per-channel
// bias and its gradient run over rows of K values: an NHWC output is N·P·Q rows of K
// channels, (N·P·Q, K, 1) to the channel kernels, whose bias gradient then sums columns
// (Note [Channels-last sums] in channels_last_sums.h).

/// Geometry of the per-channel kernels (bias, bias gradient) over a convolution's output.
struct ChannelGeom {
  std::int64_t n, c, hw;
};
ChannelGeom output_channels(const Conv2dShape& s) {
  return s.channels_last ? ChannelGeom{s.N * s.P * s.Q, s.K, 1} : ChannelGeom{s.N, s.K, s.P * s.Q};
}

/// The K x C x R x S weight `w` (of `dt`) copied into or out of K x R x S x C (Note
/// [Channels-last convolutions on CUDA]): into `to` when `to_krsc`, else back.
void move_filter(CudaBackend& be, Device dev, DType dt, const Conv2dShape& s, const void* from, void* to,
                 bool to_krsc) {
  Indexer ix;
  ix.ndim = 4;
  const std::int64_t K = s.K, C = s.C, R = s.R, S = s.S;
  const std::int64_t sizes_krsc[4] = {K, R, S, C}, strides_kcrs[4] = {C * R * S, S, 1, R * S};
  const std::int64_t sizes_kcrs[4] = {K, C, R, S}, strides_krsc[4] = {R * S * C, 1, S * C, C};
  for (int i = 0; i < 4; ++i) {
    ix.sizes[i] = to_krsc ? sizes_krsc[i] : sizes_kcrs[i];
    ix.strides_a[i] = ix.strides_b[i] = to_krsc ? strides_kcrs[i] : strides_krsc[i];
  }
  be.run<Op::StridedCopy>(dev, dt, {ix, from, to});
}

/// The weight as a plan's filter descriptor reads it: `w` itself, or for a
/// channels-last call its K x R x S x C copy in `block`.
const void* filter_of(CudaBackend& be, Device dev, DType dt, const Conv2dShape& s, const void* w,
                      std::optional<CudaBackend::Scratch>& block) {
  if (!s.channels_last) return w;
  const std::size_t es = dt == DType::F32 ? 4 : 2;
  block.emplace(be, dev.index, static_cast<std::size_t>(std::max<std::int64_t>(s.K * s.C * s.R * s.S, 1)) * es);
  move_filter(be, dev, dt, s, w, block->get(), true);
  return block->get();
}

/// cuDNN's element type of a floating dtype (Note [16-bit convolutions on CUDA]).
cudnnDataType_t cudnn_type(DType dt) {
  switch (dt) {
    case DType::F32: return CUDNN_DATA_FLOAT;
    case DType::BF16: return CUDNN_DATA_BFLOAT16;
    case DType::F16: return CUDNN_DATA_HALF;
    default: break;
  }
  DP_FAIL("conv2d: cuDNN convolutions take float32, bfloat16 or float16, got ", dtype_name(dt));
}

/// One direction's choice: whether it has been made, and whether it found an algorithm
/// (a 16-bit plan widens where it did not, Note [16-bit convolutions on CUDA]); the
/// algorithm, its math type and its workspace.
template <typename Algo>
struct ConvChoice {
  bool chosen = false;
  bool found = false;
  Algo algo{};
  cudnnMathType_t math{};
  std::size_t ws = 0;
};

/// Descriptors and chosen algorithms of one convolution shape and dtype on one device.
struct ConvPlan {
  DType dtype = DType::F32;  // of x, w and y; the sums are float32's whatever it is
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  ConvChoice<cudnnConvolutionFwdAlgo_t> fwd;
  ConvChoice<cudnnConvolutionBwdDataAlgo_t> bwd_data;
  ConvChoice<cudnnConvolutionBwdFilterAlgo_t> bwd_filter;

  // Plans live as long as the process (Note [Process-lifetime CUDA objects]); the
  // descriptors are host objects, so nothing leaks on the device.
};

/// What the search of one direction calls, by the direction's perf type: its cuDNN
/// functions over the plan's descriptors, with the direction's two inputs `a`, `b` and
/// its output `out` in the order its cudnnFind*AlgorithmEx takes them.
template <typename Perf>
struct ConvDirection;

template <>
struct ConvDirection<cudnnConvolutionFwdAlgoPerf_t> {
  using Perf = cudnnConvolutionFwdAlgoPerf_t;
  static constexpr const char* kName = "forward";
  static auto& choice(ConvPlan& p) { return p.fwd; }
  // a = x, b = w, out = y
  static void find(cudnnHandle_t h, const ConvPlan& p, const void* a, const void* b, void* out, int* count,
                   Perf* perf, void* ws, std::size_t bytes) {
    DP_CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithmEx(h, p.x, a, p.w, b, p.conv, p.y, out, kMaxAlgos, count,
                                                          perf, ws, bytes));
  }
  static void heuristics(cudnnHandle_t h, const ConvPlan& p, int* count, Perf* perf) {
    DP_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(h, p.x, p.w, p.conv, p.y, kMaxAlgos, count, perf));
  }
  static void workspace(cudnnHandle_t h, const ConvPlan& p, cudnnConvolutionFwdAlgo_t algo, std::size_t* bytes) {
    DP_CUDNN_CHECK(cudnnGetConvolutionForwardWorkspaceSize(h, p.x, p.w, p.conv, p.y, algo, bytes));
  }
};

template <>
struct ConvDirection<cudnnConvolutionBwdDataAlgoPerf_t> {
  using Perf = cudnnConvolutionBwdDataAlgoPerf_t;
  static constexpr const char* kName = "backward data";
  static auto& choice(ConvPlan& p) { return p.bwd_data; }
  // a = w, b = gy, out = gx
  static void find(cudnnHandle_t h, const ConvPlan& p, const void* a, const void* b, void* out, int* count,
                   Perf* perf, void* ws, std::size_t bytes) {
    DP_CUDNN_CHECK(cudnnFindConvolutionBackwardDataAlgorithmEx(h, p.w, a, p.y, b, p.conv, p.x, out, kMaxAlgos,
                                                               count, perf, ws, bytes));
  }
  static void heuristics(cudnnHandle_t h, const ConvPlan& p, int* count, Perf* perf) {
    DP_CUDNN_CHECK(
        cudnnGetConvolutionBackwardDataAlgorithm_v7(h, p.w, p.y, p.conv, p.x, kMaxAlgos, count, perf));
  }
  static void workspace(cudnnHandle_t h, const ConvPlan& p, cudnnConvolutionBwdDataAlgo_t algo,
                        std::size_t* bytes) {
    DP_CUDNN_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(h, p.w, p.y, p.conv, p.x, algo, bytes));
  }
};

template <>
struct ConvDirection<cudnnConvolutionBwdFilterAlgoPerf_t> {
  using Perf = cudnnConvolutionBwdFilterAlgoPerf_t;
  static constexpr const char* kName = "backward filter";
  static auto& choice(ConvPlan& p) { return p.bwd_filter; }
  // a = x, b = gy, out = gw
  static void find(cudnnHandle_t h, const ConvPlan& p, const void* a, const void* b, void* out, int* count,
                   Perf* perf, void* ws, std::size_t bytes) {
    DP_CUDNN_CHECK(cudnnFindConvolutionBackwardFilterAlgorithmEx(h, p.x, a, p.y, b, p.conv, p.w, out, kMaxAlgos,
                                                                 count, perf, ws, bytes));
  }
  static void heuristics(cudnnHandle_t h, const ConvPlan& p, int* count, Perf* perf) {
    DP_CUDNN_CHECK(
        cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, p.x, p.y, p.conv, p.w, kMaxAlgos, count, perf));
  }
  static void workspace(cudnnHandle_t h, const ConvPlan& p, cudnnConvolutionBwdFilterAlgo_t algo,
                        std::size_t* bytes) {
    DP_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterWorkspaceSize(h, p.x, p.y, p.conv, p.w, algo, bytes));
  }
};

/// Whether a heuristic or benchmark result may run in a plan of dtype `dt` (Notes [cuDNN
/// algorithm choice], [16-bit convolutions on CUDA]).
template <typename Perf>
bool usable(const Perf& p, DType dt, bool allow_tf32) {
  if (p.status != CUDNN_STATUS_SUCCESS || p.memory > kMaxWorkspace) return false;
  if (p.determinism != CUDNN_DETERMINISTIC) return false;
  if (dt != DType::F32) return p.mathType != CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION;
  return allow_tf32 || p.mathType == CUDNN_FMA_MATH;
}

/// The error of a float32 direction with no usable algorithm.
[[noreturn]] void no_float32_algorithm(const char* direction, const Conv2dShape& s, bool allow_tf32) {
  DP_FAIL("conv2d ", direction, ": cuDNN offers no deterministic ", allow_tf32 ? "" : "pure-FP32 ",
          "algorithm within ", kMaxWorkspace >> 20, " MiB of workspace for N=", s.N, " C=", s.C,
          " H=", s.H, " W=", s.W, " K=", s.K, " R=", s.R, " S=", s.S,
          allow_tf32 ? "" : " (dp::set_allow_tf32_conv(true) allows TF32 algorithms)");
}

/// Checks a GEMM's sizes and row strides (GemmArgs in ops.h); false when C is empty and
/// there is nothing to do.
bool check_gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t lda,
                std::int64_t ldb, std::int64_t ldc) {
  DP_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm: expected non-negative m, n, k, got ", m, ", ", n,
           ", ", k);
  if (m == 0 || n == 0) return false;
  // Row strides of the stored (untransposed) matrices: A is m×k (k×m when transposed).
  const std::int64_t a_cols = trans_a ? m : k, b_cols = trans_b ? k : n;
  DP_CHECK(lda >= std::max<std::int64_t>(1, a_cols) && ldb >= std::max<std::int64_t>(1, b_cols) &&
               ldc >= n,
           "gemm: row strides too small: lda=", lda, " (need >= ", a_cols, "), ldb=", ldb,
           " (need >= ", b_cols, "), ldc=", ldc, " (need >= ", n, ")");
  return true;
}

/// The math type a plan asks the heuristics for: a float32 plan's from the TF32 policy,
/// a 16-bit plan's tensor cores (Note [16-bit convolutions on CUDA]).
cudnnMathType_t requested_math(DType dt, bool allow_tf32) {
  if (dt != DType::F32) return CUDNN_TENSOR_OP_MATH;
  return allow_tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
}

class ConvPlanCache {
 public:
  /// The plan of `s` in dtype `dt` on `device`, with descriptors made; algorithms are
  /// chosen per direction by the callers below on first use. Holds no lock after
  /// return: plans are never erased, and each direction is filled once under mu_.
  /// `allow_tf32` is ignored for a 16-bit dtype.
  ConvPlan& get(int device, const Conv2dShape& s, DType dt, bool allow_tf32, bool benchmark) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& slot = plans_[key(device, s, dt, allow_tf32, benchmark)];
    if (!slot) slot = make_plan(s, dt, allow_tf32);
    return *slot;
  }
  /// The plan get() would return, or null when no call has made it yet.
  ConvPlan* find(int device, const Conv2dShape& s, DType dt, bool allow_tf32, bool benchmark) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(key(device, s, dt, allow_tf32, benchmark));
    return it == plans_.end() ? nullptr : it->second.get();
  }

 private:
  using Key = std::tuple<int, ConvKey, DType, bool, bool>;
  static Key key(int device, const Conv2dShape& s, DType dt, bool allow_tf32, bool benchmark) {
    return {device, key_of(s), dt, dt == DType::F32 && allow_tf32, benchmark};
  }

  static std::unique_ptr<ConvPlan> make_plan(const Conv2dShape& s, DType dt, bool allow_tf32) {
    DP_CHECK(s.N > 0 && s.C > 0 && s.H > 0 && s.W > 0 && s.K > 0 && s.R > 0 && s.S > 0 &&
                 s.stride_h > 0 && s.stride_w > 0 && s.pad_h >= 0 && s.pad_w >= 0,
             "conv2d: expected positive sizes and strides, non-negative padding; got N=", s.N,
             " C=", s.C, " H=", s.H, " W=", s.W, " K=", s.K, " R=", s.R, " S=", s.S);
    const cudnnDataType_t type = cudnn_type(dt);
    auto p = std::make_unique<ConvPlan>();
    p->dtype = dt;
    DP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->x));
    DP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->y));
    DP_CUDNN_CHECK(cudnnCreateFilterDescriptor(&p->w));
    DP_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&p->conv));
    // Note [Channels-last convolutions on CUDA]: the dims stay (N, C, H, W) either way.
    const cudnnTensorFormat_t format = s.channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
    DP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->x, format, type,
                                              to_int(s.N, "N"), to_int(s.C, "C"),
                                              to_int(s.H, "H"), to_int(s.W, "W")));
    DP_CUDNN_CHECK(cudnnSetFilter4dDescriptor(p->w, type, format,
                                              to_int(s.K, "K"), to_int(s.C, "C"),
                                              to_int(s.R, "R"), to_int(s.S, "S")));
    // Sums in float32 for every dtype (Note [16-bit convolutions on CUDA]).
    DP_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(
        p->conv, to_int(s.pad_h, "pad_h"), to_int(s.pad_w, "pad_w"),
        to_int(s.stride_h, "stride_h"), to_int(s.stride_w, "stride_w"), 1, 1,
        CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    DP_CUDNN_CHECK(cudnnSetConvolutionMathType(p->conv, requested_math(dt, allow_tf32)));
    int n = 0, k = 0, h = 0, w = 0;
    DP_CUDNN_CHECK(cudnnGetConvolution2dForwardOutputDim(p->conv, p->x, p->w, &n, &k, &h, &w));
    DP_CHECK(n == s.N && k == s.K && h == s.P && w == s.Q, "conv2d: output shape (", s.N, ", ",
             s.K, ", ", s.P, ", ", s.Q, ") does not match the geometry, which gives (", n, ", ",
             k, ", ", h, ", ", w, ")");
    DP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->y, format, type, n, k, h, w));
    return p;
  }

  std::mutex mu_;
  std::map<Key, std::unique_ptr<ConvPlan>> plans_;
};

ConvPlanCache& plan_cache() {
  static ConvPlanCache* cache = new ConvPlanCache();  // process lifetime
  return *cache;
}

/// Workspace offered to cudnnFind*AlgorithmEx: kMaxWorkspace, or half of the GPU's
/// free memory when less (the search must not fail the step with out-of-memory).
std::size_t find_workspace_bytes() {
  std::size_t free_b = 0, total_b = 0;
  DP_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return std::min(kMaxWorkspace, free_b / 2);
}

/// Chooses the algorithm of direction Perf for plan `p` on first use (Note [cuDNN
/// algorithm choice]) and sets the plan's math type to the chosen one's; true when
/// there is one, false when no result may run (the plan remembers either answer). `h`
/// is the device's cuDNN handle, held by the caller for the whole call; a, b, out are
/// the call's own tensors (ConvDirection's order), which a benchmark search may write.
template <typename Perf>
bool choose_algo(CudaBackend& be, int device, cudnnHandle_t h, ConvPlan& p, bool tf32, bool benchmark,
                 const void* a, const void* b, void* out) {
  using Dir = ConvDirection<Perf>;
  auto& c = Dir::choice(p);
  if (!c.chosen) {
    Perf perf[kMaxAlgos];
    int count = 0;
    DP_CUDNN_CHECK(cudnnSetConvolutionMathType(p.conv, requested_math(p.dtype, tf32)));
    if (benchmark) {
      const std::size_t bytes = find_workspace_bytes();
      CudaBackend::Scratch ws(be, device, bytes);
      Dir::find(h, p, a, b, out, &count, perf, ws.get(), bytes);
    } else {
      Dir::heuristics(h, p, &count, perf);
    }
    for (int i = 0; i < count && !c.found; ++i) {
      if (!usable(perf[i], p.dtype, tf32)) continue;
      c.algo = perf[i].algo;
      c.math = perf[i].mathType;
      DP_CUDNN_CHECK(cudnnSetConvolutionMathType(p.conv, c.math));
      Dir::workspace(h, p, c.algo, &c.ws);
      c.found = true;
    }
    c.chosen = true;
  }
  if (c.found) DP_CUDNN_CHECK(cudnnSetConvolutionMathType(p.conv, c.math));
  return c.found;
}

/// choose_algo for a float32 plan, which has no fallback: a clear error instead.
template <typename Perf>
void require_algo(CudaBackend& be, int device, cudnnHandle_t h, ConvPlan& p, const Conv2dShape& s, bool tf32,
                  bool benchmark, const void* a, const void* b, void* out) {
  if (!choose_algo<Perf>(be, device, h, p, tf32, benchmark, a, b, out))
    no_float32_algorithm(ConvDirection<Perf>::kName, s, tf32);
}

const char* math_name(cudnnMathType_t m) {
  switch (m) {
    case CUDNN_DEFAULT_MATH: return "default";
    case CUDNN_TENSOR_OP_MATH: return "tensor-op";
    case CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION: return "tensor-op with down-conversion";
    case CUDNN_FMA_MATH: return "FMA";
  }
  return "unknown";
}

/// What Backend::conv_passes says of one direction of a plan of dtype `dt`.
template <typename Algo>
ConvPass describe(const ConvChoice<Algo>& c, DType dt) {
  if (!c.chosen) return {};
  if (c.found)
    return {ConvPass::Path::Native, detail::str_cat("cuDNN ", dtype_name(dt), " algorithm ", static_cast<int>(c.algo),
                                                    ", ", math_name(c.math), " math, ", c.ws, " bytes of workspace")};
  if (dt == DType::F32) return {ConvPass::Path::Unknown, "no float32 algorithm: the call fails"};
  return {ConvPass::Path::Widened, detail::str_cat("widened to float32: cuDNN offers no deterministic ", dtype_name(dt),
                                                   " algorithm within ", kMaxWorkspace >> 20, " MiB of workspace")};
}

}  // namespace

// ---- GEMM ------------------------------------------------------------------------------------

void CudaBackend::gemm(Device dev, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
                       std::int64_t k, float alpha, const float* a, std::int64_t lda,
                       const float* b, std::int64_t ldb, float beta, float* c,
                       std::int64_t ldc) {
  bind(dev);
  if (!check_gemm(trans_a, trans_b, m, n, k, lda, ldb, ldc)) return;
  auto h = cublas(dev.index);
  // Note [TF32 policy]: the handle is the device's, so the mode is set per call (a
  // host-side field write in cuBLAS).
  DP_CUBLAS_CHECK(cublasSetMathMode(h.get(), allow_tf32_matmul() ? CUBLAS_TF32_TENSOR_OP_MATH
                                                                 : CUBLAS_DEFAULT_MATH));
  // Note [Row-major GEMM on cuBLAS]. k == 0 gives C = beta * C, as in BLAS.
  DP_CUBLAS_CHECK(cublasSgemm_64(h.get(), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                 trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha, b, ldb, a,
                                 lda, &beta, c, ldc));
}

// The epilogue as the separate ops (Backend::gemm_epilogue_by_ops): a fused cuBLASLt
// epilogue would sum the bias in another order.
void CudaBackend::gemm_with_epilogue(Device dev, const GemmArgs& a) {
  if (a.batch != 1) {  // one strided-batched call (GemmArgs)
    check_gemm_batch(a);
    bind(dev);
    if (a.batch == 0 || !check_gemm(a.trans_a, a.trans_b, a.m, a.n, a.k, a.lda, a.ldb, a.ldc)) return;
    auto h = cublas(dev.index);
    DP_CUBLAS_CHECK(cublasSetMathMode(h.get(), allow_tf32_matmul() ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
    // Note [Row-major GEMM on cuBLAS], per matrix.
    DP_CUBLAS_CHECK(cublasSgemmStridedBatched_64(
        h.get(), a.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, a.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, a.n, a.m, a.k,
        &a.alpha, static_cast<const float*>(a.b), a.ldb, a.stride_b, static_cast<const float*>(a.a), a.lda,
        a.stride_a, &a.beta, static_cast<float*>(a.c), a.ldc, a.stride_c, a.batch));
    return;
  }
  if (!a.epilogue.empty()) {
    gemm_epilogue_by_ops(dev, a);
    return;
  }
  gemm(dev, a.trans_a, a.trans_b, a.m, a.n, a.k, a.alpha, static_cast<const float*>(a.a), a.lda,
       static_cast<const float*>(a.b), a.ldb, a.beta, static_cast<float*>(a.c), a.ldc);
}

// ---- convolution -------------------------------------------------------------------------------

void CudaBackend::conv2d_forward(Device dev, const Conv2dShape& s, const float* x, const float* w,
                                 const float* bias, float* y) {
  conv_forward(dev, s, x, w, bias, y, /*relu=*/false);
}

void CudaBackend::conv2d_relu_forward(Device dev, const Conv2dShape& s, const float* x, const float* w,
                                      const float* bias, float* y) {
  conv_forward(dev, s, x, w, bias, y, /*relu=*/true);
}

// The convolution through cuDNN, then its bias and ReLU in one pass of dp's own
// (Note [Per-channel maps]): the same float ops as cudnnAddTensor (y + bias) and a
// separate ReLU, in one read and one write of y instead of two of each.
void CudaBackend::conv_forward(Device dev, const Conv2dShape& s, const float* x, const float* w,
                               const float* bias, float* y, bool relu) {
  cudaStream_t compute = bind(dev);
  const bool tf32 = allow_tf32_conv(), benchmark = cudnn_benchmark();
  ConvPlan& p = plan_cache().get(dev.index, s, DType::F32, tf32, benchmark);
  auto h = cudnn(dev.index);  // serialises the use of this device's plans
  std::optional<Scratch> krsc;
  const void* filter = filter_of(*this, dev, DType::F32, s, w, krsc);
  require_algo<cudnnConvolutionFwdAlgoPerf_t>(*this, dev.index, h.get(), p, s, tf32, benchmark, x, filter, y);
  Scratch ws(*this, dev.index, p.fwd.ws);
  const float one = 1.0f, zero = 0.0f;
  DP_CUDNN_CHECK(cudnnConvolutionForward(h.get(), &one, p.x, x, p.w, filter, p.conv, p.fwd.algo, ws.get(),
                                         p.fwd.ws, &zero, p.y, y));
  const ChannelGeom g = output_channels(s);
  cuda_kernels::bias_relu(compute, g.n, g.c, g.hw, bias, relu, y);
}

void CudaBackend::conv2d_backward_data(Device dev, const Conv2dShape& s, const float* gy,
                                       const float* w, float* gx) {
  bind(dev);
  const bool tf32 = allow_tf32_conv(), benchmark = cudnn_benchmark();
  ConvPlan& p = plan_cache().get(dev.index, s, DType::F32, tf32, benchmark);
  auto h = cudnn(dev.index);  // serialises the use of this device's plans
  std::optional<Scratch> krsc;
  const void* filter = filter_of(*this, dev, DType::F32, s, w, krsc);
  require_algo<cudnnConvolutionBwdDataAlgoPerf_t>(*this, dev.index, h.get(), p, s, tf32, benchmark, filter, gy, gx);
  Scratch ws(*this, dev.index, p.bwd_data.ws);
  const float one = 1.0f, zero = 0.0f;
  DP_CUDNN_CHECK(cudnnConvolutionBackwardData(h.get(), &one, p.w, filter, p.y, gy, p.conv, p.bwd_data.algo,
                                              ws.get(), p.bwd_data.ws, &zero, p.x, gx));
}

void CudaBackend::conv2d_backward_weight(Device dev, const Conv2dShape& s, const float* x,
                                         const float* gy, float* gw, float* gbias) {
  cudaStream_t compute = bind(dev);
  const bool tf32 = allow_tf32_conv(), benchmark = cudnn_benchmark();
  ConvPlan& p = plan_cache().get(dev.index, s, DType::F32, tf32, benchmark);
  auto h = cudnn(dev.index);  // serialises the use of this device's plans
  // A channels-last call's filter gradient is K x R x S x C, moved back to KCRS after
  // (Note [Channels-last convolutions on CUDA]).
  std::optional<Scratch> krsc;
  if (s.channels_last)
    krsc.emplace(*this, dev.index, static_cast<std::size_t>(std::max<std::int64_t>(s.K * s.C * s.R * s.S, 1)) * 4);
  void* filter_grad = s.channels_last ? krsc->get() : gw;
  require_algo<cudnnConvolutionBwdFilterAlgoPerf_t>(*this, dev.index, h.get(), p, s, tf32, benchmark, x, gy,
                                                    filter_grad);
  Scratch ws(*this, dev.index, p.bwd_filter.ws);
  const float one = 1.0f, zero = 0.0f;
  DP_CUDNN_CHECK(cudnnConvolutionBackwardFilter(h.get(), &one, p.x, x, p.y, gy, p.conv,
                                                p.bwd_filter.algo, ws.get(), p.bwd_filter.ws, &zero,
                                                p.w, filter_grad));
  if (s.channels_last) move_filter(*this, dev, DType::F32, s, filter_grad, gw, false);
  if (gbias) {  // dp's channel sums, not cudnnConvolutionBackwardBias (Note [Convolution bias gradient])
    const ChannelGeom g = output_channels(s);
    Scratch parts(*this, dev.index,
                  static_cast<std::size_t>(cuda_kernels::channel_sums_scratch(g.n, g.c, g.hw)) * sizeof(float));
    cuda_kernels::channel_sums(compute, g.n, g.c, g.hw, gy, gbias, static_cast<float*>(parts.get()), DType::F32);
  }
}

std::array<ConvPass, 3> CudaBackend::conv_passes(Device dev, const Conv2dShape& s, DType dt) {
  bind(dev);
  ConvPlan* p = plan_cache().find(dev.index, s, dt, allow_tf32_conv(), cudnn_benchmark());
  if (p == nullptr) return {};
  auto h = cudnn(dev.index);  // the choices are written under this lease
  return {describe(p->fwd, dt), describe(p->bwd_data, dt), describe(p->bwd_filter, dt)};
}

// ---- the 16-bit GEMMs and convolutions: kernel table entries ----------------------------------

namespace cuda_kernels {
namespace {

using i64 = std::int64_t;

/// The Gemm op of a 16-bit dtype (Note [16-bit GEMMs on CUDA]).
template <DType dt>
void gemm_16bit(CudaBackend& be, Device dev, const GemmArgs& a) {
  static_assert(dt == DType::BF16 || dt == DType::F16, "gemm_16bit: a 16-bit dtype");
  constexpr cudaDataType_t type = dt == DType::BF16 ? CUDA_R_16BF : CUDA_R_16F;
  check_16bit_epilogue(dt, a);
  check_gemm_batch(a);
  be.bind(dev);
  if (a.batch == 0 || !check_gemm(a.trans_a, a.trans_b, a.m, a.n, a.k, a.lda, a.ldb, a.ldc)) return;
  float beta = a.beta;
  if (a.epilogue.bias != nullptr) {
    // Note [16-bit GEMMs on CUDA]: C starts as its columns' biases (a broadcast copy, 16
    // bytes a thread), and the product adds into it with beta = 1.
    Indexer rows;
    rows.ndim = 2;
    rows.sizes[0] = a.m;
    rows.sizes[1] = a.n;
    rows.strides_a[0] = 0;
    rows.strides_a[1] = 1;
    be.run<Op::StridedCopy>(dev, dt, {rows, a.epilogue.bias, a.c});
    beta = 1.0f;
  }
  auto h = be.cublas(dev.index);
  DP_CUBLAS_CHECK(cublasSetMathMode(
      h.get(), static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  // Note [Row-major GEMM on cuBLAS]. k == 0 gives C = beta * C, as in BLAS. A batch is
  // one strided-batched call (GemmArgs).
  const cublasOperation_t op_b = a.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = a.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (a.batch != 1) {
    DP_CUBLAS_CHECK(cublasGemmStridedBatchedEx_64(h.get(), op_b, op_a, a.n, a.m, a.k, &a.alpha, a.b, type, a.ldb,
                                                  a.stride_b, a.a, type, a.lda, a.stride_a, &beta, a.c, type, a.ldc,
                                                  a.stride_c, a.batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return;
  }
  DP_CUBLAS_CHECK(cublasGemmEx_64(h.get(), op_b, op_a, a.n, a.m, a.k, &a.alpha, a.b, type, a.ldb, a.a, type, a.lda,
                                  &beta, a.c, type, a.ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// The 16-bit convolutions (Note [16-bit convolutions on CUDA]).

i64 input_numel(const Conv2dShape& s) { return s.N * s.C * s.H * s.W; }
i64 weight_numel(const Conv2dShape& s) { return s.K * s.C * s.R * s.S; }
i64 output_numel(const Conv2dShape& s) { return s.N * s.K * s.P * s.Q; }

/// A block of n float32s (at least one) on `dev` for the duration of one call.
CudaBackend::Scratch float_block(CudaBackend& be, Device dev, i64 n) {
  return CudaBackend::Scratch(be, dev.index, static_cast<std::size_t>(std::max<i64>(n, 1)) * sizeof(float));
}
float* f32(const CudaBackend::Scratch& block) { return static_cast<float*>(block.get()); }

/// n values of dtype `dt` widened into the float32 block `to` (exact).
void widen(CudaBackend& be, Device dev, DType dt, const void* from, float* to, i64 n) {
  be.run<Op::Cast>(dev, DType::F32, {from, dt, to, n});
}
/// n float32s rounded once into `to`, of dtype `dt`.
void round_to(CudaBackend& be, Device dev, DType dt, const float* from, void* to, i64 n) {
  be.run<Op::Cast>(dev, dt, {from, DType::F32, to, n});
}

// The widened passes: operands cast to float32 blocks, the float32 pass on its own plan
// with its own bias and ReLU, outputs rounded once.

void forward_widened(CudaBackend& be, Device dev, DType dt, const Conv2dArgs& a) {
  const Conv2dShape& s = a.s;
  auto x = float_block(be, dev, input_numel(s)), w = float_block(be, dev, weight_numel(s));
  auto b = float_block(be, dev, a.bias ? s.K : 0), y = float_block(be, dev, output_numel(s));
  widen(be, dev, dt, a.x, f32(x), input_numel(s));
  widen(be, dev, dt, a.w, f32(w), weight_numel(s));
  if (a.bias) widen(be, dev, dt, a.bias, f32(b), s.K);
  const float* bias = a.bias ? f32(b) : nullptr;
  if (a.relu) {
    be.conv2d_relu_forward(dev, s, f32(x), f32(w), bias, f32(y));
  } else {
    be.conv2d_forward(dev, s, f32(x), f32(w), bias, f32(y));
  }
  round_to(be, dev, dt, f32(y), a.y, output_numel(s));
}

void backward_data_widened(CudaBackend& be, Device dev, DType dt, const Conv2dBackwardDataArgs& a) {
  const Conv2dShape& s = a.s;
  auto gy = float_block(be, dev, output_numel(s)), w = float_block(be, dev, weight_numel(s));
  auto gx = float_block(be, dev, input_numel(s));
  widen(be, dev, dt, a.gy, f32(gy), output_numel(s));
  widen(be, dev, dt, a.w, f32(w), weight_numel(s));
  be.conv2d_backward_data(dev, s, f32(gy), f32(w), f32(gx));
  round_to(be, dev, dt, f32(gx), a.gx, input_numel(s));
}

void backward_weight_widened(CudaBackend& be, Device dev, DType dt, const Conv2dBackwardWeightArgs& a) {
  const Conv2dShape& s = a.s;
  auto x = float_block(be, dev, input_numel(s)), gy = float_block(be, dev, output_numel(s));
  auto gw = float_block(be, dev, weight_numel(s)), gb = float_block(be, dev, a.gbias ? s.K : 0);
  widen(be, dev, dt, a.x, f32(x), input_numel(s));
  widen(be, dev, dt, a.gy, f32(gy), output_numel(s));
  be.conv2d_backward_weight(dev, s, f32(x), f32(gy), f32(gw), a.gbias ? f32(gb) : nullptr);
  round_to(be, dev, dt, f32(gw), a.gw, weight_numel(s));
  if (a.gbias) round_to(be, dev, dt, f32(gb), a.gbias, s.K);
}

/// A Conv2d call with a pool: the convolution and its ReLU into a 16-bit block, then the
/// float32 max-pool of its widened values, rounded (exact).
void forward_pooled(CudaBackend& be, Device dev, DType dt, const Conv2dArgs& a) {
  const Conv2dShape& s = a.s;
  check_conv_pool_layout(s, true);
  const Pool2dShape& ps = a.pool.s;
  const i64 ny = output_numel(s), np = ps.N * ps.C * ps.P * ps.Q;
  CudaBackend::Scratch conv(be, dev.index, static_cast<std::size_t>(std::max<i64>(ny, 1)) * sizeof(std::uint16_t));
  Conv2dArgs plain = a;
  plain.y = conv.get();
  plain.pool = ConvPool{};
  be.run<Op::Conv2d>(dev, dt, plain);
  auto conv_f = float_block(be, dev, ny), pooled = float_block(be, dev, np);
  widen(be, dev, dt, conv.get(), f32(conv_f), ny);
  be.run<Op::MaxPool2d>(dev, DType::F32, {ps, f32(conv_f), f32(pooled), a.pool.winners});
  round_to(be, dev, dt, f32(pooled), a.y, np);
}

/// The Conv2d op of a 16-bit dtype.
template <DType dt>
void conv2d_16bit(CudaBackend& be, Device dev, const Conv2dArgs& a) {
  if (a.pool.on) {
    forward_pooled(be, dev, dt, a);
    return;
  }
  const Conv2dShape& s = a.s;
  if (s.N == 0) return;  // no output, as on the CPU
  cudaStream_t stream = be.bind(dev);
  const bool benchmark = cudnn_benchmark();
  ConvPlan& p = plan_cache().get(dev.index, s, dt, false, benchmark);
  bool native = false;
  {
    auto h = be.cudnn(dev.index);  // serialises the use of this device's plans
    std::optional<CudaBackend::Scratch> krsc;
    const void* filter = filter_of(be, dev, dt, s, a.w, krsc);  // Note [Channels-last convolutions on CUDA]
    native = choose_algo<cudnnConvolutionFwdAlgoPerf_t>(be, dev.index, h.get(), p, false, benchmark, a.x, filter, a.y);
    if (native) {
      // The bias is blended by cuDNN: y = conv + 1 · y (Note [16-bit convolutions on
      // CUDA]: rounded once or twice, per algorithm). Filled after the choice, which may
      // have written y.
      const ChannelGeom g = output_channels(s);
      if (a.bias) channel_fill(stream, g.n, g.c, g.hw, a.bias, a.y, dt);
      CudaBackend::Scratch ws(be, dev.index, p.fwd.ws);
      const float one = 1.0f, beta = a.bias ? 1.0f : 0.0f;
      DP_CUDNN_CHECK(cudnnConvolutionForward(h.get(), &one, p.x, a.x, p.w, filter, p.conv, p.fwd.algo, ws.get(),
                                             p.fwd.ws, &beta, p.y, a.y));
    }
  }
  if (!native) {
    forward_widened(be, dev, dt, a);  // the lease is given back: the float32 pass takes it
    return;
  }
  if (a.relu) be.run<Op::Unary>(dev, dt, {UnaryOp::Relu, a.y, a.y, output_numel(s)});
}

/// The Conv2dBackwardData op of a 16-bit dtype.
template <DType dt>
void conv2d_backward_data_16bit(CudaBackend& be, Device dev, const Conv2dBackwardDataArgs& a) {
  const Conv2dShape& s = a.s;
  if (s.N == 0) return;
  be.bind(dev);
  const bool benchmark = cudnn_benchmark();
  ConvPlan& p = plan_cache().get(dev.index, s, dt, false, benchmark);
  {
    auto h = be.cudnn(dev.index);  // serialises the use of this device's plans
    std::optional<CudaBackend::Scratch> krsc;
    const void* filter = filter_of(be, dev, dt, s, a.w, krsc);  // Note [Channels-last convolutions on CUDA]
    if (choose_algo<cudnnConvolutionBwdDataAlgoPerf_t>(be, dev.index, h.get(), p, false, benchmark, filter, a.gy,
                                                         a.gx)) {
      CudaBackend::Scratch ws(be, dev.index, p.bwd_data.ws);
      const float one = 1.0f, zero = 0.0f;
      DP_CUDNN_CHECK(cudnnConvolutionBackwardData(h.get(), &one, p.w, filter, p.y, a.gy, p.conv, p.bwd_data.algo,
                                                  ws.get(), p.bwd_data.ws, &zero, p.x, a.gx));
      return;
    }
  }
  backward_data_widened(be, dev, dt, a);
}

/// The Conv2dBackwardWeight op of a 16-bit dtype.
template <DType dt>
void conv2d_backward_weight_16bit(CudaBackend& be, Device dev, const Conv2dBackwardWeightArgs& a) {
  const Conv2dShape& s = a.s;
  cudaStream_t stream = be.bind(dev);
  if (s.N == 0) {  // sums over no image, as on the CPU
    be.memset_zero(a.gw, dev, static_cast<std::size_t>(weight_numel(s)) * sizeof(std::uint16_t));
    if (a.gbias) be.memset_zero(a.gbias, dev, static_cast<std::size_t>(s.K) * sizeof(std::uint16_t));
    return;
  }
  const bool benchmark = cudnn_benchmark();
  ConvPlan& p = plan_cache().get(dev.index, s, dt, false, benchmark);
  bool native = false;
  {
    auto h = be.cudnn(dev.index);  // serialises the use of this device's plans
    // Note [Channels-last convolutions on CUDA]: a K x R x S x C gradient, moved back after.
    std::optional<CudaBackend::Scratch> krsc;
    if (s.channels_last) krsc.emplace(be, dev.index, static_cast<std::size_t>(std::max<i64>(weight_numel(s), 1)) * 2);
    void* filter_grad = s.channels_last ? krsc->get() : a.gw;
    native = choose_algo<cudnnConvolutionBwdFilterAlgoPerf_t>(be, dev.index, h.get(), p, false, benchmark, a.x,
                                                              a.gy, filter_grad);
    if (native) {
      CudaBackend::Scratch ws(be, dev.index, p.bwd_filter.ws);
      const float one = 1.0f, zero = 0.0f;
      DP_CUDNN_CHECK(cudnnConvolutionBackwardFilter(h.get(), &one, p.x, a.x, p.y, a.gy, p.conv, p.bwd_filter.algo,
                                                    ws.get(), p.bwd_filter.ws, &zero, p.w, filter_grad));
      if (s.channels_last) move_filter(be, dev, dt, s, filter_grad, a.gw, false);
    }
  }
  if (!native) {
    backward_weight_widened(be, dev, dt, a);
    return;
  }
  if (a.gbias) {  // Note [Convolution bias gradient], over the 16-bit gy
    const ChannelGeom g = output_channels(s);
    auto parts = float_block(be, dev, channel_sums_scratch(g.n, g.c, g.hw));
    channel_sums(stream, g.n, g.c, g.hw, a.gy, a.gbias, f32(parts), dt);
  }
}

/// The Conv2dBackward op: the passes one after another (Backend::conv2d_backward_by_ops).
/// cuDNN reads gy in the tensors' own layout, so the passes have no reorder to share.
template <DType dt>
void conv2d_backward(CudaBackend& be, Device dev, const Conv2dBackwardArgs& a) {
  be.conv2d_backward_by_ops(dev, dt, a);
}

}  // namespace

void register_blas_kernels(CudaBackend& be) {
  add<Op::Gemm, &gemm_16bit<DType::BF16>>(be, DType::BF16);
  add<Op::Gemm, &gemm_16bit<DType::F16>>(be, DType::F16);
  add<Op::Conv2d, &conv2d_16bit<DType::BF16>>(be, DType::BF16);
  add<Op::Conv2d, &conv2d_16bit<DType::F16>>(be, DType::F16);
  add<Op::Conv2dBackwardData, &conv2d_backward_data_16bit<DType::BF16>>(be, DType::BF16);
  add<Op::Conv2dBackwardData, &conv2d_backward_data_16bit<DType::F16>>(be, DType::F16);
  add<Op::Conv2dBackwardWeight, &conv2d_backward_weight_16bit<DType::BF16>>(be, DType::BF16);
  add<Op::Conv2dBackwardWeight, &conv2d_backward_weight_16bit<DType::F16>>(be, DType::F16);
  add<Op::Conv2dBackward, &conv2d_backward<DType::F32>>(be, DType::F32);
  add<Op::Conv2dBackward, &conv2d_backward<DType::BF16>>(be, DType::BF16);
  add<Op::Conv2dBackward, &conv2d_backward<DType::F16>>(be, DType::F16);
}

}  // namespace cuda_kernels

}  // namespace dp::backend
