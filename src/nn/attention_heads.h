// src/nn/attention_heads.h — the head split of multi-head attention, shared by
// MultiheadAttention (attention.cpp) and CausalSelfAttention (transformer.cpp). Internal.
#pragma once

#include "dp/tensor/tensor.h"

namespace dp::nn::heads {

/// (N, L, E) -> (N, H, L, E / H): head h holds the columns [h·E/H, (h+1)·E/H).
inline Tensor split(const Tensor& x, std::int64_t H) {
  return x.reshape({x.size(0), x.size(1), H, x.size(2) / H}).transpose(1, 2);
}

/// (N, H, L, D) -> (N, L, H·D): the heads side by side again.
inline Tensor merge(const Tensor& x) {
  return x.transpose(1, 2).reshape({x.size(0), x.size(2), x.size(1) * x.size(3)});
}

}  // namespace dp::nn::heads
