#include "dp/data/cifar10.h"

#include <cstring>

#include "dp/core/error.h"

namespace dp::data {

CifarRecords parse_cifar(const std::uint8_t* data, std::size_t size, const std::string& name) {
  DP_CHECK(data != nullptr || size == 0, "parse_cifar('", name, "'): null data with size ", size);
  constexpr std::size_t kRecord = Cifar10Dataset::kRecordBytes;
  constexpr std::size_t kPixels = Cifar10Dataset::kPixels;
  DP_CHECK(size > 0 && size % kRecord == 0, "CIFAR-10 file '", name, "' has ", size,
           " bytes; expected a positive multiple of ", kRecord,
           " (1 label byte + 3072 pixel bytes per record); the file is truncated or not a "
           "CIFAR-10 binary batch (CIFAR-100 records are 3074 bytes)");
  CifarRecords out;
  out.count = static_cast<std::int64_t>(size / kRecord);
  out.labels.resize(size / kRecord);
  out.pixels.resize(size / kRecord * kPixels);
  for (std::size_t i = 0; i < out.labels.size(); ++i) {
    const std::uint8_t* rec = data + i * kRecord;
    DP_CHECK(rec[0] < Cifar10Dataset::kNumClasses, "CIFAR-10 file '", name, "': label ",
             int{rec[0]}, " of record ", i, " (byte offset ", i * kRecord,
             ") is out of range; expected a class in [0, 10)");
    out.labels[i] = rec[0];
    std::memcpy(out.pixels.data() + i * kPixels, rec + 1, kPixels);
  }
  return out;
}

Cifar10Dataset::Cifar10Dataset(const std::filesystem::path& dir, Split split, Options options)
    : options_(options) {
  std::error_code ec;
  DP_CHECK(std::filesystem::is_directory(dir, ec), "Cifar10Dataset: data directory '",
           dir.string(), "' does not exist; expected the folder cifar-10-batches-bin holding "
           "data_batch_1.bin .. data_batch_5.bin and test_batch.bin");
  std::vector<std::string> names;
  if (split == Split::Train) {
    for (int i = 1; i <= 5; ++i) names.push_back("data_batch_" + std::to_string(i) + ".bin");
  } else {
    names.push_back("test_batch.bin");
  }
  for (const std::string& n : names) {
    const std::filesystem::path path = dir / n;
    const std::vector<std::uint8_t> bytes = read_file_bytes(path);
    CifarRecords part = parse_cifar(bytes.data(), bytes.size(), path.string());
    records_.count += part.count;
    records_.labels.insert(records_.labels.end(), part.labels.begin(), part.labels.end());
    records_.pixels.insert(records_.pixels.end(), part.pixels.begin(), part.pixels.end());
  }
}

Cifar10Dataset::Cifar10Dataset(CifarRecords records, Options options)
    : records_(std::move(records)), options_(options) {
  DP_CHECK(records_.count >= 0 &&
               records_.labels.size() == static_cast<std::size_t>(records_.count) &&
               records_.pixels.size() == static_cast<std::size_t>(records_.count * kPixels),
           "Cifar10Dataset: expected ", records_.count, " labels and ", records_.count * kPixels,
           " pixel bytes, got ", records_.labels.size(), " and ", records_.pixels.size());
  for (std::size_t i = 0; i < records_.labels.size(); ++i) {
    DP_CHECK(records_.labels[i] < kNumClasses, "Cifar10Dataset: label ", int{records_.labels[i]},
             " of record ", i, " is out of range; expected a class in [0, 10)");
  }
}

Batch Cifar10Dataset::get_batch(std::span<const std::int64_t> indices) const {
  check_indices(indices, "Cifar10Dataset::get_batch");
  Batch batch = allocate_batch(static_cast<std::int64_t>(indices.size()));
  float* x = batch.data.data<float>();
  std::int64_t* y = batch.target.data<std::int64_t>();
  constexpr std::size_t kPlane = kSide * kSide;
  // Per channel: x = (p / 255 - mean) / std, or just p / 255.
  float scale[kChannels];
  float shift[kChannels];
  for (std::int64_t c = 0; c < kChannels; ++c) {
    scale[c] = options_.normalize ? 1.0f / kStd[c] : 1.0f;
    shift[c] = options_.normalize ? kMean[c] : 0.0f;
  }
  for (std::size_t b = 0; b < indices.size(); ++b) {
    const std::size_t i = static_cast<std::size_t>(indices[b]);
    const std::uint8_t* src = records_.pixels.data() + i * kPixels;
    float* dst = x + b * kPixels;
    for (std::int64_t c = 0; c < kChannels; ++c) {
      for (std::size_t j = 0; j < kPlane; ++j) {
        const std::size_t k = c * kPlane + j;
        dst[k] = (static_cast<float>(src[k]) / 255.0f - shift[c]) * scale[c];
      }
    }
    y[b] = records_.labels[i];
  }
  return batch;
}

}  // namespace dp::data
