// dp/data/cifar10.h — CIFAR-10 in its binary format, and Cifar10Dataset.
//
// A CIFAR-10 binary batch file is a sequence of 3073-byte records: 1 label byte in
// [0, 10), then 3072 pixel bytes (1024 red, 1024 green, 1024 blue; rows of 32). The
// train split is data_batch_1.bin .. data_batch_5.bin, the test split test_batch.bin.
// Malformed input raises a dp::Error naming the file and what was expected. This header
// knows nothing about nn, optim or DataParallel.
//
//   dp::data::Cifar10Dataset train("/data/cifar-10-batches-bin", dp::data::Split::Train,
//                                  {.normalize = true});
//   train.example_shape();   // (3, 32, 32)
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "dp/data/dataset.h"

namespace dp::data {

/// Raw CIFAR-10 records: `count` labels and count * 3072 CHW pixel bytes.
struct CifarRecords {
  std::int64_t count = 0;            ///< number of records
  std::vector<std::uint8_t> labels;  ///< (count), each in [0, 10)
  std::vector<std::uint8_t> pixels;  ///< (count, 3, 32, 32)
};

/// Parses CIFAR-10 binary records held in memory; `name` labels error messages. Throws
/// dp::Error when size is not a multiple of 3073 or a label is >= 10. Never reads
/// outside [data, data + size). Used by Cifar10Dataset and by the fuzz target.
CifarRecords parse_cifar(const std::uint8_t* data, std::size_t size, const std::string& name);

/// How Cifar10Dataset turns pixel bytes into floats.
struct Cifar10Options {
  /// false: pixel / 255 in [0, 1]. true: then (x - mean[c]) / std[c] with the usual
  /// per-channel CIFAR-10 train statistics (Cifar10Dataset::kMean, kStd).
  bool normalize = false;
};

/// CIFAR-10 classification data served as float32 (3, 32, 32) and int64 labels in
/// [0, 10). Pixels are held in memory as uint8 (150 MB for the train split).
class Cifar10Dataset : public Dataset {
 public:
  /// Options of the dataset (see Cifar10Options).
  using Options = Cifar10Options;

  /// Loads data_batch_1..5.bin (Train) or test_batch.bin (Test) from `dir` (plain or
  /// gzip). Throws dp::Error when a file is missing or malformed.
  Cifar10Dataset(const std::filesystem::path& dir, Split split, Options options = {});
  /// Builds the dataset from parsed records.
  explicit Cifar10Dataset(CifarRecords records, Options options = {});

  /// Number of images N (50000 train, 10000 test for the real files).
  std::int64_t size() const override { return records_.count; }
  /// (3, 32, 32).
  Shape example_shape() const override { return {kChannels, kSide, kSide}; }
  /// 10.
  std::int64_t num_classes() const override { return kNumClasses; }
  /// Scaled (and optionally normalised) float32 (B, 3, 32, 32) and int64 labels (B).
  Batch get_batch(std::span<const std::int64_t> indices) const override;

  static constexpr std::int64_t kNumClasses = 10;  ///< labels lie in [0, 10)
  static constexpr std::int64_t kChannels = 3;     ///< R, G, B planes
  static constexpr std::int64_t kSide = 32;        ///< images are 32x32
  static constexpr std::int64_t kPixels = kChannels * kSide * kSide;  ///< 3072 bytes
  static constexpr std::int64_t kRecordBytes = 1 + kPixels;          ///< 3073 bytes
  /// Per-channel mean and standard deviation of the train split (pixels in [0, 1]).
  static constexpr float kMean[3] = {0.4914f, 0.4822f, 0.4465f};
  static constexpr float kStd[3] = {0.2470f, 0.2435f, 0.2616f};

 private:
  CifarRecords records_;
  Options options_;
};

}  // namespace dp::data
