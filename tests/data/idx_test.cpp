// Tests for dp/data/idx.h: IDX parsing, MnistDataset, and the real Fashion-MNIST files.
#include "dp/data/idx.h"

#include <doctest/doctest.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "dp/core/error.h"

namespace fs = std::filesystem;
using dp::data::IdxArray;
using dp::data::IdxDtype;

namespace {

// A fresh directory under the system temp dir, removed with everything in it.
struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() /
           ("dp_idx_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
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

void write_gzip(const fs::path& p, const std::vector<std::uint8_t>& bytes) {
  gzFile f = gzopen(p.c_str(), "wb");
  REQUIRE(f != nullptr);
  if (!bytes.empty()) {
    REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) ==
            static_cast<int>(bytes.size()));
  }
  REQUIRE(gzclose(f) == Z_OK);
}

std::vector<std::uint8_t> read_raw(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// Runs f, which must throw dp::Error, and returns its message.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const dp::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("expected dp::Error, got another exception: ", e.what());
  }
  FAIL("expected dp::Error, nothing was thrown");
  return {};
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// n images of h x w with pixel (i, y, x) = (i * 7 + y * w + x) % 256, labels i % 10.
IdxArray make_images(std::int64_t n, std::int64_t h, std::int64_t w) {
  IdxArray a{IdxDtype::UInt8, {n, h, w}, {}};
  a.bytes.resize(static_cast<std::size_t>(n * h * w));
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < h * w; ++j)
      a.bytes[static_cast<std::size_t>(i * h * w + j)] = static_cast<std::uint8_t>((i * 7 + j) % 256);
  return a;
}

IdxArray make_labels(std::int64_t n) {
  IdxArray a{IdxDtype::UInt8, {n}, {}};
  for (std::int64_t i = 0; i < n; ++i) a.bytes.push_back(static_cast<std::uint8_t>(i % 10));
  return a;
}

}  // namespace

TEST_CASE("parse_idx reads a hand-written big-endian file") {
  // int16 array of dims (2, 3): 0x0102 = 258 first.
  const std::vector<std::uint8_t> bytes = {0, 0, 0x0B, 2, 0, 0, 0, 2, 0, 0, 0, 3,
                                           0x01, 0x02, 0, 1, 0, 2, 0, 3, 0xff, 0xff, 0, 5};
  const IdxArray a = dp::data::parse_idx(bytes.data(), bytes.size(), "hand");
  CHECK(a.dtype == IdxDtype::Int16);
  CHECK(a.dims == std::vector<std::int64_t>{2, 3});
  CHECK(a.numel() == 6);
  REQUIRE(a.bytes.size() == 12);
  std::array<std::int16_t, 6> v{};
  std::memcpy(v.data(), a.bytes.data(), 12);
  CHECK(v == std::array<std::int16_t, 6>{258, 1, 2, 3, -1, 5});
  // encode_idx is the exact inverse.
  CHECK(dp::data::encode_idx(a) == bytes);
}

TEST_CASE("IDX round trip through plain and gzip files") {
  TempDir dir;
  const IdxArray images = make_images(5, 4, 3);
  const std::vector<std::uint8_t> encoded = dp::data::encode_idx(images);
  CHECK(encoded.size() == 4 + 3 * 4 + 5 * 4 * 3);
  write_plain(dir.path / "a.idx", encoded);
  write_gzip(dir.path / "a.idx.gz", encoded);
  for (const char* name : {"a.idx", "a.idx.gz"}) {
    CAPTURE(name);
    const IdxArray back = dp::data::read_idx(dir.path / name);
    CHECK(back.dtype == IdxDtype::UInt8);
    CHECK(back.dims == images.dims);
    CHECK(back.bytes == images.bytes);
  }
  // A gzip file must really be compressed (not passed through): its bytes differ.
  CHECK(read_raw(dir.path / "a.idx.gz") != encoded);
}

TEST_CASE("IDX errors name the file and say what was expected") {
  TempDir dir;
  const std::vector<std::uint8_t> good = dp::data::encode_idx(make_images(3, 2, 2));

  SUBCASE("missing file") {
    const fs::path p = dir.path / "nope-idx3-ubyte";
    const std::string msg = error_of([&] { dp::data::read_idx(p); });
    CHECK(has(msg, p.string()));
    CHECK(has(msg, "no such file"));
  }
  SUBCASE("truncated at several points, plain and gzip") {
    // 0: empty; 2: inside the magic; 9: inside the dims; 16: header only; last byte gone.
    for (std::size_t cut : {std::size_t{0}, std::size_t{2}, std::size_t{9}, std::size_t{16},
                            good.size() - 1}) {
      CAPTURE(cut);
      const std::vector<std::uint8_t> part(good.begin(), good.begin() + static_cast<long>(cut));
      for (bool gz : {false, true}) {
        CAPTURE(gz);
        const fs::path p = dir.path / (std::string("cut") + (gz ? ".gz" : ""));
        gz ? write_gzip(p, part) : write_plain(p, part);
        const std::string msg = error_of([&] { dp::data::read_idx(p); });
        CHECK(has(msg, p.string()));
        CHECK(has(msg, "truncated"));
        CHECK(has(msg, "expected"));
      }
    }
  }
  SUBCASE("a truncated gzip stream") {
    const fs::path full = dir.path / "full.gz";
    write_gzip(full, good);
    std::vector<std::uint8_t> raw = read_raw(full);
    for (std::size_t keep : {raw.size() - 4, raw.size() / 2}) {
      CAPTURE(keep);
      const fs::path p = dir.path / "short.gz";
      write_plain(p, std::vector<std::uint8_t>(raw.begin(), raw.begin() + static_cast<long>(keep)));
      const std::string msg = error_of([&] { dp::data::read_idx(p); });
      CHECK(has(msg, p.string()));
      CHECK(has(msg, "truncated"));
    }
  }
  SUBCASE("bad magic") {
    std::vector<std::uint8_t> bad = good;
    bad[0] = 0x1f;
    std::string msg = error_of([&] { dp::data::parse_idx(bad.data(), bad.size(), "m.idx"); });
    CHECK(has(msg, "m.idx"));
    CHECK(has(msg, "bad magic"));
    CHECK(has(msg, "0x1f"));
    bad = good;
    bad[2] = 0x07;  // unknown dtype
    msg = error_of([&] { dp::data::parse_idx(bad.data(), bad.size(), "m.idx"); });
    CHECK(has(msg, "bad magic"));
    bad = good;
    bad[3] = 0;  // zero dims
    msg = error_of([&] { dp::data::parse_idx(bad.data(), bad.size(), "m.idx"); });
    CHECK(has(msg, "bad magic"));
  }
  SUBCASE("dims that do not match the data") {
    std::vector<std::uint8_t> bad = good;
    bad.push_back(0);  // one byte too many
    std::string msg = error_of([&] { dp::data::parse_idx(bad.data(), bad.size(), "t.idx"); });
    CHECK(has(msg, "trailing bytes"));
    CHECK(has(msg, "expected 12 data bytes"));
    CHECK(has(msg, "got 13"));
  }
  SUBCASE("dims whose product overflows") {
    // float64, 3 dims of 0xffffffff: 2^96 * 8 bytes.
    std::vector<std::uint8_t> bad(4 + 12 + 64, 0);
    bad[2] = 0x0E;
    bad[3] = 3;
    std::fill(bad.begin() + 4, bad.begin() + 16, std::uint8_t{0xff});
    const std::string msg = error_of([&] { dp::data::parse_idx(bad.data(), bad.size(), "o.idx"); });
    CHECK(has(msg, "overflow"));
    CHECK(has(msg, "o.idx"));
  }
}

TEST_CASE("MnistDataset loads a directory of gzip or plain files") {
  TempDir dir;
  const IdxArray images = make_images(12, 28, 28);
  const IdxArray labels = make_labels(12);
  write_gzip(dir.path / "train-images-idx3-ubyte.gz", dp::data::encode_idx(images));
  write_gzip(dir.path / "train-labels-idx1-ubyte.gz", dp::data::encode_idx(labels));
  write_plain(dir.path / "t10k-images-idx3-ubyte", dp::data::encode_idx(make_images(4, 28, 28)));
  write_plain(dir.path / "t10k-labels-idx1-ubyte", dp::data::encode_idx(make_labels(4)));

  const dp::data::MnistDataset train(dir.path, dp::data::Split::Train);
  const dp::data::MnistDataset test(dir.path, dp::data::Split::Test);
  CHECK(train.size() == 12);
  CHECK(test.size() == 4);
  CHECK(train.example_shape() == dp::Shape{1, 28, 28});
  CHECK(train.num_classes() == 10);

  const std::vector<std::int64_t> idx = {11, 0, 11};
  auto [x, y] = train.get_batch(idx);
  CHECK(x.shape() == dp::Shape{3, 1, 28, 28});
  CHECK(x.dtype() == dp::Dtype::Float32);
  CHECK(x.device() == dp::cpu(0));
  CHECK(y.shape() == dp::Shape{3});
  CHECK(y.dtype() == dp::Dtype::Int64);
  CHECK(y.to_vector_i64() == std::vector<std::int64_t>{1, 0, 1});
  const std::vector<float> v = x.to_vector();
  for (std::size_t b = 0; b < 3; ++b) {
    for (std::size_t j = 0; j < 784; j += 97) {
      const std::size_t i = static_cast<std::size_t>(idx[b]);
      CHECK(v[b * 784 + j] == static_cast<float>(images.bytes[i * 784 + j]) / 255.0f);
    }
  }
  const std::vector<std::int64_t> bad = {12};
  CHECK(has(error_of([&] { (void)train.get_batch(bad); }), "out of range"));
}

TEST_CASE("MnistDataset rejects inconsistent files") {
  SUBCASE("count mismatch") {
    const std::string msg = error_of(
        [] { dp::data::MnistDataset(make_images(5, 28, 28), make_labels(4), "mm"); });
    CHECK(has(msg, "5 images"));
    CHECK(has(msg, "4 labels"));
  }
  SUBCASE("label out of range") {
    IdxArray labels = make_labels(5);
    labels.bytes[3] = 10;
    const std::string msg =
        error_of([&] { dp::data::MnistDataset(make_images(5, 28, 28), labels, "lab"); });
    CHECK(has(msg, "label 10 of example 3"));
    CHECK(has(msg, "[0, 10)"));
  }
  SUBCASE("images and labels swapped") {
    const std::string msg =
        error_of([] { dp::data::MnistDataset(make_labels(5), make_images(5, 28, 28), "sw"); });
    CHECK(has(msg, "expected uint8 images with 3 dims"));
  }
  SUBCASE("missing directory and missing file") {
    TempDir dir;
    std::string msg = error_of(
        [&] { dp::data::MnistDataset(dir.path / "absent", dp::data::Split::Train); });
    CHECK(has(msg, "does not exist"));
    write_plain(dir.path / "train-images-idx3-ubyte", dp::data::encode_idx(make_images(2, 28, 28)));
    msg = error_of([&] { dp::data::MnistDataset(dir.path, dp::data::Split::Train); });
    CHECK(has(msg, "train-labels-idx1-ubyte"));
  }
}

TEST_CASE("default_fashion_mnist_dir honours DP_DATA_DIR") {
  const char* old = std::getenv("DP_DATA_DIR");
  const std::string saved = old ? old : "";
  ::setenv("DP_DATA_DIR", "/tmp/somewhere", 1);
  CHECK(dp::data::default_fashion_mnist_dir() == fs::path("/tmp/somewhere"));
  ::unsetenv("DP_DATA_DIR");
  CHECK(dp::data::default_fashion_mnist_dir() == fs::path("/usr/share/datasets/fashion-mnist"));
  if (old) ::setenv("DP_DATA_DIR", saved.c_str(), 1);
}

TEST_CASE("an explicit directory wins over DP_DATA_DIR, and errors say so") {
  const char* old = std::getenv("DP_DATA_DIR");
  const std::string saved = old ? old : "";
  TempDir data, other;
  write_plain(data.path / "train-images-idx3-ubyte", dp::data::encode_idx(make_images(3, 28, 28)));
  write_plain(data.path / "train-labels-idx1-ubyte", dp::data::encode_idx(make_labels(3)));
  ::setenv("DP_DATA_DIR", data.path.c_str(), 1);

  // The default directory follows DP_DATA_DIR and loads from it.
  CHECK(dp::data::MnistDataset(dp::data::default_fashion_mnist_dir(), dp::data::Split::Train).size() == 3);

  // An explicit directory is used as given: DP_DATA_DIR (which holds valid files) is not
  // consulted, and the error does not suggest setting it.
  std::string msg =
      error_of([&] { dp::data::MnistDataset(other.path / "absent", dp::data::Split::Train); });
  CHECK(has(msg, (other.path / "absent").string()));
  CHECK(has(msg, "explicit directory is used as given"));
  CHECK_FALSE(has(msg, "set DP_DATA_DIR"));
  msg = error_of([&] { dp::data::MnistDataset(other.path, dp::data::Split::Train); });
  CHECK(has(msg, "train-images-idx3-ubyte"));
  CHECK_FALSE(has(msg, "set DP_DATA_DIR"));

  // The default directory, missing: now setting DP_DATA_DIR is the advice that helps.
  ::setenv("DP_DATA_DIR", (other.path / "absent").c_str(), 1);
  msg = error_of(
      [&] { dp::data::MnistDataset(dp::data::default_fashion_mnist_dir(), dp::data::Split::Train); });
  CHECK(has(msg, "set DP_DATA_DIR"));

  if (old) ::setenv("DP_DATA_DIR", saved.c_str(), 1);
  else ::unsetenv("DP_DATA_DIR");
}

TEST_CASE("the real Fashion-MNIST files load") {
  const fs::path dir = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(dir / "train-images-idx3-ubyte.gz") && !fs::exists(dir / "train-images-idx3-ubyte")) {
    MESSAGE("skipped: no Fashion-MNIST in ", dir.string());
    return;
  }
  for (auto [split, n] : {std::pair{dp::data::Split::Train, std::int64_t{60000}},
                          std::pair{dp::data::Split::Test, std::int64_t{10000}}}) {
    CAPTURE(n);
    const dp::data::MnistDataset ds(dir, split);
    REQUIRE(ds.size() == n);
    CHECK(ds.example_shape() == dp::Shape{1, 28, 28});
    std::array<std::int64_t, 10> histogram{};
    float lo = 1.0f, hi = 0.0f;
    constexpr std::int64_t kChunk = 5000;
    for (std::int64_t start = 0; start < n; start += kChunk) {
      std::vector<std::int64_t> idx(kChunk);
      for (std::int64_t i = 0; i < kChunk; ++i) idx[static_cast<std::size_t>(i)] = start + i;
      auto [x, y] = ds.get_batch(idx);
      for (float p : x.to_vector()) {
        lo = std::min(lo, p);
        hi = std::max(hi, p);
      }
      for (std::int64_t label : y.to_vector_i64()) {
        REQUIRE(label >= 0);
        REQUIRE(label < 10);
        ++histogram[static_cast<std::size_t>(label)];
      }
    }
    for (std::int64_t count : histogram) CHECK(count == n / 10);
    CHECK(lo == 0.0f);
    CHECK(hi == 1.0f);
  }
}
