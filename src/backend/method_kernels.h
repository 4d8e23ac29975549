// src/backend/method_kernels.h — float32 table kernels of a backend whose ops are member
// functions (internal to the backends).
//
// The CPU and CUDA backends implement the nn, random and optimizer ops as member
// functions over float pointers, one per op, with the same signatures on both. Each
// entry here unpacks an op's argument struct (ops.h) and calls the member, so a backend
// registers all of them in one loop:
//   for (const MethodKernel& k : method_kernels<CpuBackend>()) register_kernel(k.op, DType::F32, k.fn);
// A new op is written as a kernel over its argument struct instead (cpu_elementwise.cpp).
#pragma once

#include <array>

#include "backend/backend.h"

namespace dp::backend {

struct MethodKernel {
  Op op;
  Backend::KernelFn fn;
};

namespace method_detail {
inline float* f32(void* p) { return static_cast<float*>(p); }
inline const float* f32(const void* p) { return static_cast<const float*>(p); }

/// The kernel of op `op` calling F on the backend B with its unpacked arguments.
template <typename B, Op op, void (*F)(B&, Device, const OpArgs<op>&)>
MethodKernel entry() {
  return {op, [](Backend& be, Device dev, DType, const void* args) {
            F(static_cast<B&>(be), dev, *static_cast<const OpArgs<op>*>(args));
          }};
}

template <typename B>
struct Calls {
  static void fill_uniform(B& b, Device d, const FillUniformArgs& a) {
    b.fill_uniform(d, f32(a.y), a.n, a.lo, a.hi, a.seed, a.offset);
  }
  static void fill_normal(B& b, Device d, const FillNormalArgs& a) {
    b.fill_normal(d, f32(a.y), a.n, a.mean, a.std, a.seed, a.offset);
  }
  static void dropout(B& b, Device d, const DropoutArgs& a) {
    b.dropout(d, f32(a.x), f32(a.y), f32(a.mask), a.n, a.p, a.seed, a.offset);
  }
  static void log_softmax(B& b, Device d, const LogSoftmaxArgs& a) {
    b.log_softmax(d, f32(a.x), f32(a.y), a.rows, a.cols);
  }
  static void log_softmax_backward(B& b, Device d, const LogSoftmaxBackwardArgs& a) {
    b.log_softmax_backward(d, f32(a.gy), f32(a.y), f32(a.gx), a.rows, a.cols);
  }
  static void nll_forward(B& b, Device d, const NllForwardArgs& a) {
    b.nll_forward(d, f32(a.logp), a.target, f32(a.loss), a.rows, a.cols, a.ignore_index);
  }
  static void nll_backward(B& b, Device d, const NllBackwardArgs& a) {
    b.nll_backward(d, f32(a.gloss), a.target, f32(a.gx), a.rows, a.cols, a.ignore_index);
  }
  // A pool after the convolution and a ReLU mask before the pool's backward run as the
  // ops they fuse (Note [Fusions are the backend's]); the winners are int64 flat indices.
  static void conv2d(B& b, Device d, const Conv2dArgs& a) {
    if (a.pool.on)
      b.conv2d_pool_by_ops(d, DType::F32, a);
    else if (a.relu)
      b.conv2d_relu_forward(d, a.s, f32(a.x), f32(a.w), f32(a.bias), f32(a.y));
    else
      b.conv2d_forward(d, a.s, f32(a.x), f32(a.w), f32(a.bias), f32(a.y));
  }
  static void conv2d_backward_data(B& b, Device d, const Conv2dBackwardDataArgs& a) {
    b.conv2d_backward_data(d, a.s, f32(a.gy), f32(a.w), f32(a.gx));
  }
  static void conv2d_backward_weight(B& b, Device d, const Conv2dBackwardWeightArgs& a) {
    b.conv2d_backward_weight(d, a.s, f32(a.x), f32(a.gy), f32(a.gw), f32(a.gbias));
  }
  static void maxpool2d(B& b, Device d, const MaxPool2dArgs& a) {
    b.maxpool2d_forward(d, a.s, f32(a.x), f32(a.y), static_cast<std::int64_t*>(a.winners));
  }
  static void maxpool2d_backward(B& b, Device d, const MaxPool2dBackwardArgs& a) {
    if (a.relu_y)
      b.max_pool2d_backward_by_ops(d, DType::F32, a);
    else
      b.maxpool2d_backward(d, a.s, f32(a.gy), static_cast<const std::int64_t*>(a.winners), f32(a.gx));
  }
  static void avgpool2d(B& b, Device d, const AvgPool2dArgs& a) { b.avgpool2d_forward(d, a.s, f32(a.x), f32(a.y)); }
  static void avgpool2d_backward(B& b, Device d, const AvgPool2dBackwardArgs& a) {
    b.avgpool2d_backward(d, a.s, f32(a.gy), f32(a.gx));
  }
  static void batchnorm_train(B& b, Device d, const BatchNormTrainArgs& args) {
    const BatchNormTrainArgs a = as_nchw_rows(args);
    b.batchnorm_forward_train(d, a.N, a.C, a.HW, f32(a.x), f32(a.gamma), f32(a.beta), a.eps, a.momentum,
                              f32(a.running_mean), f32(a.running_var), f32(a.y), f32(a.save_mean),
                              f32(a.save_invstd));
  }
  static void batchnorm_eval(B& b, Device d, const BatchNormEvalArgs& args) {
    const BatchNormEvalArgs a = as_nchw_rows(args);
    b.batchnorm_forward_eval(d, a.N, a.C, a.HW, f32(a.x), f32(a.gamma), f32(a.beta), a.eps, f32(a.running_mean),
                             f32(a.running_var), f32(a.y));
  }
  static void batchnorm_backward(B& b, Device d, const BatchNormBackwardArgs& args) {
    const BatchNormBackwardArgs a = as_nchw_rows(args);
    b.batchnorm_backward(d, a.N, a.C, a.HW, f32(a.gy), f32(a.x), f32(a.gamma), f32(a.save_mean),
                         f32(a.save_invstd), f32(a.gx), f32(a.ggamma), f32(a.gbeta));
  }
  static void sgd_step(B& b, Device d, const SgdStepArgs& a) {
    b.sgd_step(d, f32(a.param), f32(a.grad), f32(a.momentum_buf), a.n, a.lr, a.momentum, a.dampening,
               a.weight_decay, a.nesterov, a.first_step);
  }
  // Each backend applies the epilogue its own way (CPU: Note [Linear epilogue]).
  static void gemm(B& b, Device d, const GemmArgs& a) { b.gemm_with_epilogue(d, a); }
  static void adam_step(B& b, Device d, const AdamStepArgs& a) {
    b.adam_step(d, f32(a.param), f32(a.grad), f32(a.exp_avg), f32(a.exp_avg_sq), a.n, a.lr, a.beta1, a.beta2,
                a.eps, a.weight_decay, a.decoupled, a.step);
  }
};
}  // namespace method_detail

/// The float32 kernels of backend B's member-function ops (the CPU backend replaces the
/// convolution's and the pools' with its own: Note [Fusions are the backend's]).
template <typename B>
std::array<MethodKernel, 20> method_kernels() {
  using C = method_detail::Calls<B>;
  using method_detail::entry;
  return {
      entry<B, Op::FillUniform, &C::fill_uniform>(),
      entry<B, Op::FillNormal, &C::fill_normal>(),
      entry<B, Op::Dropout, &C::dropout>(),
      entry<B, Op::LogSoftmax, &C::log_softmax>(),
      entry<B, Op::LogSoftmaxBackward, &C::log_softmax_backward>(),
      entry<B, Op::NllForward, &C::nll_forward>(),
      entry<B, Op::NllBackward, &C::nll_backward>(),
      entry<B, Op::Conv2d, &C::conv2d>(),
      entry<B, Op::Conv2dBackwardData, &C::conv2d_backward_data>(),
      entry<B, Op::Conv2dBackwardWeight, &C::conv2d_backward_weight>(),
      entry<B, Op::MaxPool2d, &C::maxpool2d>(),
      entry<B, Op::MaxPool2dBackward, &C::maxpool2d_backward>(),
      entry<B, Op::AvgPool2d, &C::avgpool2d>(),
      entry<B, Op::AvgPool2dBackward, &C::avgpool2d_backward>(),
      entry<B, Op::BatchNormTrain, &C::batchnorm_train>(),
      entry<B, Op::BatchNormEval, &C::batchnorm_eval>(),
      entry<B, Op::BatchNormBackward, &C::batchnorm_backward>(),
      entry<B, Op::SgdStep, &C::sgd_step>(),
      entry<B, Op::AdamStep, &C::adam_step>(),
      entry<B, Op::Gemm, &C::gemm>(),
  };
}

}  // namespace dp::backend
