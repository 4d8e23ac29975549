// src/nn/fused_attention.h — the fused path of scaled_dot_product_attention (internal to
// src/nn): when it fits a call, and the differentiable op over the backend's fused
// kernels (Note [Fused attention paths] in fused_attention.cpp).
#pragma once

#include <string>

#include "dp/tensor/tensor.h"

namespace dp::nn::detail {

/// Why the fused kernel cannot run this call, as the end of a sentence ("q, k and v do
/// not have one floating dtype"), or "" when it can. The call's arguments are already
/// checked.
std::string fused_attention_misfit(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask,
                                   bool mask_is_keep, double dropout_p);

/// softmax(q kᵀ · scale + mask) v, its weights dropped with probability dropout_p from
/// `gen` (advanced as the dropout op would be over the (B..., L, S) weights), through the
/// backend's fused kernels, differentiable in q, k and v; in q's dtype. Only for a call
/// whose fused_attention_misfit is "".
Tensor fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask, bool mask_is_keep,
                       bool is_causal, float scale, double dropout_p, Generator& gen);

}  // namespace dp::nn::detail
