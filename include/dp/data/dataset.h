// dp/data/dataset.h — the abstract dataset every loader reads from, and its batch type.
//
// A Dataset hands out whole batches assembled on the host (cpu(0)): contiguous (B, ...)
// data (float32 unless the dataset says otherwise, e.g. int64 token ids) and (B, ...)
// int64 targets (one class label per example unless the dataset says otherwise). Batch-level access keeps per-example tensor
// overhead out of the hot path. This header knows nothing about nn, optim, autograd or
// DataParallel: a batch is plain tensors; moving it to a device is the caller's job.
//
//   auto ds = std::make_shared<dp::data::MnistDataset>(dir, dp::data::Split::Train);
//   std::vector<std::int64_t> idx{0, 5, 7};
//   auto [x, y] = ds->get_batch(idx);            // x: (3, 1, 28, 28), y: (3)
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "dp/tensor/tensor.h"

namespace dp::data {

/// One batch: inputs `data` (B, example_shape()...) of example_dtype() and labels
/// `target` (B, target_shape()...) int64, both on cpu(0). A plain aggregate, so
/// `auto& [x, y] = batch` works.
struct Batch {
  Tensor data;    ///< (B, ...) float32 (or the dataset's example_dtype()), contiguous, on cpu(0)
  Tensor target;  ///< (B) int64 (or (B, target_shape()...)), contiguous, on cpu(0)
};

/// Which half of a dataset with a fixed train/test split to read.
enum class Split : std::uint8_t { Train, Test };

/// "train" or "test".
const char* split_name(Split split);

/// A finite, indexable collection of (example, label) pairs.
///
/// Implementations must allow concurrent calls of every const method from several
/// threads (DataLoader workers call get_batch in parallel) and must be deterministic:
/// the same indices always give the same batch.
class Dataset {
 public:
  virtual ~Dataset() = default;

  /// Number of examples N.
  virtual std::int64_t size() const = 0;
  /// Shape of one example without the batch dim, e.g. (1, 28, 28).
  virtual Shape example_shape() const = 0;
  /// The dtype of the examples: float32 (images, features) unless overridden (int64
  /// token ids).
  virtual Dtype example_dtype() const { return Dtype::Float32; }
  /// Shape of one example's target without the batch dim: () — one class label — unless
  /// overridden (a label per token: (T)).
  virtual Shape target_shape() const { return {}; }
  /// Number of classes labels are drawn from (labels lie in [0, num_classes)); 0 when
  /// unknown.
  virtual std::int64_t num_classes() const { return 0; }
  /// Assembles the examples `indices` (each in [0, size()), repeats allowed, any order)
  /// into one batch on cpu(0): data (B, example_shape()...) of example_dtype(), target
  /// (B, target_shape()...) int64, B = indices.size(). Throws dp::Error for an index out of range.
  virtual Batch get_batch(std::span<const std::int64_t> indices) const = 0;

 protected:
  /// Allocates an uninitialised batch of `count` examples of example_shape(),
  /// example_dtype() and target_shape() on cpu(0) (for implementations of get_batch).
  Batch allocate_batch(std::int64_t count) const;
  /// Throws dp::Error naming `who` when an index lies outside [0, size()).
  void check_indices(std::span<const std::int64_t> indices, const char* who) const;
};

/// Reads a whole file into memory, inflating it when it is gzip-compressed (detected by
/// its magic bytes, so "x.gz" and a plain "x" both work). Throws dp::Error naming the
/// file when it is missing, unreadable, a truncated or corrupt gzip stream, or larger
/// than `max_bytes` once inflated.
std::vector<std::uint8_t> read_file_bytes(const std::filesystem::path& path,
                                          std::uint64_t max_bytes = std::uint64_t{1} << 34);

}  // namespace dp::data
