// dp/nn/embedding.h — a lookup table of learned vectors: torch.nn.Embedding.
//
// Holds weight (num_embeddings, embedding_dim) initialised from N(0, 1) as PyTorch does
// (the padding row, if any, zeroed); forward looks up the rows of its integer input.
// Knows nothing of optimizers or DataParallel.
//
//   auto wte = std::make_shared<dp::nn::Embedding>(vocab, 128);
//   dp::Tensor tok = (*wte)(ids);                          // ids (B, T) int64 -> (B, T, 128)
//   auto pad = dp::nn::Embedding(dp::nn::EmbeddingOptions(vocab, 128).padding_idx(0));
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "dp/nn/module.h"

namespace dp::nn {

/// Options of Embedding in libtorch's builder style: EmbeddingOptions(1000, 64).padding_idx(0).
class EmbeddingOptions {
 public:
  EmbeddingOptions(std::int64_t num_embeddings, std::int64_t embedding_dim)
      : num_(num_embeddings), dim_(embedding_dim) {}
  /// The row that gets no gradient and starts as zeros (negative: counted from the end).
  EmbeddingOptions& padding_idx(std::int64_t v) { padding_ = v; return *this; }

  std::int64_t num_embeddings() const { return num_; }
  std::int64_t embedding_dim() const { return dim_; }
  std::optional<std::int64_t> padding_idx() const { return padding_; }

 private:
  std::int64_t num_, dim_;
  std::optional<std::int64_t> padding_;
};

/// out = weight[input]: input of any shape holding ids in [0, num_embeddings).
class Embedding : public Module {
 public:
  explicit Embedding(const EmbeddingOptions& options, Generator* gen = nullptr);
  Embedding(std::int64_t num_embeddings, std::int64_t embedding_dim, Generator* gen = nullptr);

  /// ids (...) int64 or int32 -> (..., embedding_dim).
  Tensor forward(const Tensor& input) override;
  /// "1000, 64" (", padding_idx=0" when set).
  std::string extra_repr() const override;

  /// The bound copy's weight (num_embeddings, embedding_dim).
  const Tensor& weight() const { return weight_.get(); }
  EmbeddingOptions options() const { return options_; }

 private:
  EmbeddingOptions options_;
  Parameter weight_;
};

}  // namespace dp::nn
