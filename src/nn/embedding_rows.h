// src/nn/embedding_rows.h — an embedding's rows gathered without reading its ids on the host.
//
// Note [Embedding ids without a host read]
// index_select reads its indices on the host to refuse a bad one with a dp::Error before
// any kernel sees it. On CUDA that read is a wait for the device, and a GPT's forward
// makes it twice (token ids, then positions) on every device's worker in every step. So
// embedding() reads ids on the host only where they live there (CPU devices: a bad id
// is a dp::Error naming it, as before). Ids on a GPU are checked on the device: an id
// outside [0, V) gathers row 0 and its output row becomes NaN — the loss turns NaN, as a
// bad target does in the CUDA nll kernels, and the opt-in non-finite check names the
// step — while the backward adds that row's gradient to row 0 (never out of bounds).
// The range test compares the ids in float32, exact for V <= 2^24; a larger table reads
// its ids on the host.
#pragma once

#include <cstdint>

#include "dp/tensor/tensor.h"

namespace dp::nn::detail {

/// Whether embedding() gathers ids on the device without reading them on the host:
/// ids off the host and a table of 1 to 2^24 rows.
bool embedding_ids_on_device(const Tensor& ids, std::int64_t rows);

/// The rows of weight (V, D) at ids64 (n) int64, on their device, without a host read:
/// (n, D) in weight's dtype, NaN rows where an id is outside [0, V). `gathered` gets the
/// (n) ids actually gathered (bad ones as 0), for the backward.
Tensor embedding_rows_on_device(const Tensor& weight, const Tensor& ids64, Tensor& gathered);

}  // namespace dp::nn::detail
