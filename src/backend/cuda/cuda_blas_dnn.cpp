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
// default). There is no epilogue: bias and ReLU are separate ops for 16-bit dtypes, as
// on the CPU.
//
// Note [cuDNN algorithm choice]
// Each convolution shape gets a plan — descriptors plus one algorithm per direction —
// built at its first use and cached per device. Algorithms come from the cudnnGet*_v7
// heuristics (no benchmarking, so no host sync and no extra cudaMalloc even on the
// first step), taking the first that succeeds, is DETERMINISTIC (DP promises bitwise
// reproducible gradients), uses the math the TF32 policy allows (Note [TF32 policy]
// in dp/core/device.h: with TF32 off, CUDNN_FMA_MATH only — CUDNN_DEFAULT_MATH lets
// Ampere use TF32 — and no fallback: a clear error instead) and needs at most
// kMaxWorkspace. Plans are cached per (device, shape, policy). The workspace comes from the
// caching allocator on the current stream and is released right after the enqueue.
// With dp::set_cudnn_benchmark(true) (Note [cuDNN benchmark], dp/core/device.h) the
// candidates come from cudnnFind*AlgorithmEx instead, timed on the call's own tensors
// (it writes only the output, which the call then overwrites), sorted fastest first,
// and filtered by the same rules. It synchronises the device, once per shape and
// direction, so it runs without the cache's mutex: another device's thread must be
// able to enqueue its part of a collective that this device's stream waits for. A
// plan's fields need no lock of their own: the device's cuDNN handle lease, held for
// the whole call, serialises every use of that device's plans.
#include <algorithm>
#include <array>
#include <climits>
#include <map>
#include <memory>
#include <mutex>
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

using ConvKey = std::array<std::int64_t, 13>;

ConvKey key_of(const Conv2dShape& s) {
  return {s.N, s.C, s.H, s.W, s.K, s.R, s.S, s.stride_h, s.stride_w, s.pad_h, s.pad_w, s.P, s.Q};
}

/// One direction's chosen algorithm, its math type and its workspace.
template <typename Algo>
struct ConvChoice {
  bool chosen = false;
  Algo algo{};
  cudnnMathType_t math{};
  std::size_t ws = 0;
};

/// Descriptors and chosen algorithms of one convolution shape on one device.
struct ConvPlan {
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

/// The first usable heuristic result (Note [cuDNN algorithm choice]).
template <typename Perf>
const Perf* pick(const Perf* perf, int count, bool allow_tf32, const char* direction,
                 const Conv2dShape& s) {
  for (int i = 0; i < count; ++i) {
    const Perf& p = perf[i];
    if (p.status != CUDNN_STATUS_SUCCESS || p.memory > kMaxWorkspace) continue;
    if (p.determinism != CUDNN_DETERMINISTIC) continue;
    if (allow_tf32 || p.mathType == CUDNN_FMA_MATH) return &p;
  }
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

cudnnMathType_t requested_math(bool allow_tf32) { return allow_tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH; }

class ConvPlanCache {
 public:
  /// The plan of `s` on `device`, with descriptors made; algorithms are chosen per
  /// direction by the callers below on first use. Holds no lock after return: plans
  /// are never erased, and each direction is filled once under mu_.
  ConvPlan& get(int device, const Conv2dShape& s, bool allow_tf32, bool benchmark) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& slot = plans_[{device, key_of(s), allow_tf32, benchmark}];
    if (!slot) slot = make_plan(s, allow_tf32);
    return *slot;
  }

 private:
  static std::unique_ptr<ConvPlan> make_plan(const Conv2dShape& s, bool allow_tf32) {
    DP_CHECK(s.N > 0 && s.C > 0 && s.H > 0 && s.W > 0 && s.K > 0 && s.R > 0 && s.S > 0 &&
                 s.stride_h > 0 && s.stride_w > 0 && s.pad_h >= 0 && s.pad_w >= 0,
             "conv2d: expected positive sizes and strides, non-negative padding; got N=", s.N,
             " C=", s.C, " H=", s.H, " W=", s.W, " K=", s.K, " R=", s.R, " S=", s.S);
    auto p = std::make_unique<ConvPlan>();
    DP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->x));
    DP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->y));
    DP_CUDNN_CHECK(cudnnCreateFilterDescriptor(&p->w));
    DP_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&p->conv));
    DP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT,
                                              to_int(s.N, "N"), to_int(s.C, "C"),
                                              to_int(s.H, "H"), to_int(s.W, "W")));
    DP_CUDNN_CHECK(cudnnSetFilter4dDescriptor(p->w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW,
                                              to_int(s.K, "K"), to_int(s.C, "C"),
                                              to_int(s.R, "R"), to_int(s.S, "S")));
    DP_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(
        p->conv, to_int(s.pad_h, "pad_h"), to_int(s.pad_w, "pad_w"),
        to_int(s.stride_h, "stride_h"), to_int(s.stride_w, "stride_w"), 1, 1,
        CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    DP_CUDNN_CHECK(cudnnSetConvolutionMathType(p->conv, requested_math(allow_tf32)));
    int n = 0, k = 0, h = 0, w = 0;
    DP_CUDNN_CHECK(cudnnGetConvolution2dForwardOutputDim(p->conv, p->x, p->w, &n, &k, &h, &w));
    DP_CHECK(n == s.N && k == s.K && h == s.P && w == s.Q, "conv2d: output shape (", s.N, ", ",
             s.K, ", ", s.P, ", ", s.Q, ") does not match the geometry, which gives (", n, ", ",
             k, ", ", h, ", ", w, ")");
    DP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, k,
                                              h, w));
    return p;
  }

  std::mutex mu_;
  std::map<std::tuple<int, ConvKey, bool, bool>, std::unique_ptr<ConvPlan>> plans_;
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
/// algorithm choice]) and sets the plan's math type to the chosen one's. `h` is the
/// device's cuDNN handle, held by the caller for the whole call; a, b, out are the
/// call's own tensors (ConvDirection's order), which a benchmark search may write.
template <typename Perf>
void choose_algo(CudaBackend& be, int device, cudnnHandle_t h, ConvPlan& p, const Conv2dShape& s, bool tf32,
                 bool benchmark, const void* a, const void* b, void* out) {
  using Dir = ConvDirection<Perf>;
  auto& c = Dir::choice(p);
  if (!c.chosen) {
    Perf perf[kMaxAlgos];
    int count = 0;
    DP_CUDNN_CHECK(cudnnSetConvolutionMathType(p.conv, requested_math(tf32)));
    if (benchmark) {
      const std::size_t bytes = find_workspace_bytes();
      CudaBackend::Scratch ws(be, device, bytes);
      Dir::find(h, p, a, b, out, &count, perf, ws.get(), bytes);
    } else {
      Dir::heuristics(h, p, &count, perf);
    }
    const Perf* best = pick(perf, count, tf32, Dir::kName, s);
    c.algo = best->algo;
    c.math = best->mathType;
    DP_CUDNN_CHECK(cudnnSetConvolutionMathType(p.conv, c.math));
    Dir::workspace(h, p, c.algo, &c.ws);
    c.chosen = true;
  }
  DP_CUDNN_CHECK(cudnnSetConvolutionMathType(p.conv, c.math));
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
  if (!a.epilogue.empty()) {
    gemm_epilogue_by_ops(dev, a);
    return;
  }
  gemm(dev, a.trans_a, a.trans_b, a.m, a.n, a.k, a.alpha, static_cast<const float*>(a.a), a.lda,
       static_cast<const float*>(a.b), a.ldb, a.beta, static_cast<float*>(a.c), a.ldc);
}

namespace cuda_kernels {
namespace {

/// The Gemm op of a 16-bit dtype (Note [16-bit GEMMs on CUDA]).
template <DType dt>
void gemm_16bit(CudaBackend& be, Device dev, const GemmArgs& a) {
  static_assert(dt == DType::BF16 || dt == DType::F16, "gemm_16bit: a 16-bit dtype");
  constexpr cudaDataType_t type = dt == DType::BF16 ? CUDA_R_16BF : CUDA_R_16F;
  DP_CHECK(a.epilogue.empty(), "gemm: a ", dtype_name(dt),
           " product takes no epilogue (bias and ReLU are separate ops for 16-bit dtypes)");
  be.bind(dev);
  if (!check_gemm(a.trans_a, a.trans_b, a.m, a.n, a.k, a.lda, a.ldb, a.ldc)) return;
  auto h = be.cublas(dev.index);
  DP_CUBLAS_CHECK(cublasSetMathMode(
      h.get(), static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  // Note [Row-major GEMM on cuBLAS]. k == 0 gives C = beta * C, as in BLAS.
  DP_CUBLAS_CHECK(cublasGemmEx_64(h.get(), a.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, a.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                  a.n, a.m, a.k, &a.alpha, a.b, type, a.ldb, a.a, type, a.lda, &a.beta, a.c, type,
                                  a.ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

void register_blas_kernels(CudaBackend& be) {
  add<Op::Gemm, &gemm_16bit<DType::BF16>>(be, DType::BF16);
  add<Op::Gemm, &gemm_16bit<DType::F16>>(be, DType::F16);
}

}  // namespace cuda_kernels

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
  ConvPlan& p = plan_cache().get(dev.index, s, tf32, benchmark);
  auto h = cudnn(dev.index);  // serialises the use of this device's plans
  choose_algo<cudnnConvolutionFwdAlgoPerf_t>(*this, dev.index, h.get(), p, s, tf32, benchmark, x, w, y);
  Scratch ws(*this, dev.index, p.fwd.ws);
  const float one = 1.0f, zero = 0.0f;
  DP_CUDNN_CHECK(cudnnConvolutionForward(h.get(), &one, p.x, x, p.w, w, p.conv, p.fwd.algo, ws.get(),
                                         p.fwd.ws, &zero, p.y, y));
  cuda_kernels::bias_relu(compute, s.N, s.K, s.P * s.Q, bias, relu, y);
}

void CudaBackend::conv2d_backward_data(Device dev, const Conv2dShape& s, const float* gy,
                                       const float* w, float* gx) {
  bind(dev);
  const bool tf32 = allow_tf32_conv(), benchmark = cudnn_benchmark();
  ConvPlan& p = plan_cache().get(dev.index, s, tf32, benchmark);
  auto h = cudnn(dev.index);  // serialises the use of this device's plans
  choose_algo<cudnnConvolutionBwdDataAlgoPerf_t>(*this, dev.index, h.get(), p, s, tf32, benchmark, w, gy, gx);
  Scratch ws(*this, dev.index, p.bwd_data.ws);
  const float one = 1.0f, zero = 0.0f;
  DP_CUDNN_CHECK(cudnnConvolutionBackwardData(h.get(), &one, p.w, w, p.y, gy, p.conv, p.bwd_data.algo,
                                              ws.get(), p.bwd_data.ws, &zero, p.x, gx));
}

void CudaBackend::conv2d_backward_weight(Device dev, const Conv2dShape& s, const float* x,
                                         const float* gy, float* gw, float* gbias) {
  cudaStream_t compute = bind(dev);
  const bool tf32 = allow_tf32_conv(), benchmark = cudnn_benchmark();
  ConvPlan& p = plan_cache().get(dev.index, s, tf32, benchmark);
  auto h = cudnn(dev.index);  // serialises the use of this device's plans
  choose_algo<cudnnConvolutionBwdFilterAlgoPerf_t>(*this, dev.index, h.get(), p, s, tf32, benchmark, x, gy, gw);
  Scratch ws(*this, dev.index, p.bwd_filter.ws);
  const float one = 1.0f, zero = 0.0f;
  DP_CUDNN_CHECK(cudnnConvolutionBackwardFilter(h.get(), &one, p.x, x, p.y, gy, p.conv,
                                                p.bwd_filter.algo, ws.get(), p.bwd_filter.ws, &zero,
                                                p.w, gw));
  if (gbias) {  // dp's channel sums, not cudnnConvolutionBackwardBias (Note [Convolution bias gradient])
    const std::int64_t HW = s.P * s.Q;
    Scratch parts(*this, dev.index,
                  static_cast<std::size_t>(cuda_kernels::channel_sums_scratch(s.N, s.K, HW)) * sizeof(float));
    cuda_kernels::channel_sums(compute, s.N, s.K, HW, gy, gbias, static_cast<float*>(parts.get()));
  }
}

}  // namespace dp::backend
