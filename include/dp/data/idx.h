// dp/data/idx.h — the IDX file format (MNIST, Fashion-MNIST) and MnistDataset.
//
// IDX: 2 zero bytes, a dtype byte, a dim-count byte, one big-endian uint32 per dim,
// then the elements in big-endian, row-major order. Files may be gzip-compressed.
// Every malformed input (missing, truncated, bad magic, sizes that do not add up,
// labels out of range) raises a dp::Error that names the file and says what was
// expected and what came. This header knows nothing about nn, optim or DataParallel.
//
//   dp::data::MnistDataset train(dp::data::default_fashion_mnist_dir(), dp::data::Split::Train);
//   train.size();            // 60000
//   train.example_shape();   // (1, 28, 28), pixels scaled to [0, 1]
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "dp/data/dataset.h"

namespace dp::data {

/// Element types an IDX file can hold (the third magic byte).
enum class IdxDtype : std::uint8_t {
  UInt8 = 0x08,
  Int8 = 0x09,
  Int16 = 0x0B,
  Int32 = 0x0C,
  Float32 = 0x0D,
  Float64 = 0x0E,
};

/// Bytes per element of an IDX dtype.
std::size_t idx_element_size(IdxDtype dtype);
/// "uint8", "int8", "int16", "int32", "float32", "float64".
const char* idx_dtype_name(IdxDtype dtype);

/// A parsed IDX array: dims outermost first, elements in host byte order.
struct IdxArray {
  IdxDtype dtype = IdxDtype::UInt8;   ///< element type
  std::vector<std::int64_t> dims;     ///< sizes per dimension, outermost first
  std::vector<std::uint8_t> bytes;    ///< numel() * idx_element_size(dtype) bytes, host order

  /// Product of dims (1 for zero dims).
  std::int64_t numel() const;
};

/// Parses an IDX image held in memory (already inflated). `name` labels error messages
/// (a path, or "<memory>"). Throws dp::Error on any malformed input; never reads outside
/// [data, data + size). Used by read_idx and by the fuzz target.
IdxArray parse_idx(const std::uint8_t* data, std::size_t size, const std::string& name);

/// Reads and parses an IDX file, plain or gzip-compressed.
IdxArray read_idx(const std::filesystem::path& path);

/// Serialises an array as IDX bytes (big-endian), the inverse of parse_idx. For writing
/// test fixtures and small exports.
std::vector<std::uint8_t> encode_idx(const IdxArray& array);

/// The directory holding Fashion-MNIST's four files: $DP_DATA_DIR when set and not
/// empty, else /usr/share/datasets/fashion-mnist (Debian's dataset-fashion-mnist).
std::filesystem::path default_fashion_mnist_dir();

/// MNIST-style image classification data: uint8 images (N, H, W) and uint8 labels (N)
/// in [0, 10), served as float32 (1, H, W) in [0, 1] (pixel / 255) and int64 labels.
/// All pixels are held in memory as uint8 (47 MB for the 60000-image train split).
class MnistDataset : public Dataset {
 public:
  /// Loads `dir`/{train,t10k}-images-idx3-ubyte[.gz] and the matching
  /// -labels-idx1-ubyte[.gz] (gzip is preferred when both exist). Throws dp::Error when
  /// a file is missing or malformed, the image and label counts differ, or a label is
  /// outside [0, 10). `dir` is used as given: DP_DATA_DIR changes only
  /// default_fashion_mnist_dir(), so pass that to follow the variable.
  MnistDataset(const std::filesystem::path& dir, Split split);
  /// Builds the dataset from parsed arrays (images (N, H, W) uint8, labels (N) uint8);
  /// `name` labels error messages. Same validation as the directory constructor.
  MnistDataset(IdxArray images, IdxArray labels, const std::string& name);

  /// Number of images N.
  std::int64_t size() const override { return count_; }
  /// (1, H, W): (1, 28, 28) for MNIST and Fashion-MNIST.
  Shape example_shape() const override { return {1, height_, width_}; }
  /// 10.
  std::int64_t num_classes() const override { return kNumClasses; }
  /// Pixels / 255 as float32 (B, 1, H, W) and labels as int64 (B), on cpu(0).
  Batch get_batch(std::span<const std::int64_t> indices) const override;

  /// The label of example i (throws dp::Error for i outside [0, size())).
  std::int64_t label(std::int64_t i) const;

  /// Labels must lie in [0, kNumClasses).
  static constexpr std::int64_t kNumClasses = 10;

 private:
  void init(IdxArray images, IdxArray labels, const std::string& images_name,
            const std::string& labels_name);

  std::int64_t count_ = 0;
  std::int64_t height_ = 0;
  std::int64_t width_ = 0;
  std::vector<std::uint8_t> pixels_;  // (N, H, W)
  std::vector<std::uint8_t> labels_;  // (N)
};

}  // namespace dp::data
