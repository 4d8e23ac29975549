#include "dp/data/tensor_dataset.h"

#include <cstring>

#include "dp/core/error.h"

namespace dp::data {

TensorDataset::TensorDataset(Tensor data, Tensor targets) {
  DP_CHECK(data.defined() && targets.defined(),
           "TensorDataset: expected defined data and target tensors, got an undefined tensor");
  DP_CHECK(data.dtype() == Dtype::Float32 && data.dim() >= 1,
           "TensorDataset: expected float32 data with at least 1 dim (N, ...), got ", data.str());
  DP_CHECK((targets.dtype() == Dtype::Int64 || targets.dtype() == Dtype::Int32) && targets.dim() == 1,
           "TensorDataset: expected int64 or int32 targets of shape (N), got ", targets.str(),
           " (convert with .to(dp::Dtype::Int64))");
  DP_CHECK(data.size(0) == targets.size(0), "TensorDataset: data holds ", data.size(0),
           " examples but targets holds ", targets.size(0), "; expected the same N");
  const Device host = cpu(0);
  data_ = data.detach().to(host);
  // Batches carry int64 targets (Dataset::allocate_batch): int32 labels widen here once.
  targets_ = targets.detach().to(host).to(Dtype::Int64);
  count_ = data_.size(0);
  example_shape_.assign(data_.shape().begin() + 1, data_.shape().end());
}

Batch TensorDataset::get_batch(std::span<const std::int64_t> indices) const {
  check_indices(indices, "TensorDataset::get_batch");
  Batch batch = allocate_batch(static_cast<std::int64_t>(indices.size()));
  const std::size_t row = static_cast<std::size_t>(shape_numel(example_shape_));
  const float* src = data_.data<float>();
  const std::int64_t* tsrc = targets_.data<std::int64_t>();
  float* dst = batch.data.data<float>();
  std::int64_t* tdst = batch.target.data<std::int64_t>();
  for (std::size_t b = 0; b < indices.size(); ++b) {
    const std::size_t i = static_cast<std::size_t>(indices[b]);
    if (row > 0) std::memcpy(dst + b * row, src + i * row, row * sizeof(float));
    tdst[b] = tsrc[i];
  }
  return batch;
}

}  // namespace dp::data
