// src/backend/cuda/cuda_kernels.h — host launchers of dp's own CUDA kernels.
//
// Each launcher computes its grid, enqueues on the explicit `stream` (the caller has
// already made the stream's device current), checks its preconditions and the launch.
// Pointers live on that device; counts are elements. Internal to backend/cuda.
//
//   cuda_kernels::unary<float>(stream, UnaryOp::Relu, x, y, n);
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "backend/backend.h"

namespace dp::backend {
class CudaBackend;
}  // namespace dp::backend

namespace dp::backend::cuda_kernels {

/// Put the ops of cuda_elementwise.cu, cuda_reduce.cu, cuda_nn.cu (the fused layer norm),
/// cuda_attention.cu and cuda_blas_dnn.cpp (the 16-bit GEMMs and convolutions) in the
/// backend's kernel table (Note [The op list] in ops.h); CudaBackend's constructor calls them.
void register_elementwise_kernels(CudaBackend& be);
void register_reduce_kernels(CudaBackend& be);
void register_nn_kernels(CudaBackend& be);
void register_attention_kernels(CudaBackend& be);
void register_blas_kernels(CudaBackend& be);

// ---- cuda_attention.cu ----------------------------------------------------------------
/// Why the fused attention kernels do not take shape s on physical GPU `gpu` (head dims
/// above 128, too little shared memory, too many blocks), or "" (Note [Fused attention
/// on CUDA]).
std::string attention_misfit(const AttentionShape& s, int gpu);

/// The inputs of sum_inputs: up to kMaxSumInputs device pointers to elements of one
/// dtype, passed by value as a kernel argument (64 pointers = 512 bytes, well inside the
/// 4 KiB parameter limit).
inline constexpr int kMaxSumInputs = 64;
struct SumInputs {
  const void* ptr[kMaxSumInputs];
  int count = 0;
};

// ---- cuda_elementwise.cu --------------------------------------------------------------
void fill(cudaStream_t stream, float* y, std::int64_t n, float value);
void fill_i64(cudaStream_t stream, std::int64_t* y, std::int64_t n, std::int64_t value);
/// y[i] = bits: a 16-bit float's value as the host rounded it (dp/core/half.h).
void fill_16bit(cudaStream_t stream, std::uint16_t* y, std::int64_t n, std::uint16_t bits);
void add_i64(cudaStream_t stream, std::int64_t* y, std::int64_t n, std::int64_t value);
void arange(cudaStream_t stream, float* y, std::int64_t n, float start, float step);
void arange_i64(cudaStream_t stream, std::int64_t* y, std::int64_t n, std::int64_t start,
                std::int64_t step);
void eq_i64(cudaStream_t stream, const Indexer& ix, const std::int64_t* a, const std::int64_t* b, float* out);
/// y[i] = x[i] converted as the CPU backend converts (CastArgs in ops.h), between device
/// storage types (float, int64, int32, __nv_bfloat16, __half: cuda_half.cuh).
template <typename Src, typename Dst>
void cast(cudaStream_t stream, const Src* x, Dst* y, std::int64_t n);
/// Over float and std::uint16_t (the bits of either 16-bit dtype).
template <typename T>
void gather(cudaStream_t stream, const Indexer& ix, int dim, const T* x, const std::int64_t* index, T* out);
/// Over float, __nv_bfloat16 and __half; atomics (Note [16-bit atomic adds]).
template <typename T>
void scatter_add(cudaStream_t stream, const Indexer& ix, int dim, const T* src, const std::int64_t* index,
                 T* y);
/// Over storage type T, the math in float (Note [Storage types] in functors.h);
/// instantiated in cuda_elementwise.cu for the dtypes the kernel table registers.
template <typename T>
void unary(cudaStream_t stream, UnaryOp op, const T* x, T* y, std::int64_t n);
template <typename T>
void affine(cudaStream_t stream, const T* x, T* y, std::int64_t n, float alpha, float beta);
template <typename T>
void axpy(cudaStream_t stream, float alpha, const T* x, T* y, std::int64_t n);
template <typename T>
void binary(cudaStream_t stream, BinaryOp op, const Indexer& ix, const T* a, const T* b, T* out);
/// Over float and std::uint16_t (the bits of either 16-bit dtype).
template <typename T>
void strided_copy(cudaStream_t stream, const Indexer& ix, const T* a, T* out);
void fill_uniform(cudaStream_t stream, float* y, std::int64_t n, float lo, float hi,
                  std::uint64_t seed, std::uint64_t offset);
void fill_normal(cudaStream_t stream, float* y, std::int64_t n, float mean, float std,
                 std::uint64_t seed, std::uint64_t offset);
void dropout(cudaStream_t stream, const float* x, float* y, float* mask, std::int64_t n,
             float p, std::uint64_t seed, std::uint64_t offset);
/// Adds the number of non-finite x[i] to *count (a device counter the caller zeroed).
void count_nonfinite(cudaStream_t stream, const float* x, std::int64_t n,
                     unsigned long long* count);
/// x[i] = scale * x[i] + 0 in place (the affine kernel's bits), and *found = 1 (a device
/// flag) when some x[i] was non-finite before; never clears *found. No host sync.
void scale_find_nonfinite(cudaStream_t stream, float* x, std::int64_t n, float scale, float* found);
void sgd_step(cudaStream_t stream, float* param, const float* grad, float* momentum_buf,
              std::int64_t n, double lr, double momentum, double dampening, double weight_decay,
              bool nesterov, bool first_step);
void adam_step(cudaStream_t stream, float* param, const float* grad, float* exp_avg,
               float* exp_avg_sq, std::int64_t n, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool decoupled, std::int64_t step);

// ---- cuda_reduce.cu -----------------------------------------------------------------
/// Scratch floats reduce() needs for (outer, r, inner): outer * S when a row reduction
/// is split over S > 1 blocks per row (Note [Split reductions]), else 0.
std::int64_t reduce_scratch(std::int64_t outer, std::int64_t r, std::int64_t inner);
void reduce(cudaStream_t stream, ReduceOp op, const float* x, float* y, std::int64_t outer,
            std::int64_t r, std::int64_t inner, float* scratch);
/// dst[i] = ((in[0][i] + in[1][i]) + ...) + in[count-1][i], then * inv when `average`,
/// for i < n elements of `dtype` (float32, bfloat16 or float16; 16-bit inputs widened,
/// the sum formed in float and rounded once): the fixed order of the local communicator
/// (Note [Fixed summation order]), bitwise the same as its CPU loop. dst may be one of
/// the inputs (each element is read before it is written); the inputs may live on other
/// GPUs with peer access enabled.
void sum_inputs(cudaStream_t stream, const SumInputs& in, void* dst, std::int64_t n, bool average, float inv,
                DType dtype);
void argmax(cudaStream_t stream, const float* x, std::int64_t* y, std::int64_t outer,
            std::int64_t r, std::int64_t inner);

// ---- cuda_nn.cu -----------------------------------------------------------------------
void log_softmax(cudaStream_t stream, const float* x, float* y, std::int64_t rows,
                 std::int64_t cols);
void log_softmax_backward(cudaStream_t stream, const float* gy, const float* y, float* gx,
                          std::int64_t rows, std::int64_t cols);
void nll_forward(cudaStream_t stream, const float* logp, const std::int64_t* target,
                 float* loss, std::int64_t rows, std::int64_t cols, std::int64_t ignore_index);
void nll_backward(cudaStream_t stream, const float* gloss, const std::int64_t* target,
                  float* gx, std::int64_t rows, std::int64_t cols, std::int64_t ignore_index);
void maxpool2d_forward(cudaStream_t stream, const Pool2dShape& s, const float* x, float* y,
                       std::int64_t* indices);
void maxpool2d_backward(cudaStream_t stream, const Pool2dShape& s, const float* gy,
                        const std::int64_t* indices, float* gx);
void avgpool2d_forward(cudaStream_t stream, const Pool2dShape& s, const float* x, float* y);
void avgpool2d_backward(cudaStream_t stream, const Pool2dShape& s, const float* gy, float* gx);
/// save_mean and save_invstd are required (C floats each). x and y hold `dtype` (float32,
/// bfloat16 or float16: Note [Batch norm in 16 bits] in cpu_nn.cpp); every other pointer
/// float32.
void batchnorm_forward_train(cudaStream_t stream, std::int64_t N, std::int64_t C,
                             std::int64_t HW, const void* x, const float* gamma,
                             const float* beta, float eps, float momentum, float* running_mean,
                             float* running_var, void* y, float* save_mean,
                             float* save_invstd, float* scratch, DType dtype);
/// Scratch floats batchnorm_forward_train needs for (N, C, HW): 2 * C * S when the
/// statistics are split over S > 1 blocks per channel, else 0 (scratch may be null).
std::int64_t batchnorm_forward_scratch(std::int64_t N, std::int64_t C, std::int64_t HW);
void batchnorm_forward_eval(cudaStream_t stream, std::int64_t N, std::int64_t C,
                            std::int64_t HW, const void* x, const float* gamma,
                            const float* beta, float eps, const float* running_mean,
                            const float* running_var, void* y, DType dtype);
/// gy, x and gx hold `dtype`, as x and y above.
void batchnorm_backward(cudaStream_t stream, std::int64_t N, std::int64_t C, std::int64_t HW,
                        const void* gy, const void* x, const float* gamma,
                        const float* save_mean, const float* save_invstd, void* gx,
                        float* ggamma, float* gbeta, float* scratch, DType dtype);
/// Scratch floats batchnorm_backward needs: 2 * C (the sums) + 2 * C * S when split.
std::int64_t batchnorm_backward_scratch(std::int64_t N, std::int64_t C, std::int64_t HW);
/// Op::BatchNormTrain, Op::BatchNormEval and Op::BatchNormBackward over `dtype` (the
/// Args in ops.h), their scratch from be's allocator: the float32 method kernels and the
/// 16-bit table entries both run these.
void batch_norm_train(CudaBackend& be, Device dev, const BatchNormTrainArgs& a, DType dtype);
void batch_norm_eval(CudaBackend& be, Device dev, const BatchNormEvalArgs& a, DType dtype);
void batch_norm_backward(CudaBackend& be, Device dev, const BatchNormBackwardArgs& a, DType dtype);
/// out[c] = sum of x[n, c, k] over n < N, k < HW (x: (N, C, HW)): a convolution's bias
/// gradient (Note [Convolution bias gradient]). x and out hold `dtype` (float32, bfloat16
/// or float16: 16-bit values widened, summed in float in float32's order, each sum rounded
/// once). `scratch`: channel_sums_scratch floats.
void channel_sums(cudaStream_t stream, std::int64_t N, std::int64_t C, std::int64_t HW, const void* x, void* out,
                  float* scratch, DType dtype);
std::int64_t channel_sums_scratch(std::int64_t N, std::int64_t C, std::int64_t HW);
/// y[n, c, k] = bias[c] over y: (N, C, HW), both of `dtype` (float32, bfloat16 or
/// float16; the bits as they are): a 16-bit convolution's bias, which cuDNN then adds to
/// its sums before it rounds (Note [16-bit convolutions on CUDA], cuda_blas_dnn.cpp).
void channel_fill(cudaStream_t stream, std::int64_t N, std::int64_t C, std::int64_t HW, const void* bias, void* y,
                  DType dtype);
/// y[n, c, k] = y[n, c, k] + bias[c], then relu when `relu` (bias may be null: the ReLU
/// alone), in place over y: (N, C, HW) — a convolution's bias and ReLU in one pass
/// (Note [Per-channel maps]).
void bias_relu(cudaStream_t stream, std::int64_t N, std::int64_t C, std::int64_t HW, const float* bias, bool relu,
               float* y);
// (batchnorm_backward: `scratch` holds 2 * C floats valid until the enqueued work ends.)
/// Op::LayerNorm in float32 (LayerNormArgs in ops.h, Note [Fused LayerNorm on CUDA]):
/// y, mean and rstd of `rows` rows of `cols`; w and b may be null. rows = 0 does nothing.
void layer_norm(cudaStream_t stream, const float* x, const float* w, const float* b, float* y, float* mean,
                float* rstd, std::int64_t rows, std::int64_t cols, float eps);
/// Scratch floats layer_norm_backward needs: the tiles' partial sums of gw and gb when
/// `params` (either is wanted), else 0.
std::int64_t layer_norm_backward_scratch(std::int64_t rows, std::int64_t cols, bool params);
/// Op::LayerNormBackward in float32 (LayerNormBackwardArgs): gx, and gw and gb (either
/// may be null; overwritten, in an order fixed by the shape). `scratch`: the floats
/// layer_norm_backward_scratch says, valid until the enqueued work ends.
void layer_norm_backward(cudaStream_t stream, const float* x, const float* w, const float* mean,
                         const float* rstd, const float* gy, float* gx, float* gw, float* gb, std::int64_t rows,
                         std::int64_t cols, float* scratch);

}  // namespace dp::backend::cuda_kernels
