// src/parallel/scatter_gather.h — how DataParallel splits a batch over its devices and
// joins the outputs (internal).
//
// scatter_gather.cpp holds DataParallel's input checks, the split of a batch into
// rows per device (torch.chunk's, or the explicit chunk_sizes), each rank's copy of
// its rows (scatter, Note [Scatter backward]) and the outputs' gather onto the output
// device, as PyTorch's scatter_gather.py does for its DataParallel; data_parallel.cpp
// runs them inside a step. Knows nothing of the designs.
#pragma once

#include <cstdint>
#include <vector>

#include "dp/parallel/data_parallel.h"

namespace dp {

/// Rows per device and where each starts.
struct DataParallel::ShardPlan {
  std::int64_t rows = 0;
  std::vector<std::int64_t> sizes, offsets;  // per rank; a rank may get 0 rows
};

}  // namespace dp
