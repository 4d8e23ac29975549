#include "dp/data/text.h"

#include <cstring>

#include "dp/core/error.h"

namespace dp::data {

namespace {

// "'a'" for a printable byte, "0x0a" otherwise.
std::string byte_str(unsigned char c) {
  if (c >= 0x20 && c < 0x7F) return std::string("'") + static_cast<char>(c) + "'";
  static const char* hex = "0123456789abcdef";
  return std::string("0x") + hex[c >> 4] + hex[c & 15];
}

}  // namespace

std::string read_text(const std::filesystem::path& path) {
  std::vector<std::uint8_t> bytes = read_file_bytes(path);
  DP_CHECK(!bytes.empty(), "read_text: '", path.string(), "' is empty; expected a text file with at least one byte");
  return std::string(bytes.begin(), bytes.end());
}

// ---- CharTokenizer --------------------------------------------------------------------

CharTokenizer::CharTokenizer(std::string_view text) {
  DP_CHECK(!text.empty(), "CharTokenizer: expected a non-empty text to take the vocabulary from, got an empty one");
  std::array<bool, 256> seen{};
  for (char c : text) seen[static_cast<unsigned char>(c)] = true;
  for (int b = 0; b < 256; ++b)
    if (seen[static_cast<std::size_t>(b)]) bytes_.push_back(static_cast<char>(b));
  index();
}

CharTokenizer CharTokenizer::from_vocabulary(std::string_view vocab) {
  DP_CHECK(!vocab.empty(), "CharTokenizer::from_vocabulary: expected the vocabulary() string of a tokenizer, got "
           "an empty string");
  for (std::size_t i = 1; i < vocab.size(); ++i) {
    const auto prev = static_cast<unsigned char>(vocab[i - 1]), cur = static_cast<unsigned char>(vocab[i]);
    DP_CHECK(prev < cur, "CharTokenizer::from_vocabulary: expected strictly increasing bytes (a vocabulary() "
             "string), got ", byte_str(cur), " after ", byte_str(prev), " at position ", i);
  }
  CharTokenizer t;
  t.bytes_.assign(vocab.begin(), vocab.end());
  t.index();
  return t;
}

void CharTokenizer::index() {
  id_.fill(-1);
  for (std::size_t i = 0; i < bytes_.size(); ++i)
    id_[static_cast<unsigned char>(bytes_[i])] = static_cast<std::int16_t>(i);
}

std::vector<std::int64_t> CharTokenizer::encode(std::string_view text) const {
  std::vector<std::int64_t> ids(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    const std::int16_t id = id_[c];
    DP_CHECK(id >= 0, "CharTokenizer::encode: byte ", byte_str(c), " at position ", i,
             " is not in the vocabulary of ", bytes_.size(), " bytes; expected only bytes of the text the "
             "tokenizer was built from");
    ids[i] = id;
  }
  return ids;
}

Tensor CharTokenizer::encode_tensor(std::string_view text) const {
  std::vector<std::int64_t> ids = encode(text);
  const auto n = static_cast<std::int64_t>(ids.size());
  return from_vector(ids, {n}, cpu(0));
}

std::string CharTokenizer::decode(std::span<const std::int64_t> ids) const {
  std::string out(ids.size(), '\0');
  for (std::size_t i = 0; i < ids.size(); ++i) {
    DP_CHECK(ids[i] >= 0 && ids[i] < vocab_size(), "CharTokenizer::decode: id ", ids[i], " at position ", i,
             " is outside the vocabulary; expected an id in [0, ", vocab_size(), ")");
    out[i] = bytes_[static_cast<std::size_t>(ids[i])];
  }
  return out;
}

// ---- TokenDataset ---------------------------------------------------------------------

TokenDataset::TokenDataset(Tensor tokens, std::int64_t block_size, std::int64_t vocab_size)
    : block_(block_size), vocab_(vocab_size) {
  DP_CHECK(tokens.defined(), "TokenDataset: expected a 1-d int64 tensor of token ids, got an undefined tensor");
  DP_CHECK((tokens.dtype() == Dtype::Int64 || tokens.dtype() == Dtype::Int32) && tokens.dim() == 1,
           "TokenDataset: expected a 1-d int64 (or int32) tensor of token ids, got ", tokens.str());
  DP_CHECK(block_size >= 1, "TokenDataset: expected a block_size of at least 1, got ", block_size);
  DP_CHECK(vocab_size >= 0, "TokenDataset: expected a vocab_size >= 0 (0: unchecked), got ", vocab_size);
  const std::int64_t n = tokens.size(0);
  DP_CHECK(n > block_size, "TokenDataset: a stream of ", n, " tokens holds no window of ", block_size,
           " tokens and its next tokens; expected more than ", block_size, " tokens");
  tokens_ = tokens.detach().to(cpu(0)).to(Dtype::Int64).clone();  // its own copy: later edits of `tokens` do not reach it
  windows_ = n - block_size;
  if (vocab_ > 0) {
    const std::int64_t* t = tokens_.data<std::int64_t>();
    for (std::int64_t i = 0; i < n; ++i)
      DP_CHECK(t[i] >= 0 && t[i] < vocab_, "TokenDataset: token ", t[i], " at position ", i,
               " is outside the vocabulary; expected an id in [0, ", vocab_, ")");
  }
}

Batch TokenDataset::get_batch(std::span<const std::int64_t> indices) const {
  check_indices(indices, "TokenDataset::get_batch");
  Batch batch = allocate_batch(static_cast<std::int64_t>(indices.size()));
  const std::int64_t* src = tokens_.data<std::int64_t>();
  std::int64_t* x = batch.data.data<std::int64_t>();
  std::int64_t* y = batch.target.data<std::int64_t>();
  const auto row = static_cast<std::size_t>(block_);
  for (std::size_t b = 0; b < indices.size(); ++b) {
    const std::int64_t* window = src + indices[b];
    std::memcpy(x + b * row, window, row * sizeof(std::int64_t));
    std::memcpy(y + b * row, window + 1, row * sizeof(std::int64_t));
  }
  return batch;
}

}  // namespace dp::data
