// dp/data/tensor_dataset.h — a dataset over tensors already in memory.
//
// Wraps (data (N, ...) float32, targets (N) int64) so small in-memory data, generated
// data or a test fixture can go through a DataLoader. This header knows nothing about
// nn, optim or DataParallel.
//
//   auto ds = std::make_shared<dp::data::TensorDataset>(dp::randn({100, 4}, gen),
//                                                       dp::arange(100, {dp::Dtype::Int64}));
//   auto [x, y] = ds->get_batch(std::vector<std::int64_t>{3, 1});   // x: (2, 4)
#pragma once

#include <cstdint>
#include <span>

#include "dp/data/dataset.h"

namespace dp::data {

/// A Dataset over a float32 data tensor (N, ...) and an int64 target tensor (N).
class TensorDataset : public Dataset {
 public:
  /// Keeps the tensors (copied to cpu(0) when they live elsewhere; detached from
  /// autograd). Throws dp::Error unless data is float32 with at least 1 dim, targets is
  /// int64 or int32 with shape (N), and both have the same N. int32 targets are widened
  /// to int64 here, so batches always carry int64 targets.
  TensorDataset(Tensor data, Tensor targets);

  /// N, the data tensor's first dim.
  std::int64_t size() const override { return count_; }
  /// The data tensor's shape without its first dim.
  Shape example_shape() const override { return example_shape_; }
  /// Copies of the rows `indices` of data and targets.
  Batch get_batch(std::span<const std::int64_t> indices) const override;

  /// The data tensor (N, ...) on cpu(0).
  const Tensor& data() const { return data_; }
  /// The target tensor (N) on cpu(0).
  const Tensor& targets() const { return targets_; }

 private:
  Tensor data_;
  Tensor targets_;
  std::int64_t count_ = 0;
  Shape example_shape_;
};

}  // namespace dp::data
