#include "dp/data/synthetic.h"

#include <cmath>
#include <numbers>

#include "dp/core/error.h"

namespace dp::data {
namespace {

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Counter-based: the value for (seed, stream, counter) needs no state, so any example
// can be produced on any thread in any order.
std::uint64_t hash3(std::uint64_t seed, std::uint64_t stream, std::uint64_t counter) {
  return splitmix64(splitmix64(splitmix64(seed) ^ stream) ^ counter);
}

// Writes n standard normal values for (seed, stream, first counter); Box-Muller on the
// two 32-bit halves of one hash gives two values.
void fill_normal(float* out, std::int64_t n, std::uint64_t seed, std::uint64_t stream,
                 std::uint64_t first) {
  constexpr double kTwoPi = 2.0 * std::numbers::pi;
  constexpr double kInv32 = 1.0 / 4294967296.0;  // 2^-32
  for (std::int64_t j = 0; j < n; j += 2) {
    const std::uint64_t h = hash3(seed, stream, first + static_cast<std::uint64_t>(j / 2));
    const double u1 = (static_cast<double>(h >> 32) + 1.0) * kInv32;  // (0, 1]: log is finite
    const double u2 = static_cast<double>(h & 0xffffffffULL) * kInv32;
    const double r = std::sqrt(-2.0 * std::log(u1));
    out[j] = static_cast<float>(r * std::cos(kTwoPi * u2));
    if (j + 1 < n) out[j + 1] = static_cast<float>(r * std::sin(kTwoPi * u2));
  }
}

constexpr std::uint64_t kCenterStream = 1;
constexpr std::uint64_t kNoiseStream = 2;

}  // namespace

SyntheticDataset::SyntheticDataset(Options options) : options_(std::move(options)) {
  DP_CHECK(options_.size >= 0, "SyntheticDataset: expected size >= 0, got ", options_.size);
  DP_CHECK(options_.num_classes >= 1, "SyntheticDataset: expected num_classes >= 1, got ",
           options_.num_classes);
  DP_CHECK(!options_.example_shape.empty(),
           "SyntheticDataset: expected an example shape with at least 1 dim, got []");
  for (std::int64_t d : options_.example_shape) {
    DP_CHECK(d >= 1, "SyntheticDataset: expected positive example dims, got ",
             shape_str(options_.example_shape));
  }
  DP_CHECK(options_.separation >= 0.0f && options_.noise >= 0.0f,
           "SyntheticDataset: expected separation >= 0 and noise >= 0, got ", options_.separation,
           " and ", options_.noise);
  numel_ = shape_numel(options_.example_shape);
  centers_.resize(static_cast<std::size_t>(options_.num_classes * numel_));
  // Two centers with i.i.d. N(0, s^2) elements lie s * sqrt(2 D) apart on average (D =
  // numel); pick s so that distance is `separation` noise standard deviations.
  const float s = options_.separation * options_.noise /
                  static_cast<float>(std::sqrt(2.0 * static_cast<double>(numel_)));
  for (std::int64_t c = 0; c < options_.num_classes; ++c) {
    float* center = centers_.data() + c * numel_;
    fill_normal(center, numel_, options_.seed, kCenterStream,
                static_cast<std::uint64_t>(c) << 40);
    for (std::int64_t j = 0; j < numel_; ++j) center[j] *= s;
  }
}

std::span<const float> SyntheticDataset::center(std::int64_t c) const {
  DP_CHECK(c >= 0 && c < options_.num_classes, "SyntheticDataset::center: class ", c,
           " out of range [0, ", options_.num_classes, ")");
  return {centers_.data() + c * numel_, static_cast<std::size_t>(numel_)};
}

Batch SyntheticDataset::get_batch(std::span<const std::int64_t> indices) const {
  check_indices(indices, "SyntheticDataset::get_batch");
  Batch batch = allocate_batch(static_cast<std::int64_t>(indices.size()));
  float* x = batch.data.data<float>();
  std::int64_t* y = batch.target.data<std::int64_t>();
  // Counter of example i's first pair: (numel + 1) / 2 pairs per example.
  const std::uint64_t pairs = static_cast<std::uint64_t>((numel_ + 1) / 2);
  for (std::size_t b = 0; b < indices.size(); ++b) {
    const std::int64_t i = indices[b];
    const std::int64_t label = i % options_.num_classes;
    float* dst = x + static_cast<std::int64_t>(b) * numel_;
    fill_normal(dst, numel_, options_.seed, kNoiseStream, static_cast<std::uint64_t>(i) * pairs);
    const float* center = centers_.data() + label * numel_;
    for (std::int64_t j = 0; j < numel_; ++j) dst[j] = center[j] + options_.noise * dst[j];
    y[b] = label;
  }
  return batch;
}

}  // namespace dp::data
