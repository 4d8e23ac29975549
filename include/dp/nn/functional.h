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
#pragma once

#include <cstdint>

#include "dp/tensor/tensor.h"

namespace dp::nn {

/// How a loss combines its per-sample values.
enum class Reduction : std::uint8_t {
  Mean,  ///< sum / number of samples (PyTorch's default)
  Sum,   ///< sum over samples — with `scale`, a DataParallel shard's share of a mean
  None,  ///< the per-sample losses, shape (N) (or the input's shape for mse_loss)
};

// ---- convolution and pooling (NCHW) ----------------------------------------------------

/// 2-d convolution (groups = 1, dilation = 1) with the same stride and zero padding in
/// both dims. x: (N, C, H, W); w: (K, C, R, S); b: (K) or undefined (no bias).
/// Returns (N, K, P, Q) with P = (H + 2·padding − R) / stride + 1 (floor).
Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& b = Tensor(),
              std::int64_t stride = 1, std::int64_t padding = 0);

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

// ---- normalisation and regularisation ----------------------------------------------------

/// Batch normalisation over (N, C, H, W) or (N, C), per channel C.
/// training: normalises with the batch statistics and, when running_mean/running_var are
///   defined, updates them in place as PyTorch does:
///   running = (1 − momentum) · running + momentum · batch, with the unbiased batch
///   variance. Needs more than one value per channel.
/// eval: normalises with running_mean / running_var (both required).
/// gamma (C) and beta (C) may be undefined (scale 1, shift 0). The running statistics
/// are never differentiated.
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

/// Negative log-likelihood: loss[i] = −logp[i, target[i]], reduced, times `scale`.
/// logp: (B, C) float32; target: (B) int64 in [0, C) (out of range → dp::Error on CPU;
/// NaN loss on CUDA, which checks without a host synchronisation).
Tensor nll_loss(const Tensor& logp, const Tensor& target, Reduction reduction = Reduction::Mean,
                double scale = 1.0);

/// Cross entropy of raw scores: nll_loss(log_softmax(logits), target, reduction, scale).
/// Mean over the batch by default. Stable for large logits. DataParallel's workers use
/// Reduction::Sum with scale = 1 / global_batch so that shard losses add up to the mean.
Tensor cross_entropy(const Tensor& logits, const Tensor& target,
                     Reduction reduction = Reduction::Mean, double scale = 1.0);

/// Squared error (a − b)², reduced, times `scale`. a and b: same shape, float32, one
/// device. Mean is over every element (PyTorch's default).
Tensor mse_loss(const Tensor& a, const Tensor& b, Reduction reduction = Reduction::Mean,
                double scale = 1.0);

}  // namespace dp::nn
