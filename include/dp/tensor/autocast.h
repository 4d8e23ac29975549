// dp/tensor/autocast.h — automatic mixed precision: a scope in which ops choose their
// compute dtype (PyTorch's torch.autocast).
//
//   {
//     dp::amp::autocast guard(dp::Dtype::BFloat16);
//     dp::Tensor logits = model(x);                        // matmuls, convs in bfloat16
//     dp::Tensor loss = dp::nn::cross_entropy(logits, y);  // float32
//   }
//   loss.backward();   // each op's backward in the dtype its forward used
//
// Note [Autocast op policy]
// Inside an enabled scope, an op of the lower-precision list casts its floating inputs
// to the scope's dtype and computes there (accumulating in float32): linear, matmul
// (batched too), conv2d and scaled_dot_product_attention. An op of the float32 list
// casts its floating inputs to float32 and returns float32: softmax, log_softmax, every
// loss, layer_norm, exp, log, pow, sum and mean. batch_norm is on neither list, as in
// PyTorch: its statistics are float32 whatever its input, its output has the input's
// dtype (so a bfloat16 CNN's activations stay bfloat16 from one convolution to the
// next, and its parameters and running statistics stay float32). Every other op runs
// in the dtype of its inputs, and an op given float32 and 16-bit operands computes in
// float32 (Note [16-bit tensors] in dp/tensor/tensor.h).
// The casts are ordinary differentiable to(dtype) calls, so a float32 parameter used by
// a linear layer is cast to bfloat16 for the product and its gradient comes back as
// float32: parameters stay float32 (master weights) and optimizers step in float32.
// An op's own inner calls do not apply the policy again (the scope is suspended while
// the op runs on its cast inputs), and backward never does: the engine runs every
// node with autocast off, so each backward computes in its forward's dtypes.
// The lists are PyTorch's CUDA lists restricted to dp's ops, on every device type.
//
// The state is per thread, as grad mode is. DataParallel carries the calling thread's
// state to every worker of a step (forward, forward_backward, a user's own forward on
// the replicas), in every design: PyTorch's nn.DataParallel did not, and its workers ran
// in float32 under a caller's autocast until it copied the state by hand.
#pragma once

#include "dp/tensor/tensor.h"

namespace dp::amp {

/// One thread's autocast setting.
struct AutocastState {
  bool enabled = false;
  Dtype dtype = Dtype::BFloat16;
};

/// The calling thread's state; and setting it (a runtime carrying it to its threads).
AutocastState autocast_state();
void set_autocast_state(AutocastState state);
bool is_autocast_enabled();
/// The dtype the lower-precision ops use in an enabled scope.
Dtype get_autocast_dtype();

/// RAII scope: autocast to `dtype` (BFloat16 or Float16) when `enabled`, restoring the
/// previous state at its end. Scopes nest; an inner `enabled = false` turns autocast
/// off for its extent. Throws dp::Error for any other dtype.
class autocast {  // NOLINT(readability-identifier-naming): PyTorch's spelling
 public:
  explicit autocast(Dtype dtype = Dtype::BFloat16, bool enabled = true);
  ~autocast();
  autocast(const autocast&) = delete;
  autocast& operator=(const autocast&) = delete;

 private:
  AutocastState prev_;
};

/// RAII: installs `state` on this thread for its lifetime, then restores the previous.
class AutocastStateGuard {
 public:
  explicit AutocastStateGuard(AutocastState state);
  ~AutocastStateGuard();
  AutocastStateGuard(const AutocastStateGuard&) = delete;
  AutocastStateGuard& operator=(const AutocastStateGuard&) = delete;

 private:
  AutocastState prev_;
};

}  // namespace dp::amp
