// src/backend/ops.h — the one list of backend ops: their names, their argument structs,
// and the element types kernels are registered for.
//
// Note [The op list]
// Every compute entry of a backend is an op of DP_BACKEND_OPS below, called through the
// backend's kernel table, indexed by (op, dtype):
//   be.run<Op::Unary>(dev, DType::F32, {UnaryOp::Exp, x, y, n});
// A backend registers one kernel per (op, dtype) it implements, from the file that holds
// the kernel (CPU: the register_* function at the end of each cpu_*.cpp; CUDA: the
// register_* function at the end of each cuda_*.cu, through cuda_register.h); a call of a pair with no kernel throws
// dp::Error naming the op, the dtype and the device type. The same list generates the
// Op enum, the op names, the OpArgs mapping, the op table test's coverage check
// (tests/backend/op_table_test.cpp: every registered (op, dtype) must be called by a
// case of tests/backend/op_cases.cpp) and its recording backend. So
//  - a new op is a line here with its argument struct beside it, a CPU kernel (with its
//    register line, in one cpu_*.cpp), a CUDA kernel (with its launcher and register
//    line, in one cuda_*.cu), and a row of tests/backend/op_cases.cpp;
//  - a new dtype is a DType value (with its C++ type in DTypeOf/dtype_of) and table
//    entries: kernels are templates over the storage type (functors.h computes in
//    float, Note [Storage types]), instantiated once more and registered.
// Pointers in the argument structs are untyped: their element type is the call's dtype
// unless the struct says otherwise (an index is always int64). Counts are elements.
// Memory, streams, events and copies are not ops: they stay virtual methods of Backend.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>

#include "dp/core/half.h"

namespace dp::backend {

/// Most dimensions a strided elementwise kernel handles.
inline constexpr int kMaxDims = 8;

/// Strided view of up to two inputs for an elementwise kernel with a contiguous output.
/// A stride of 0 broadcasts that dimension. Passed by value into CUDA kernels.
struct Indexer {
  int ndim = 0;
  std::int64_t sizes[kMaxDims] = {};
  std::int64_t strides_a[kMaxDims] = {};  // in elements
  std::int64_t strides_b[kMaxDims] = {};  // in elements
};

// Note [Op enum sentinels]
// Each op enum ends with kCount, the number of ops: not an op itself (the backends
// reject it). The op table (tests/backend/op_cases.cpp) has one row per op and
// static_asserts its length against kCount, so a new op without a test and benchmark
// case does not compile; op_table_test also checks at run time that every op is called.

enum class UnaryOp : std::uint8_t {
  Neg, Exp, Log, Sqrt, Rsqrt, Abs, Square, Reciprocal, Relu, Sigmoid, Tanh,
  Sign,  // -1, 0, +1
  Erf,
  LogSigmoid,  // log σ(x) = min(x, 0) - log1p(exp(-|x|)), PyTorch's formula
  kCount  // Note [Op enum sentinels]
};

enum class BinaryOp : std::uint8_t {
  Add, Sub, Mul, Div, Maximum, Minimum, Pow,
  Eq,            // 1.0f where a == b else 0.0f
  Gt,            // 1.0f where a > b else 0.0f
  ReluBackward,  // a * (b > 0): a = upstream gradient, b = relu input (or output)
  kCount         // Note [Op enum sentinels]
};

enum class ReduceOp : std::uint8_t {
  Sum, Max, Min,
  kCount  // Note [Op enum sentinels]
};

/// Geometry of a 2-d convolution (groups = 1, dilation = 1). Layouts are NCHW for x/y
/// (and their gradients) and KCRS for the weight and its gradient (K output channels,
/// R×S kernel); with channels_last, x, y, gx and gy lie N×H×W×C (Note [Channels-last
/// tensors]) and the weight stays KCRS.
struct Conv2dShape {
  std::int64_t N = 0, C = 0, H = 0, W = 0;  // input
  std::int64_t K = 0, R = 0, S = 0;         // weight
  std::int64_t stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;
  std::int64_t P = 0, Q = 0;                // output height, width
  bool channels_last = false;
};

/// Geometry of a 2-d pooling window over NCHW.
struct Pool2dShape {
  std::int64_t N = 0, C = 0, H = 0, W = 0;
  std::int64_t kernel_h = 1, kernel_w = 1, stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;
  std::int64_t P = 0, Q = 0;  // output height, width
};


/// Element types kernels are registered for: the values of dp::Dtype (tensor.h static_
/// asserts that they agree), so a tensor's dtype indexes the table directly.
enum class DType : std::uint8_t {
  F32 = 0,
  I64 = 1,
  I32 = 2,
  BF16 = 3,
  F16 = 4,
  kCount  // Note [Op enum sentinels]
};
inline constexpr int kDTypeCount = static_cast<int>(DType::kCount);
/// The floating dtypes: float32 and the 16-bit storage types (Note [Storage types]).
constexpr bool is_floating(DType dt) { return dt == DType::F32 || dt == DType::BF16 || dt == DType::F16; }

/// "float32", "int64", "int32", "bfloat16", "float16".
const char* dtype_name(DType dt);
/// Throws the dp::Error of a dtype value out of range (visit_dtype's default).
[[noreturn]] void visit_dtype_failed(DType dt);

/// The DType of a C++ storage type.
template <typename T>
struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::F32; };
template <> struct DTypeOf<std::int64_t> { static constexpr DType value = DType::I64; };
template <> struct DTypeOf<std::int32_t> { static constexpr DType value = DType::I32; };
template <> struct DTypeOf<BFloat16> { static constexpr DType value = DType::BF16; };
template <> struct DTypeOf<Float16> { static constexpr DType value = DType::F16; };
template <typename T>
inline constexpr DType dtype_of = DTypeOf<T>::value;

/// Calls f(T{}) with the C++ type T of `dt`: kernels that take a second dtype (a cast's
/// source) visit it. A new dtype adds its case here.
template <typename F>
void visit_dtype(DType dt, F&& f) {
  switch (dt) {
    case DType::F32: f(float{}); return;
    case DType::I64: f(std::int64_t{}); return;
    case DType::I32: f(std::int32_t{}); return;
    case DType::BF16: f(BFloat16{}); return;
    case DType::F16: f(Float16{}); return;
    case DType::kCount: break;
  }
  visit_dtype_failed(dt);
}

/// A scalar argument for a kernel of any dtype: the value as given, read with as<T>()
/// in the kernel's storage type. A float keeps its exact value, an int64 too.
struct Scalar {
  double f = 0;
  std::int64_t i = 0;
  bool is_int = false;

  Scalar() = default;
  Scalar(float v) : f(v), i(static_cast<std::int64_t>(v)) {}  // NOLINT: a value, not a conversion
  Scalar(std::int64_t v) : f(static_cast<double>(v)), i(v), is_int(true) {}  // NOLINT
  template <typename T>
  T as() const {
    if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(is_int ? i : static_cast<std::int64_t>(f));
    } else {
      return static_cast<T>(is_int ? static_cast<double>(i) : f);
    }
  }
};

// ---- argument structs, one per op (pointers hold the call's dtype unless said) ---------

/// y[i] = value.
struct FillArgs {
  void* y;
  std::int64_t n;
  Scalar value;
};
/// y[i] += value (counters such as BatchNorm's num_batches_tracked; no host sync).
struct AddScalarArgs {
  void* y;
  std::int64_t n;
  Scalar value;
};
/// y[i] = start + i * step.
struct ArangeArgs {
  void* y;
  std::int64_t n;
  Scalar start;
  Scalar step;
};
/// y[i] = x[i] converted to the call's dtype from x_dtype: float to integer truncates
/// toward zero; int64 to int32 is modulo 2^32 (what PyTorch's .int() gives).
struct CastArgs {
  const void* x;
  DType x_dtype;
  void* y;
  std::int64_t n;
};
/// y = op(x), contiguous; y may alias x.
struct UnaryArgs {
  UnaryOp op;
  const void* x;
  void* y;
  std::int64_t n;
};
/// y = alpha * x + beta, contiguous; y may alias x.
struct AffineArgs {
  const void* x;
  void* y;
  std::int64_t n;
  float alpha;
  float beta;
};
/// y += alpha * x, contiguous.
struct AxpyArgs {
  float alpha;
  const void* x;
  void* y;
  std::int64_t n;
};
/// out = op(a, b) over the indexer's shape; out contiguous, a/b strided (0 = broadcast).
/// For a floating dtype out has the call's dtype, Eq and Gt included (1 or 0 in it); an
/// integer dtype compares exactly and writes float32 1 or 0 (int64 kernels implement Eq
/// only).
struct BinaryArgs {
  BinaryOp op;
  Indexer ix;
  const void* a;
  const void* b;
  void* out;
};
/// out = cond != 0 ? a : b over the indexer's shape (torch.where); out contiguous, a and
/// b strided as in Binary (ix.strides_a, ix.strides_b; 0 = broadcast), cond strided by
/// strides_cond. cond is float32 whatever the call's dtype (dp has no bool: its
/// comparisons give 0/1); any nonzero value, NaN included, selects a.
struct WhereArgs {
  Indexer ix;
  std::int64_t strides_cond[kMaxDims] = {};  // in elements
  const float* cond;
  const void* a;
  const void* b;
  void* out;
};
/// out = a (strided, the indexer's strides_a) gathered into contiguous order.
struct StridedCopyArgs {
  Indexer ix;
  const void* a;
  void* out;
};
// Note [Gather geometry]
// gather and scatter_add walk the elements n of a contiguous tensor of shape ix.sizes
// (gather's output, scatter_add's source) with coordinates c. The element of the
// other tensor x that n pairs with is at
//   Σ_{d != dim} c_d · ix.strides_a[d]  +  index[Σ_d c_d · ix.strides_b[d]] · ix.strides_a[dim]
// (strides in elements). torch.gather is index strides = its own contiguous strides;
// index_select is a 1-d index with strides_b 0 outside `dim`. Every index must lie in
// [0, size of x along dim): the caller checks, the kernels do not.

/// out[n] = x[offset(n)] (Note [Gather geometry]); index: int64.
struct GatherArgs {
  Indexer ix;
  int dim;
  const void* x;
  const std::int64_t* index;
  void* out;
};
/// y[offset(n)] += src[n] (Note [Gather geometry]): the backward of gather and
/// index_select. CPU adds in element order (bitwise reproducible). CUDA adds whole
/// float32 rows along dim 0 (an embedding's backward) in that order too (Note [Row
/// scatter-add in position order]: the CPU's bits); elsewhere it uses atomics, so
/// repeated indices sum in an unspecified order.
struct ScatterAddArgs {
  Indexer ix;
  int dim;
  const void* src;
  const std::int64_t* index;
  void* y;
};
/// x viewed as (outer, r, inner): y[o, i] = op over k of x[o, k, i]. r may be 0 (Sum
/// gives 0).
struct ReduceArgs {
  ReduceOp op;
  const void* x;
  void* y;
  std::int64_t outer;
  std::int64_t r;
  std::int64_t inner;
};
/// x viewed as (outer, r, inner): y[o, i] = argmax over k (first on ties); y: int64.
struct ArgmaxArgs {
  const void* x;
  std::int64_t* y;
  std::int64_t outer;
  std::int64_t r;
  std::int64_t inner;
};
/// *count (host memory) = the number of non-finite x[i] (the opt-in NaN/Inf check).
/// Synchronous: *count is set when the call returns.
struct CountNonfiniteArgs {
  const void* x;
  std::int64_t n;
  std::int64_t* count;
};
/// x[i] = scale * x[i] + 0 in place (Affine's bits with beta 0: Tensor::mul_), and
/// *found = 1 when some x[i] was NaN or infinite before the multiply. *found (float32,
/// in the device's memory) is only ever set, never cleared, so calls over many tensors
/// can share one flag, which the caller zeroes once and reads once (Note [Unscaling
/// with one read per device] in src/nn/utils.cpp). Enqueued like any op: no host sync.
struct ScaleFindNonfiniteArgs {
  void* x;
  std::int64_t n;
  float scale;
  float* found;
};

// ---- random (counter-based Philox: same numbers on every backend) ----------------------

/// y[i] = uniform in [lo, hi) from (seed, offset + i).
struct FillUniformArgs {
  void* y;
  std::int64_t n;
  float lo;
  float hi;
  std::uint64_t seed;
  std::uint64_t offset;
};
/// y[i] = normal(mean, std) from (seed, offset + i).
struct FillNormalArgs {
  void* y;
  std::int64_t n;
  float mean;
  float std;
  std::uint64_t seed;
  std::uint64_t offset;
};
/// Inverted dropout: mask[i] = keep ? 1/(1-p) : 0 with keep drawn from (seed, offset +
/// i); y = x * mask.
struct DropoutArgs {
  const void* x;
  void* y;
  void* mask;
  std::int64_t n;
  float p;
  std::uint64_t seed;
  std::uint64_t offset;
};

// ---- dense linear algebra --------------------------------------------------------------

/// What follows a GEMM on every element of C, in this order (each step only when given):
/// masked by a ReLU output laid out as C (relu_y > 0 ? c : 0, Binary<ReluBackward>), plus
/// a bias per column (Binary<Add>), then relu (Unary<Relu>) — bit for bit those ops run
/// after the GEMM. A backend may apply them to each slab of C while it is in cache
/// (CPU: Note [Linear epilogue]); one that does not runs the ops.
struct GemmEpilogue {
  const void* bias = nullptr;    // n values, or null
  bool relu = false;
  const void* relu_y = nullptr;  // laid out as C (rows ldc apart), or null
  bool empty() const { return bias == nullptr && !relu && relu_y == nullptr; }
};
/// Row-major C(m×n) = alpha * op(A) * op(B) + beta * C, then the epilogue; op(A) is m×k,
/// op(B) is k×n. lda/ldb/ldc are row strides of the stored (untransposed) matrices. With
/// an epilogue, ldc == n. A Linear's forward is (N,T) with bias and relu, its input
/// gradient (N,N) with relu_y. With batch > 1, `batch` such products (a bmm): matrix i's
/// A, B and C start stride_a, stride_b and stride_c elements after matrix i - 1's (a
/// stride of 0 reuses one A or B; the Cs must not overlap), and there is no epilogue.
/// cuBLAS runs a batch as one strided-batched call; the CPU one product after another.
struct GemmArgs {
  bool trans_a;
  bool trans_b;
  std::int64_t m;
  std::int64_t n;
  std::int64_t k;
  float alpha;
  const void* a;
  std::int64_t lda;
  const void* b;
  std::int64_t ldb;
  float beta;
  void* c;
  std::int64_t ldc;
  GemmEpilogue epilogue;
  std::int64_t batch = 1;
  std::int64_t stride_a = 0;
  std::int64_t stride_b = 0;
  std::int64_t stride_c = 0;
};

// ---- softmax and losses (rows × cols, rows = batch) ------------------------------------

struct LogSoftmaxArgs {
  const void* x;
  void* y;
  std::int64_t rows;
  std::int64_t cols;
};
/// gx = gy - exp(y) * rowsum(gy), y = log_softmax output.
struct LogSoftmaxBackwardArgs {
  const void* gy;
  const void* y;
  void* gx;
  std::int64_t rows;
  std::int64_t cols;
};
/// A target no class index equals: nothing ignored.
inline constexpr std::int64_t kNoIgnoreIndex = std::numeric_limits<std::int64_t>::min();
/// loss[r] = -logp[r, target[r]], and 0 where target[r] == ignore_index (PyTorch's
/// ignore_index, in [0, cols) or not). Other targets out of [0, cols) throw dp::Error on
/// CPU; CUDA writes NaN for that row (checked without a host sync).
struct NllForwardArgs {
  const void* logp;
  const std::int64_t* target;
  void* loss;
  std::int64_t rows;
  std::int64_t cols;
  std::int64_t ignore_index = kNoIgnoreIndex;
};
/// gx = 0 except gx[r, target[r]] = -gloss[r] where target[r] != ignore_index.
struct NllBackwardArgs {
  const void* gloss;
  const std::int64_t* target;
  void* gx;
  std::int64_t rows;
  std::int64_t cols;
  std::int64_t ignore_index = kNoIgnoreIndex;
};

// ---- convolution and pooling (NCHW) ------------------------------------------------------

// Note [Fusions are the backend's]
// nn calls the generic ops only; which of them run fused, and how, each backend decides
// behind its kernels. What the caller may ask for is an epilogue of a generic op, the
// ops that follow it in the caller's own graph: the ReLU after a convolution, the
// max-pool after that (Conv2dArgs::pool), the ReLU's mask before a max-pool's backward
// (MaxPool2dBackwardArgs::relu_y), that backward before the convolution's
// (Conv2dBackwardArgs::pool), the bias and ReLU after a GEMM (GemmEpilogue). Every
// backend computes each epilogue, bit for bit what the separate ops give: the CPU in
// one pass while the data is in cache (Notes [Convolution + ReLU], [Convolution, ReLU
// and max-pool in one pass]), another by running the ops (Backend::conv2d_pool_by_ops,
// max_pool2d_backward_by_ops, conv2d_backward_by_ops, gemm_epilogue_by_ops). Specialised kernels for common
// shapes (the 2x2 max-pool, Note [Branch-free 2x2 max-pool]) are chosen inside the
// generic op's kernel; where forward leaves state for backward, the backend picks its
// format (the max-pool's winners, Backend::max_pool2d_byte_winners). A fusion is added
// as a kernel's own path, a test of it against the ops it fuses, and a case of the
// generic op's shape in tests/backend/op_cases.cpp; never as an op nn must ask for.

/// A max-pool over a convolution's output, run by the Conv2d call (Note [Fusions are
/// the backend's]): y then holds MaxPool2d's output over the convolution's (after its
/// ReLU), `winners` its winners, and the convolution's output is not returned.
struct ConvPool {
  bool on = false;
  Pool2dShape s;            // the pool over the convolution's (N, K, P, Q) output
  void* winners = nullptr;  // as MaxPool2dArgs::winners for s
};
/// y = conv(x, w) + bias (bias may be null), then relu when `relu`: bit for bit the
/// convolution followed by Unary<Relu> in place; a backend may fuse the two (Note
/// [Convolution + ReLU]). With `pool.on`, then that max-pool into y.
struct Conv2dArgs {
  Conv2dShape s;
  const void* x;
  const void* w;
  const void* bias;
  void* y;
  bool relu;
  ConvPool pool = {};
};
/// gx = conv_transpose(gy, w) (overwrites gx).
struct Conv2dBackwardDataArgs {
  Conv2dShape s;
  const void* gy;
  const void* w;
  void* gx;
};
/// gw = correlation of x and gy, gbias = sum of gy over N, P, Q (overwrite; gbias may be
/// null).
struct Conv2dBackwardWeightArgs {
  Conv2dShape s;
  const void* x;
  const void* gy;
  void* gw;
  void* gbias;
};
/// The max-pool (and the ReLU under it) that a Conv2d call ran after its convolution,
/// seen from backward: the call's gy is then the gradient of the pool's output, routed
/// to the convolution's output through `winners` after the mask relu_y > 0, as
/// MaxPool2dBackwardArgs with relu_y — the prologue of the backward passes that
/// ConvPool is the epilogue of the forward.
struct ConvPoolBackward {
  bool on = false;
  Pool2dShape s;                   // as ConvPool::s
  const void* winners = nullptr;   // what the forward's ConvPool::winners received
  const void* relu_y = nullptr;    // the pooled output (the mask); null: no mask
};
/// Both backward passes of a convolution in one call, as PyTorch's convolution_backward
/// with its output mask: gx as Conv2dBackwardDataArgs when gx is not null, gw and gbias
/// as Conv2dBackwardWeightArgs when gw is not null (gbias may be null); with pool.on,
/// gy is the gradient of the pool's output (ConvPoolBackward). Bit for bit the ops it
/// stands for, one after another (Backend::conv2d_backward_by_ops); a backend may share
/// work between the passes (CPU: Note [Convolution backward in one call]).
struct Conv2dBackwardArgs {
  Conv2dShape s;
  const void* gy;
  const void* x;
  const void* w;
  void* gx;
  void* gw;
  void* gbias;
  ConvPoolBackward pool = {};
};
// Note [Max-pool winners]
// Max-pool's forward records each window's winner for its backward, in the format the
// backend picks for the shape: an int64 flat index h*W+w in the plane per output, or,
// where Backend::max_pool2d_byte_winners(s) says so (2x2 tilings only), one byte per
// output, the winner's place 0..3 in its window in row-major order (Note [Max-pool
// winners in a byte]). Callers allocate max_pool2d_winner_bytes(be, s) and hand the
// block from forward to backward untouched.

/// y = max over the window (padding never wins; the first maximum in row-major order, a
/// NaN wins), and each window's winner in `winners` (Note [Max-pool winners]).
struct MaxPool2dArgs {
  Pool2dShape s;
  const void* x;
  void* y;
  void* winners;
};
/// gx = the window's gradient at its winner, summed where windows overlap, zero
/// elsewhere (overwrites gx). relu_y, when not null, is this pool's output over a ReLU's
/// output: each window's gradient is masked first, relu_y > 0 ? gy : 0 — bit for bit
/// Binary<ReluBackward>(gy, relu_y) followed by this backward (Note [ReLU mask through
/// max-pool] in src/nn/functional.cpp).
struct MaxPool2dBackwardArgs {
  Pool2dShape s;
  const void* gy;
  const void* winners;
  const void* relu_y;
  void* gx;
};
// Note [Fused ops a backend may offer]
// A few ops are fusions that only some backends have kernels for (the fused attention
// below); a caller asks the table (be.supports(op, dtype)) and otherwise runs the ops
// they fuse, with the same results. Convolution and pooling fusions are not such ops:
// Note [Fusions are the backend's].

// ---- fused attention (Note [Fused attention] in src/backend/cpu/cpu_attention.cpp) -------

/// B·H independent attention problems: queries (L, E), keys (S, E), values (S, Ev).
struct AttentionShape {
  std::int64_t B = 0, H = 0;  // batch, heads
  std::int64_t L = 0, S = 0;  // queries, keys
  std::int64_t E = 0, Ev = 0;  // head dims of q and k, of v
};
/// An optional mask over (B, H, L, S), strided (in elements; 0 broadcasts a dim): added
/// to the scores, or with `keep` a 0/1 keep-mask (nonzero attends, 0 masks). Its dtype
/// is float32 or the call's.
struct AttentionMask {
  const void* p = nullptr;  // null: no mask
  std::int64_t sb = 0, sh = 0, sl = 0, ss = 0;
  bool keep = false;
  DType dtype = DType::F32;
};
/// Dropout on the attention weights (softmax's output): weight (b, h, i, j) is kept,
/// scaled by 1/(1-p), where the dropout op's draw for counter offset + ((b·H + h)·L +
/// i)·S + j under seed keeps it — the bits the dropout op gives the math path's (B, H,
/// L, S) weights, regenerated in the backward, never stored. p = 0: none; p < 1.
struct AttentionDropout {
  float p = 0.0f;
  std::uint64_t seed = 0, offset = 0;
};
/// out (B, H, L, Ev) = softmax(q kᵀ · scale + mask) v, and lse (B, H, L, float32) the
/// log-sum-exp of each row of the masked scores, for the backward. q (B, H, L, E), k
/// (B, H, S, E), v (B, H, S, Ev) contiguous, of the call's dtype (out too). causal masks
/// key j > query i. A row whose every key is masked gives NaN, as the math path does. A
/// fusion only some backends offer (Note [Fused ops a backend may offer]); float32
/// accumulation whatever the dtype.
struct AttentionForwardArgs {
  AttentionShape s;
  const void* q;
  const void* k;
  const void* v;
  AttentionMask mask;
  bool causal;
  float scale;
  AttentionDropout dropout;
  void* out;
  float* lse;
};
/// gq, gk, gv (overwritten; laid out as q, k, v) from gout (laid out as out) and the
/// forward's out and lse, with the forward's arguments (its dropout's too).
struct AttentionBackwardArgs {
  AttentionShape s;
  const void* q;
  const void* k;
  const void* v;
  AttentionMask mask;
  bool causal;
  float scale;
  AttentionDropout dropout;
  const void* out;
  const float* lse;
  const void* gout;
  void* gq;
  void* gk;
  void* gv;
};

/// y = gelu(x) over n elements, GPT-2's tanh approximation or exact; y may alias x.
/// Note [Fused GELU] in functors.h.
struct GeluArgs {
  const void* x;
  void* y;
  std::int64_t n;
  bool tanh;
};
/// gx = gy · gelu'(x) over n elements (gx may alias gy).
struct GeluBackwardArgs {
  const void* x;
  const void* gy;
  void* gx;
  std::int64_t n;
  bool tanh;
};

/// y = (x - mean) · rstd · w + b over each of `rows` rows of `cols` elements, float32
/// (Note [Fused LayerNorm] in cpu_nn.cpp; CUDA: Note [Fused LayerNorm on CUDA] in
/// cuda_nn.cu): mean and the biased variance per row, rstd =
/// 1 / sqrt(var + eps); mean and rstd are written for the backward. w and b may be null
/// (1 and 0).
struct LayerNormArgs {
  const void* x;
  const void* w;
  const void* b;
  void* y;
  float* mean;
  float* rstd;
  std::int64_t rows, cols;
  float eps;
};
/// gx (overwritten) from gy, x, w and the forward's mean and rstd; gw = Σ_rows gy · x̂ and
/// gb = Σ_rows gy (overwritten; either may be null), summed in an order fixed by the
/// shape alone.
struct LayerNormBackwardArgs {
  const void* x;
  const void* w;
  const float* mean;
  const float* rstd;
  const void* gy;
  void* gx;
  float* gw;
  float* gb;
  std::int64_t rows, cols;
};

/// Average over the window counting padding (PyTorch's count_include_pad=true).
struct AvgPool2dArgs {
  Pool2dShape s;
  const void* x;
  void* y;
};
struct AvgPool2dBackwardArgs {
  Pool2dShape s;
  const void* gy;
  void* gx;
};

// ---- batch norm over (N, C, HW) --------------------------------------------------------------

/// The op's dtype is that of x and y (gy and gx in the backward): float32, bfloat16 or
/// float16; gamma, beta, the running and the saved statistics are float32 whatever it is
/// (Note [Batch norm in 16 bits] in cpu/cpu_nn.cpp).
/// Training: batch statistics; save_mean/save_invstd (C each) for backward; running stats
/// updated as PyTorch does (unbiased variance, running = (1-m)*running + m*batch) when
/// running_mean is not null. x, y, gy and gx are (N, C, HW), laid out N x HW x C when
/// channels_last (Note [Channels-last tensors]; as_nchw_rows gives kernels without a
/// path of their own the same bytes as (N·HW, C, 1)).
struct BatchNormTrainArgs {
  std::int64_t N;
  std::int64_t C;
  std::int64_t HW;
  const void* x;
  const void* gamma;
  const void* beta;
  float eps;
  float momentum;
  void* running_mean;
  void* running_var;
  void* y;
  void* save_mean;
  void* save_invstd;
  bool channels_last = false;
};
struct BatchNormEvalArgs {
  std::int64_t N;
  std::int64_t C;
  std::int64_t HW;
  const void* x;
  const void* gamma;
  const void* beta;
  float eps;
  const void* running_mean;
  const void* running_var;
  void* y;
  bool channels_last = false;
};
/// gx, ggamma, gbeta (overwrite) from gy and the saved statistics.
struct BatchNormBackwardArgs {
  std::int64_t N;
  std::int64_t C;
  std::int64_t HW;
  const void* gy;
  const void* x;
  const void* gamma;
  const void* save_mean;
  const void* save_invstd;
  void* gx;
  void* ggamma;
  void* gbeta;
  bool channels_last = false;
};
/// A channels-last batch norm's arguments as an NCHW kernel reads the same bytes: N·HW
/// images of C channels of one value each, the statistics over the same N·HW values per
/// channel. For backends with no channels-last kernel of their own.
template <typename Args>
Args as_nchw_rows(Args a) {
  if (a.channels_last) {
    a.N *= a.HW;
    a.HW = 1;
    a.channels_last = false;
  }
  return a;
}

// ---- fused optimizer updates over a flat buffer of n elements ------------------------------

/// PyTorch's SGD: g = grad + wd * p; buf = first ? g : momentum * buf + (1 - dampening) *
/// g; g = nesterov ? g + momentum * buf : buf (when momentum != 0); p -= lr * g.
/// momentum_buf may be null when momentum == 0.
struct SgdStepArgs {
  void* param;
  const void* grad;
  void* momentum_buf;
  std::int64_t n;
  double lr;  // the optimizer's options as given (Note [Optimizer scalars in double] in functors.h)
  double momentum;
  double dampening;
  double weight_decay;
  bool nesterov;
  bool first_step;
};
/// PyTorch's Adam (decoupled = false: g += wd * p) and AdamW (decoupled = true: p *= 1 -
/// lr * wd), with bias correction for `step` (1-based).
struct AdamStepArgs {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  std::int64_t n;
  double lr;  // the optimizer's options as given (Note [Optimizer scalars in double] in functors.h)
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  bool decoupled;
  std::int64_t step;
};

// Note [Op list order]
// Grouped as the op table's cases are; the order is the Op enum's, so appending keeps
// existing values.
//   X(Enum name, "name in messages", argument struct)
#define DP_BACKEND_OPS(X)                                     \
  X(Fill, "fill", FillArgs)                                   \
  X(AddScalar, "add_scalar", AddScalarArgs)                   \
  X(Arange, "arange", ArangeArgs)                             \
  X(Cast, "cast", CastArgs)                                   \
  X(Unary, "unary", UnaryArgs)                                \
  X(Affine, "affine", AffineArgs)                             \
  X(Axpy, "axpy", AxpyArgs)                                   \
  X(Binary, "binary", BinaryArgs)                             \
  X(Where, "where", WhereArgs)                                \
  X(StridedCopy, "strided_copy", StridedCopyArgs)             \
  X(Gather, "gather", GatherArgs)                             \
  X(ScatterAdd, "scatter_add", ScatterAddArgs)                \
  X(Reduce, "reduce", ReduceArgs)                             \
  X(Argmax, "argmax", ArgmaxArgs)                             \
  X(CountNonfinite, "count_nonfinite", CountNonfiniteArgs)                  \
  X(ScaleFindNonfinite, "scale_find_nonfinite", ScaleFindNonfiniteArgs)    \
  X(FillUniform, "fill_uniform", FillUniformArgs)                          \
  X(FillNormal, "fill_normal", FillNormalArgs)                             \
  X(Dropout, "dropout", DropoutArgs)                                       \
  X(Gemm, "gemm", GemmArgs)                                                \
  X(LogSoftmax, "log_softmax", LogSoftmaxArgs)                             \
  X(LogSoftmaxBackward, "log_softmax_backward", LogSoftmaxBackwardArgs)    \
  X(NllForward, "nll_forward", NllForwardArgs)                             \
  X(NllBackward, "nll_backward", NllBackwardArgs)                          \
  X(Conv2d, "conv2d", Conv2dArgs)                                          \
  X(Conv2dBackwardData, "conv2d_backward_data", Conv2dBackwardDataArgs)    \
  X(Conv2dBackwardWeight, "conv2d_backward_weight", Conv2dBackwardWeightArgs) \
  X(Conv2dBackward, "conv2d_backward", Conv2dBackwardArgs)                \
  X(MaxPool2d, "maxpool2d_forward", MaxPool2dArgs)                         \
  X(MaxPool2dBackward, "maxpool2d_backward", MaxPool2dBackwardArgs)        \
  X(AvgPool2d, "avgpool2d_forward", AvgPool2dArgs)                         \
  X(AvgPool2dBackward, "avgpool2d_backward", AvgPool2dBackwardArgs)        \
  X(BatchNormTrain, "batchnorm_forward_train", BatchNormTrainArgs)         \
  X(BatchNormEval, "batchnorm_forward_eval", BatchNormEvalArgs)            \
  X(BatchNormBackward, "batchnorm_backward", BatchNormBackwardArgs)        \
  X(SgdStep, "sgd_step", SgdStepArgs)                                      \
  X(AdamStep, "adam_step", AdamStepArgs)                                   \
  X(AttentionForward, "attention_forward", AttentionForwardArgs)           \
  X(AttentionBackward, "attention_backward", AttentionBackwardArgs)       \
  X(Gelu, "gelu", GeluArgs)                                                \
  X(GeluBackward, "gelu_backward", GeluBackwardArgs)                      \
  X(LayerNorm, "layer_norm", LayerNormArgs)                                \
  X(LayerNormBackward, "layer_norm_backward", LayerNormBackwardArgs)

/// The ops of DP_BACKEND_OPS.
enum class Op : std::uint8_t {
#define DP_OP_ENUM(name, str, Args) name,
  DP_BACKEND_OPS(DP_OP_ENUM)
#undef DP_OP_ENUM
  kCount  // Note [Op enum sentinels]
};
inline constexpr int kOpCount = static_cast<int>(Op::kCount);

/// "unary", "conv2d", ...
const char* op_name(Op op);

/// The argument struct of an op: OpArgs<Op::Unary> is UnaryArgs.
template <Op op>
struct OpTraits;
#define DP_OP_TRAITS(name, str, ArgsT)           \
  template <>                                    \
  struct OpTraits<Op::name> {                    \
    using Args = ArgsT;                          \
    static constexpr const char* kName = str;    \
  };
DP_BACKEND_OPS(DP_OP_TRAITS)
#undef DP_OP_TRAITS
template <Op op>
using OpArgs = typename OpTraits<op>::Args;

}  // namespace dp::backend
