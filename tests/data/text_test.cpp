// tests/data/text_test.cpp — CharTokenizer, TokenDataset and read_text: round trips,
// window contents, loaders and samplers over token windows, and every bad input.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dp/data/dataloader.h"
#include "dp/data/sampler.h"
#include "dp/core/error.h"
#include "dp/data/text.h"
#include "test_errors.h"

namespace {

using dp::data::CharTokenizer;
using dp::data::TokenDataset;

std::vector<std::int64_t> ints(const dp::Tensor& t) {
  const std::int64_t* p = t.data<std::int64_t>();
  return {p, p + t.numel()};
}

}  // namespace

TEST_CASE("CharTokenizer: sorted distinct bytes, round trips, the vocabulary string") {
  const std::string text = "hello, world\n";
  CharTokenizer tok(text);
  CHECK(tok.vocab_size() == 10);  // \n space , d e h l o r w
  CHECK(tok.vocabulary() == std::string("\n ,dehlorw"));
  const std::vector<std::int64_t> ids = tok.encode("hello");
  CHECK(ids == std::vector<std::int64_t>{5, 4, 6, 6, 7});
  CHECK(tok.decode(ids) == "hello");
  CHECK(tok.decode(tok.encode(text)) == text);
  dp::Tensor t = tok.encode_tensor("lol");
  CHECK(t.dtype() == dp::Dtype::Int64);
  CHECK(t.shape() == dp::Shape{3});
  CHECK(ints(t) == std::vector<std::int64_t>{6, 7, 6});

  // Every byte value, including NUL and bytes >= 0x80 (UTF-8 pieces).
  std::string all;
  for (int b = 255; b >= 0; --b) all.push_back(static_cast<char>(b));
  CharTokenizer full(all);
  CHECK(full.vocab_size() == 256);
  CHECK(full.encode(std::string(1, '\0')) == std::vector<std::int64_t>{0});
  CHECK(full.encode("\xff") == std::vector<std::int64_t>{255});
  CHECK(full.decode(full.encode(all)) == all);

  CharTokenizer again = CharTokenizer::from_vocabulary(tok.vocabulary());
  CHECK(again.vocabulary() == tok.vocabulary());
  CHECK(again.encode(text) == tok.encode(text));
}

TEST_CASE("CharTokenizer: bad input names what was expected and what came") {
  CHECK(dp_test::throws_with([] { CharTokenizer t(""); }, {"non-empty text"}));
  CharTokenizer tok("abc");
  CHECK(dp_test::throws_with([&] { (void)tok.encode("abxc"); }, {"'x'", "position 2"}));
  CHECK(dp_test::throws_with([&] { (void)tok.encode(std::string("a\n")); }, {"0x0a"}));
  std::vector<std::int64_t> bad{0, 3};
  CHECK(dp_test::throws_with([&] { (void)tok.decode(bad); }, {"id 3 at position 1", "[0, 3)"}));
  bad = {-1};
  CHECK(dp_test::throws_with([&] { (void)tok.decode(bad); }, {"id -1"}));
  CHECK(dp_test::throws_with([] { (void)CharTokenizer::from_vocabulary(""); }, {"empty"}));
  CHECK(dp_test::throws_with([] { (void)CharTokenizer::from_vocabulary("acb"); }, {"strictly increasing", "position 2"}));
  CHECK(dp_test::throws_with([] { (void)CharTokenizer::from_vocabulary("aa"); }, {"strictly increasing"}));
}

TEST_CASE("TokenDataset: window i is tokens [i, i+T), its target one token later") {
  std::vector<std::int64_t> stream;
  for (std::int64_t i = 0; i < 20; ++i) stream.push_back((i * 7) % 11);
  TokenDataset ds(dp::from_vector(stream, {20}), 4, 11);
  CHECK(ds.size() == 16);
  CHECK(ds.example_shape() == dp::Shape{4});
  CHECK(ds.target_shape() == dp::Shape{4});
  CHECK(ds.example_dtype() == dp::Dtype::Int64);
  CHECK(ds.num_classes() == 11);
  std::vector<std::int64_t> idx{15, 0, 3, 3};
  auto [x, y] = ds.get_batch(idx);
  CHECK(x.shape() == dp::Shape{4, 4});
  CHECK(y.shape() == dp::Shape{4, 4});
  CHECK(x.dtype() == dp::Dtype::Int64);
  CHECK(y.dtype() == dp::Dtype::Int64);
  const std::vector<std::int64_t> xs = ints(x), ys = ints(y);
  for (std::size_t b = 0; b < idx.size(); ++b)
    for (std::size_t t = 0; t < 4; ++t) {
      CHECK(xs[b * 4 + t] == stream[static_cast<std::size_t>(idx[b]) + t]);
      CHECK(ys[b * 4 + t] == stream[static_cast<std::size_t>(idx[b]) + t + 1]);
    }

  // A narrowed stream (a train/validation split) and int32 ids; the dataset keeps its own
  // copy, so editing the source afterwards changes nothing.
  dp::Tensor src = dp::from_vector(stream, {20});
  TokenDataset val(src.narrow(0, 12, 8), 3);
  CHECK(val.size() == 5);
  std::vector<std::int64_t> first{0};
  CHECK(ints(val.get_batch(first).data) == std::vector<std::int64_t>{stream[12], stream[13], stream[14]});
  src.data<std::int64_t>()[12] = 99;
  CHECK(ints(val.get_batch(first).data)[0] == stream[12]);
  std::vector<std::int32_t> small{1, 2, 3};
  TokenDataset i32(dp::from_vector(small, {3}), 2);
  CHECK(ints(i32.get_batch(first).target) == std::vector<std::int64_t>{2, 3});
}

TEST_CASE("TokenDataset: bad input") {
  std::vector<std::int64_t> s{0, 1, 2, 3};
  CHECK(dp_test::throws_with([] { TokenDataset d(dp::Tensor(), 2); }, {"undefined"}));
  CHECK(dp_test::throws_with([&] { TokenDataset d(dp::from_vector(s, {2, 2}), 1); }, {"1-d int64"}));
  std::vector<float> f{0, 1, 2};
  CHECK(dp_test::throws_with([&] { TokenDataset d(dp::from_vector(f, {3}), 1); }, {"1-d int64"}));
  CHECK(dp_test::throws_with([&] { TokenDataset d(dp::from_vector(s, {4}), 0); }, {"block_size of at least 1, got 0"}));
  CHECK(dp_test::throws_with([&] { TokenDataset d(dp::from_vector(s, {4}), 4); }, {"4 tokens", "more than 4"}));
  CHECK(dp_test::throws_with([&] { TokenDataset d(dp::from_vector(s, {4}), 2, 3); }, {"token 3 at position 3"}));
  std::vector<std::int64_t> neg{0, -2, 1};
  CHECK(dp_test::throws_with([&] { TokenDataset d(dp::from_vector(neg, {3}), 1, 5); }, {"token -2"}));
  CHECK(dp_test::throws_with([&] { TokenDataset d(dp::from_vector(s, {4}), 1, -1); }, {"vocab_size >= 0"}));
  TokenDataset ok(dp::from_vector(s, {4}), 2);
  std::vector<std::int64_t> out{2};
  CHECK(dp_test::throws_with([&] { (void)ok.get_batch(out); }, {"index 2"}));
}

TEST_CASE("TokenDataset through a DataLoader and a DistributedSampler") {
  std::vector<std::int64_t> stream(50);
  for (std::size_t i = 0; i < stream.size(); ++i) stream[i] = static_cast<std::int64_t>(i);
  auto ds = std::make_shared<TokenDataset>(dp::from_vector(stream, {50}), 5);
  dp::data::DataLoader loader(ds, {.batch_size = 8, .shuffle = true, .seed = 3});
  std::int64_t rows = 0;
  for (auto& [x, y] : loader) {
    CHECK(x.dim() == 2);
    CHECK(x.size(1) == 5);
    const std::vector<std::int64_t> xs = ints(x), ys = ints(y);
    for (std::size_t i = 0; i < xs.size(); ++i) CHECK(ys[i] == xs[i] + 1);  // the stream is 0, 1, 2, ...
    rows += x.size(0);
  }
  CHECK(rows == 45);
  dp::data::DistributedSampler part(ds->size(), 2, 1, {.shuffle = false});
  std::vector<std::int64_t> mine = part.indices();
  CHECK(!mine.empty());
  CHECK(ints(ds->get_batch(mine).data)[0] == mine[0]);
}

TEST_CASE("read_text: a file whole, and clear errors") {
  const auto dir = std::filesystem::temp_directory_path() / ("dp_text_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir / "a.txt") << "To be, or not to be\n";
    std::ofstream(dir / "empty.txt");
  }
  CHECK(dp::data::read_text(dir / "a.txt") == "To be, or not to be\n");
  CHECK(dp_test::throws_with([&] { (void)dp::data::read_text(dir / "empty.txt"); }, {"is empty"}));
  CHECK(dp_test::throws_with([&] { (void)dp::data::read_text(dir / "missing.txt"); }, {"no such file"}));
  std::filesystem::remove_all(dir);
}
