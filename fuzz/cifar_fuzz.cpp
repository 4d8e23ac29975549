// libFuzzer target: dp::data::parse_cifar on arbitrary bytes (built by scripts/fuzz.sh).
//
// Contract under test (include/dp/data/cifar10.h): any input either parses or throws
// dp::Error; never reads outside the input. Parsed records are checked against the
// input byte for byte.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "dp/core/error.h"
#include "dp/data/cifar10.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  dp::data::CifarRecords r;
  try {
    r = dp::data::parse_cifar(data, size, "<fuzz>");
  } catch (const dp::Error&) {
    return 0;
  }
  constexpr std::size_t kRecord = dp::data::Cifar10Dataset::kRecordBytes;
  constexpr std::size_t kPixels = dp::data::Cifar10Dataset::kPixels;
  const auto n = static_cast<std::size_t>(r.count);
  if (n * kRecord != size || r.labels.size() != n || r.pixels.size() != n * kPixels) std::abort();
  for (std::size_t i = 0; i < n; ++i) {
    if (r.labels[i] != data[i * kRecord] || r.labels[i] >= dp::data::Cifar10Dataset::kNumClasses) std::abort();
    if (std::memcmp(r.pixels.data() + i * kPixels, data + i * kRecord + 1, kPixels) != 0) std::abort();
  }
  return 0;
}
