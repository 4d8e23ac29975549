// dp/data/text.h — text for language models: a character tokenizer and a dataset of
// next-token windows over a token stream.
//
// A CharTokenizer maps each distinct byte of a corpus to an id (the bytes in increasing
// order, so the same text always gives the same vocabulary); a TokenDataset cuts a
// token stream into windows of `block_size` tokens, example i being tokens [i, i + T)
// and its target the same window one token later, as GPT training reads it. This header
// knows nothing about nn, optim or DataParallel.
//
//   std::string text = dp::data::read_text("corpus.txt");
//   dp::data::CharTokenizer tok(text);
//   auto ids = tok.encode_tensor(text);                         // (n) int64
//   auto train = std::make_shared<dp::data::TokenDataset>(ids.narrow(0, 0, n * 9 / 10), 128);
//   auto [x, y] = train->get_batch(std::vector<std::int64_t>{0, 7});  // x, y: (2, 128) int64
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dp/data/dataset.h"

namespace dp::data {

/// Reads a text file whole (gzip-compressed files are inflated). Throws dp::Error naming
/// the file when it is missing, unreadable or empty.
std::string read_text(const std::filesystem::path& path);

/// Character-level (byte-level) tokenizer: id k is the k-th smallest distinct byte of the
/// text it was built from.
class CharTokenizer {
 public:
  /// The vocabulary of `text`'s distinct bytes. Throws dp::Error on an empty text.
  explicit CharTokenizer(std::string_view text);

  /// Number of ids, 1 to 256.
  std::int64_t vocab_size() const { return static_cast<std::int64_t>(bytes_.size()); }
  /// The ids of `text`'s bytes. Throws dp::Error naming the first byte outside the
  /// vocabulary and its position.
  std::vector<std::int64_t> encode(std::string_view text) const;
  /// encode() as a 1-d int64 tensor on cpu(0).
  Tensor encode_tensor(std::string_view text) const;
  /// The text of `ids`. Throws dp::Error naming the first id outside [0, vocab_size()).
  std::string decode(std::span<const std::int64_t> ids) const;
  /// The vocabulary as one string of its bytes in id order: what a checkpoint stores to
  /// rebuild the same tokenizer with from_vocabulary().
  const std::string& vocabulary() const { return bytes_; }
  /// The tokenizer whose vocabulary() is `vocab`. Throws dp::Error when `vocab` is empty
  /// or not strictly increasing bytes (not a vocabulary() string).
  static CharTokenizer from_vocabulary(std::string_view vocab);

 private:
  CharTokenizer() = default;
  void index();
  std::string bytes_;                 // id -> byte
  std::array<std::int16_t, 256> id_;  // byte -> id, -1 when absent
};

/// Next-token windows over a token stream: example i is tokens [i, i + block_size), its
/// target tokens [i + 1, i + block_size + 1). size() is n - block_size windows, one per
/// start position (a random sampler then draws windows at random offsets, as nanoGPT
/// does).
class TokenDataset : public Dataset {
 public:
  /// `tokens`: a 1-d int64 (or int32, widened) tensor of n > block_size ids, kept on
  /// cpu(0). `vocab_size` (0: unchecked) bounds every id: an id outside
  /// [0, vocab_size) is a dp::Error naming its position. Throws dp::Error for a
  /// block_size < 1, a stream of n <= block_size tokens, or a tensor that is not 1-d
  /// integer.
  TokenDataset(Tensor tokens, std::int64_t block_size, std::int64_t vocab_size = 0);

  std::int64_t size() const override { return windows_; }
  /// (block_size)
  Shape example_shape() const override { return {block_}; }
  Dtype example_dtype() const override { return Dtype::Int64; }
  /// (block_size): one next token per position.
  Shape target_shape() const override { return {block_}; }
  std::int64_t num_classes() const override { return vocab_; }
  Batch get_batch(std::span<const std::int64_t> indices) const override;

  std::int64_t block_size() const { return block_; }
  /// The token stream (n) int64 on cpu(0).
  const Tensor& tokens() const { return tokens_; }

 private:
  Tensor tokens_;
  std::int64_t block_ = 0;
  std::int64_t windows_ = 0;
  std::int64_t vocab_ = 0;
};

}  // namespace dp::data
