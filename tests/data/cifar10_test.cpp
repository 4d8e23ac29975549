// Tests for dp/data/cifar10.h: the record parser (good and bad input) and the dataset.
#include "dp/data/cifar10.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "dp/core/error.h"

namespace fs = std::filesystem;
using dp::data::Cifar10Dataset;

namespace {

constexpr std::size_t kRec = 3073;

// n records: label i % 10, pixel (i, k) = (i + k) % 256.
std::vector<std::uint8_t> make_records(std::size_t n, std::size_t first = 0) {
  std::vector<std::uint8_t> out;
  for (std::size_t i = first; i < first + n; ++i) {
    out.push_back(static_cast<std::uint8_t>(i % 10));
    for (std::size_t k = 0; k < 3072; ++k) out.push_back(static_cast<std::uint8_t>((i + k) % 256));
  }
  return out;
}

struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() /
           ("dp_cifar_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

void write_plain(const fs::path& p, const std::vector<std::uint8_t>& bytes) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(f.good());
}

}  // namespace

TEST_CASE("parse_cifar reads records") {
  const std::vector<std::uint8_t> bytes = make_records(3);
  const dp::data::CifarRecords r = dp::data::parse_cifar(bytes.data(), bytes.size(), "x.bin");
  CHECK(r.count == 3);
  CHECK(r.labels == std::vector<std::uint8_t>{0, 1, 2});
  REQUIRE(r.pixels.size() == 3 * 3072);
  CHECK(r.pixels[0] == 0);
  CHECK(r.pixels[3072 + 5] == 6);
  CHECK(r.pixels[2 * 3072 + 3071] == (2 + 3071) % 256);
}

TEST_CASE("parse_cifar rejects bad input") {
  std::vector<std::uint8_t> bytes = make_records(2);
  SUBCASE("truncated") {
    for (std::size_t size : {std::size_t{0}, std::size_t{1}, kRec - 1, 2 * kRec - 100, 2 * kRec - 1}) {
      CAPTURE(size);
      CHECK_THROWS_WITH_AS(dp::data::parse_cifar(bytes.data(), size, "t.bin"),
                           doctest::Contains("multiple of 3073"), dp::Error);
    }
  }
  SUBCASE("trailing bytes") {
    bytes.push_back(0);
    CHECK_THROWS_WITH_AS(dp::data::parse_cifar(bytes.data(), bytes.size(), "t.bin"),
                         doctest::Contains("t.bin' has 6147 bytes"), dp::Error);
  }
  SUBCASE("label out of range") {
    bytes[kRec] = 10;
    CHECK_THROWS_WITH_AS(dp::data::parse_cifar(bytes.data(), bytes.size(), "l.bin"),
                         doctest::Contains("label 10 of record 1"), dp::Error);
  }
}

TEST_CASE("Cifar10Dataset loads a directory and scales pixels") {
  TempDir dir;
  for (int b = 1; b <= 5; ++b) {
    write_plain(dir.path / ("data_batch_" + std::to_string(b) + ".bin"),
                make_records(2, static_cast<std::size_t>(2 * (b - 1))));
  }
  write_plain(dir.path / "test_batch.bin", make_records(3));
  const Cifar10Dataset train(dir.path, dp::data::Split::Train);
  const Cifar10Dataset test(dir.path, dp::data::Split::Test);
  CHECK(train.size() == 10);
  CHECK(test.size() == 3);
  CHECK(train.example_shape() == dp::Shape{3, 32, 32});

  const std::vector<std::int64_t> idx = {7, 2};
  auto [x, y] = train.get_batch(idx);
  CHECK(x.shape() == dp::Shape{2, 3, 32, 32});
  CHECK(y.to_vector_i64() == std::vector<std::int64_t>{7, 2});
  const std::vector<float> v = x.to_vector();
  CHECK(v[0] == 7.0f / 255.0f);
  CHECK(v[3072 + 1024 + 3] == static_cast<float>((2 + 1024 + 3) % 256) / 255.0f);

  const Cifar10Dataset norm(dir.path, dp::data::Split::Train, {.normalize = true});
  const std::vector<float> n = norm.get_batch(idx).data.to_vector();
  for (std::size_t c = 0; c < 3; ++c) {
    const std::size_t k = c * 1024 + 17;
    const float raw = static_cast<float>((7 + k) % 256) / 255.0f;
    CHECK(n[k] == doctest::Approx((raw - Cifar10Dataset::kMean[c]) / Cifar10Dataset::kStd[c]).epsilon(1e-5));
  }

  // A missing batch file is named.
  fs::remove(dir.path / "data_batch_4.bin");
  CHECK_THROWS_WITH_AS(Cifar10Dataset(dir.path, dp::data::Split::Train),
                       doctest::Contains("data_batch_4.bin"), dp::Error);
}
