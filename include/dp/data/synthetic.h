// dp/data/synthetic.h — a deterministic synthetic classification dataset.
//
// Class-dependent Gaussian blobs in any example shape: example i has label
// i % num_classes and data center[label] + noise * N(0, 1). Every value is a pure
// function of (seed, i), computed on demand, so the dataset costs no memory beyond the
// class centers, any size works, and runs are reproducible on every machine thread
// count. Models can really learn it (samples, benchmarks, convergence tests without
// real data). This header knows nothing about nn, optim or DataParallel.
//
//   dp::data::SyntheticDataset ds({.size = 6000, .example_shape = {1, 28, 28}, .seed = 1});
//   auto [x, y] = ds.get_batch(std::vector<std::int64_t>{0, 1, 2});   // y = {0, 1, 2}
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "dp/data/dataset.h"

namespace dp::data {

/// Parameters of a SyntheticDataset.
struct SyntheticOptions {
  std::int64_t size = 1024;                 ///< number of examples N
  Shape example_shape = {1, 28, 28};        ///< shape of one example
  std::int64_t num_classes = 10;            ///< labels are i % num_classes
  std::uint64_t seed = 0;                   ///< same seed, same data
  /// Expected distance between two class centers, in units of `noise`: 4 keeps classes
  /// well separated yet not trivially so for a linear model.
  float separation = 4.0f;
  float noise = 1.0f;                       ///< standard deviation of each element's noise
};

/// Gaussian-blob classification data (see the file comment).
class SyntheticDataset : public Dataset {
 public:
  /// Options of the dataset (see SyntheticOptions).
  using Options = SyntheticOptions;

  /// Throws dp::Error for size < 0, num_classes < 1, an empty or non-positive example
  /// shape, or a negative separation or noise.
  explicit SyntheticDataset(Options options = {});

  /// options.size.
  std::int64_t size() const override { return options_.size; }
  /// options.example_shape.
  Shape example_shape() const override { return options_.example_shape; }
  /// options.num_classes.
  std::int64_t num_classes() const override { return options_.num_classes; }
  /// Generates the examples `indices` (labels index % num_classes).
  Batch get_batch(std::span<const std::int64_t> indices) const override;

  /// The center of class c, flattened (example numel).
  std::span<const float> center(std::int64_t c) const;

 private:
  Options options_;
  std::int64_t numel_ = 0;       // elements per example
  std::vector<float> centers_;   // (num_classes, numel_)
};

}  // namespace dp::data
