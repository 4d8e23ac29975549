// dp/nn/functional.h — differentiable neural-network ops: convolution, pooling, batch
// norm, dropout, softmax and losses.
//
// Each op checks devices, dtypes and shapes first (dp::Error saying what was expected
// and what came), runs one backend kernel on the inputs' device and, when grad mode is
// on and an input needs a gradient, records its backward. Stateless: the layers in
// dp/nn/*.h hold the parameters and call these. This header knows nothing of modules,
// parameter sets, optimizers or DataParallel. Elementwise and linear algebra ops
// (relu, add, linear, ...) live in dp/tensor/ops.h.
//
//   dp::Tensor y = dp::nn::conv2d(x, w, b, /*stride=*/1, /*padding=*/1);   // (N, K, H, W)
//   dp::Tensor loss = dp::nn::cross_entropy(logits, labels);              // mean over N
//   dp::Tensor part = dp::nn::cross_entropy(logits, labels, dp::nn::Reduction::Sum, 1.0 / 256);
//   dp::Tensor ls = dp::nn::cross_entropy(logits, labels, {.weight = w, .label_smoothing = 0.1});
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "dp/tensor/tensor.h"

namespace dp::nn {

/// How a loss combines its per-sample values.
enum class Reduction : std::uint8_t {
  Mean,  ///< sum / number of samples (PyTorch's default)
  Sum,   ///< sum over samples — with `scale`, a DataParallel shard's share of a mean
  None,  ///< the per-sample losses, shape (N) (or the input's shape for elementwise losses)
};

// ---- convolution and pooling (NCHW) ----------------------------------------------------

/// 2-d convolution (groups = 1, dilation = 1) with the same stride and zero padding in
/// both dims. x: (N, C, H, W); w: (K, C, R, S); b: (K) or undefined (no bias).
/// Returns (N, K, P, Q) with P = (H + 2·padding − R) / stride + 1 (floor).
Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& b = Tensor(),
              std::int64_t stride = 1, std::int64_t padding = 0);

/// relu(conv2d(x, w, b, stride, padding)) as one op: bit for bit the two ops' output
/// and gradients, without the ReLU's separate pass and activation where the backend
/// fuses them (CPU: Note [Convolution + ReLU]). nn::Sequential uses it for a Conv2d
/// followed by a ReLU.
Tensor conv2d_relu(const Tensor& x, const Tensor& w, const Tensor& b = Tensor(),
                   std::int64_t stride = 1, std::int64_t padding = 0);

/// max_pool2d(conv2d_relu(x, w, b, stride, padding), pool_kernel, pool_stride,
/// pool_padding), bit for bit, with the ReLU's backward mask applied to the pooled
/// gradient (Note [ReLU mask through max-pool] in src/nn/functional.cpp).
/// nn::Sequential uses it for Conv2d, ReLU, MaxPool2d.
Tensor conv2d_relu_max_pool2d(const Tensor& x, const Tensor& w, const Tensor& b, std::int64_t stride,
                              std::int64_t padding, std::int64_t pool_kernel, std::int64_t pool_stride = 0,
                              std::int64_t pool_padding = 0);

/// Max pooling over kernel×kernel windows. stride ≤ 0 means stride = kernel (PyTorch's
/// default); padding ≤ kernel / 2 and never wins. x: (N, C, H, W). Gradient flows to
/// the first maximum of each window.
Tensor max_pool2d(const Tensor& x, std::int64_t kernel, std::int64_t stride = 0,
                  std::int64_t padding = 0);

/// Average pooling over kernel×kernel windows, counting padding
/// (count_include_pad = true). stride ≤ 0 means stride = kernel. x: (N, C, H, W).
Tensor avg_pool2d(const Tensor& x, std::int64_t kernel, std::int64_t stride = 0,
                  std::int64_t padding = 0);

/// Mean over H and W: (N, C, H, W) → (N, C, 1, 1) (adaptive average pooling to 1×1).
Tensor adaptive_avg_pool2d_1x1(const Tensor& x);

/// Adaptive average pooling to any output size, PyTorch's F.adaptive_avg_pool2d:
/// output cell (i, j) is the mean of rows [floor(i·H/P), ceil((i+1)·H/P)) and columns
/// [floor(j·W/Q), ceil((j+1)·W/Q)) of its plane — bins may differ in size and overlap,
/// and P > H (or Q > W) repeats input cells. x: (N, C, H, W) float32 with H, W ≥ 1;
/// returns (N, C, P, Q), P, Q ≥ 1. See Note [Adaptive pooling] for how it runs.
///
///   dp::Tensor y = dp::nn::adaptive_avg_pool2d(x, 3, 2);   // (N, C, 7, 5) → (N, C, 3, 2)
Tensor adaptive_avg_pool2d(const Tensor& x, std::int64_t output_h, std::int64_t output_w);

// ---- normalisation and regularisation ----------------------------------------------------

/// Batch normalisation over (N, C, H, W) or (N, C), per channel C.
/// training: normalises with the batch statistics and, when running_mean/running_var are
///   defined, updates them in place as PyTorch does:
///   running = (1 − momentum) · running + momentum · batch, with the unbiased batch
///   variance. Needs more than one value per channel.
/// eval: normalises with running_mean / running_var (both required).
/// gamma (C) and beta (C) may be undefined (scale 1, shift 0). The running statistics
/// are never differentiated. A bfloat16 or float16 x (with float32 parameters and
/// statistics, as under autocast) is normalised in float32 and its output rounded once
/// to x's dtype (Note [Autocast op policy]).
Tensor batch_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                  const Tensor& running_mean, const Tensor& running_var, bool training,
                  double momentum = 0.1, double eps = 1e-5);

/// Inverted dropout: while training, zeroes each element with probability p and scales
/// the others by 1 / (1 − p); the mask comes from `gen` (same seed and offset → same
/// mask on every backend). Identity when !training or p == 0; zeros when p == 1.
Tensor dropout(const Tensor& x, double p, bool training, Generator& gen);

// ---- softmax and losses -------------------------------------------------------------------

/// log(softmax(x)) over dim 1 of x: (B, C), computed stably (max subtracted).
Tensor log_softmax(const Tensor& x);

/// log(softmax(x)) along `dim` (negative counts from the end), any number of dims.
Tensor log_softmax(const Tensor& x, std::int64_t dim);
/// softmax along `dim` (torch.softmax): exp(x - max) / sum, computed stably.
/// Differentiable.
Tensor softmax(const Tensor& x, std::int64_t dim);

// ---- transformer ops ---------------------------------------------------------------------

/// torch.nn.functional.gelu: x * Phi(x), Phi the standard normal CDF — exactly
/// 0.5 x (1 + erf(x / sqrt 2)) (approximate = "none"), or with the tanh approximation
/// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (approximate = "tanh"). Differentiable.
Tensor gelu(const Tensor& input, const std::string& approximate = "none");

/// torch.nn.functional.logsigmoid: log σ(x) = min(x, 0) − log1p(exp(−|x|)), elementwise,
/// finite for every finite x (log σ(30) = −9.4e-14, not 0). Differentiable: the gradient
/// σ(−x) as PyTorch computes it, z / (1 + z) for x >= 0 and 1 − z / (1 + z) below, with
/// z = exp(−|x|). 16-bit inputs compute in float32 and round once.
Tensor logsigmoid(const Tensor& input);

/// torch.nn.functional.layer_norm: normalises over the trailing dims `normalized_shape`
/// of `input` (mean and biased variance per row, in float), then scales by `weight` and
/// shifts by `bias` (each of shape normalized_shape; undefined: none). Differentiable.
///   dp::Tensor h = dp::nn::layer_norm(x, {C}, ln_w, ln_b);   // x: (B, T, C)
Tensor layer_norm(const Tensor& input, const Shape& normalized_shape, const Tensor& weight = Tensor(),
                  const Tensor& bias = Tensor(), double eps = 1e-5);

/// torch.nn.functional.embedding: the rows `input` (int64 or int32 ids of any shape, each
/// in [0, V)) of `weight` (V, D): (input..., D). The gradient adds each position's row
/// gradient into weight's row (index_add: in position order on the CPU, bitwise
/// reproducible); the row padding_idx (negative: counted from the end) gets no
/// gradient, as PyTorch's. An id outside [0, V) is a dp::Error naming it where the ids
/// are in host memory (CPU devices); ids on a GPU are checked there without a wait, and
/// a bad one makes its output row NaN (where PyTorch's CUDA kernel stops the process with
/// a device-side assert).
Tensor embedding(const Tensor& input, const Tensor& weight, std::optional<std::int64_t> padding_idx = std::nullopt);

/// torch.nn.functional.scaled_dot_product_attention, in PyTorch's argument order:
/// softmax(q kᵀ · scale + mask) v over q (B..., L, E), k (B..., S, E), v (B..., S, Ev)
/// -> (B..., L, Ev); batch dims broadcast as in matmul. scale defaults to 1/sqrt(E).
/// attn_mask (broadcastable to (B..., L, S); float32 or q's dtype) is either additive
/// (added to the scores, -inf masks) or a 0/1 keep-mask as dp's comparisons make (pass
/// mask_is_keep = true: nonzero attends, 0 is masked — PyTorch's boolean mask). is_causal
/// masks every key after its query (position j > i), as PyTorch's top-left causal mask;
/// it and attn_mask are exclusive, as in PyTorch. dropout_p drops attention weights
/// (use 0 in evaluation) with `gen`. A row whose every key is masked weighs every
/// value 0: an output row of zeros and no gradient through it, as PyTorch 2.5+ on
/// every backend (softmax itself would give NaN; Note [Rows with every key masked] in
/// src/nn/functional_sequence.cpp). This is the math path: it holds the (L, S) weights
/// of every head, O(L·S) memory. Where the device's backend has a fused kernel and the
/// call fits it (Note [Fused attention paths] in src/nn/fused_attention.cpp: q, k, v of
/// one dtype — float32, bfloat16 or float16 on the CPU and on CUDA (head dims up to 128
/// there) — 3-d or 4-d with equal batch dims, dropout_p < 1), that kernel runs instead:
/// O(L) memory per (batch, head), the same values to rounding (float32 inside whatever
/// the dtype), the same weights dropped and `gen` advanced alike.
/// Differentiable in q, k, v.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& attn_mask = Tensor(), double dropout_p = 0.0,
                                    bool is_causal = false, std::optional<double> scale = std::nullopt,
                                    bool mask_is_keep = false, Generator* gen = nullptr);

/// Which implementation scaled_dot_product_attention runs, process-wide (tests and
/// benchmarks compare them): Auto the fused kernel where it fits the call and the math
/// path otherwise; Math always the math path; Fused the fused kernel, or a dp::Error
/// saying why the call does not fit it.
///   dp::nn::set_attention_path(dp::nn::AttentionPath::Math);  // the O(L·S) reference
enum class AttentionPath : std::uint8_t { Auto, Math, Fused };
void set_attention_path(AttentionPath path);
AttentionPath attention_path();

// Note [Class-index losses]
// nll_loss and cross_entropy follow PyTorch 1.13's F.nll_loss / F.cross_entropy. Row r
// with target t = target[r] has the weight w_r = weight[t] (1 without `weight`), or 0
// when t == ignore_index, and the loss
//   −w_r·logp[r, t]                                                       (nll_loss)
//   (1 − ε)·(−w_r·logp[r, t]) + ε/C·(−Σ_c weight[c]·logp[r, c])   (cross_entropy,
//                                    label_smoothing ε; the second term 0 on ignored rows)
// with logp = log_softmax(logits) for cross_entropy. Mean divides the sum by Σ_r w_r,
// the summed weight of the rows not ignored (NaN when every row is ignored, as in
// PyTorch); None gives every row's loss, 0 for ignored rows. Targets (int64, or int32
// with the same results) must be in [0, C) or equal ignore_index: on the CPU anything
// else throws dp::Error naming the row before any work; on CUDA, which cannot throw
// without a host synchronisation, it makes that row's loss NaN. `weight` is a constant: it gets no gradient.
// A weighted or ignoring mean divides by a sum over the whole batch: a DataParallel
// forward_backward given a plain function weighs each shard's mean by its share of the
// rows, which is the global value only without weights and ignored rows; given a loss
// descriptor (dp::nn::CrossEntropyLoss, NLLLoss in dp/nn/loss.h) it divides every
// shard's sum by the whole batch's Σ_r w_r and is exact (Note [Exact shard losses]).

/// Options of nll_loss (PyTorch's F.nll_loss keywords) and the `scale` of dp's shards.
struct NLLLossOptions {
  /// (C) float32 on the input's device: a weight per class; undefined = all 1.
  Tensor weight{};
  /// Rows whose target equals it contribute 0 and do not count in the mean.
  std::int64_t ignore_index = -100;
  Reduction reduction = Reduction::Mean;
  /// Multiplies the reduced loss (DataParallel's shards: Sum with 1 / global batch).
  double scale = 1.0;
};

/// Options of cross_entropy (PyTorch's F.cross_entropy keywords).
struct CrossEntropyOptions {
  /// (C) float32 on the input's device: a weight per class; undefined = all 1.
  Tensor weight{};
  /// Rows whose target equals it contribute 0 and do not count in the mean.
  std::int64_t ignore_index = -100;
  Reduction reduction = Reduction::Mean;
  /// ε in [0, 1]: the target distribution is (1 − ε)·onehot + ε / C.
  double label_smoothing = 0.0;
  /// Multiplies the reduced loss (DataParallel's shards: Sum with 1 / global batch).
  double scale = 1.0;
};

/// Negative log-likelihood of log-probabilities, with PyTorch's options (Note
/// [Class-index losses]). logp: (B, C) float32; target: (B) int64 or int32.
Tensor nll_loss(const Tensor& logp, const Tensor& target, const NLLLossOptions& options);
/// nll_loss without class weights: loss[i] = −logp[i, target[i]] (0 where target[i] ==
/// −100, PyTorch's default ignore_index), reduced, times `scale`.
Tensor nll_loss(const Tensor& logp, const Tensor& target, Reduction reduction = Reduction::Mean,
                double scale = 1.0);

/// Cross entropy of raw scores, with PyTorch's options: class weights, ignore_index,
/// label smoothing (Note [Class-index losses]). logits: (B, C) float32; target: (B)
/// int64 or int32. Stable for large logits.
Tensor cross_entropy(const Tensor& logits, const Tensor& target, const CrossEntropyOptions& options);
/// Cross entropy of raw scores: nll_loss(log_softmax(logits), target, reduction, scale).
/// Mean over the batch by default (over the rows not ignored: target −100, PyTorch's
/// default ignore_index, contributes nothing). DataParallel's workers use
/// Reduction::Sum with scale = 1 / global_batch so that shard losses add up to the mean.
Tensor cross_entropy(const Tensor& logits, const Tensor& target,
                     Reduction reduction = Reduction::Mean, double scale = 1.0);

/// Options of binary_cross_entropy_with_logits (PyTorch's keywords).
struct BCEWithLogitsOptions {
  /// A weight per element, broadcast to the input's shape; undefined = 1.
  Tensor weight{};
  /// A weight of the positive term per class, broadcast along the last dim (C) of the
  /// input: > 1 raises recall; undefined = 1.
  Tensor pos_weight{};
  Reduction reduction = Reduction::Mean;
  double scale = 1.0;
};

/// Binary cross entropy of raw scores x against targets t in [0, 1] (same shape,
/// float32): −w·(p·t·log σ(x) + (1 − t)·log(1 − σ(x))) with p = pos_weight, computed
/// stably as PyTorch does. Mean is over every element. Differentiable in x and t;
/// weight and pos_weight get no gradient.
Tensor binary_cross_entropy_with_logits(const Tensor& input, const Tensor& target,
                                        const BCEWithLogitsOptions& options = {});

/// Squared error (a − b)², reduced, times `scale`. a and b: same shape, float32, one
/// device. Mean is over every element (PyTorch's default).
Tensor mse_loss(const Tensor& a, const Tensor& b, Reduction reduction = Reduction::Mean,
                double scale = 1.0);

/// Absolute error |a − b|, reduced, times `scale`; a and b as for mse_loss. The
/// gradient at a == b is 0 (PyTorch's sign(0)).
Tensor l1_loss(const Tensor& a, const Tensor& b, Reduction reduction = Reduction::Mean,
               double scale = 1.0);

/// Huber-like loss with PyTorch's beta: 0.5·z² / beta where z = |a − b| < beta, else
/// z − 0.5·beta; beta == 0 is l1_loss, with its gradient 0 at a == b (PyTorch 1.13 gives
/// −1 there; PyTorch 2 routes beta == 0 to l1_loss as dp does). a and b as for
/// mse_loss; beta >= 0.
Tensor smooth_l1_loss(const Tensor& a, const Tensor& b, Reduction reduction = Reduction::Mean,
                      double beta = 1.0, double scale = 1.0);

}  // namespace dp::nn
