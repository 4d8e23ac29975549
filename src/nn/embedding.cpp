#include "dp/nn/embedding.h"

#include "dp/core/error.h"
#include "dp/nn/functional.h"
#include "dp/nn/init.h"
#include "dp/tensor/ops.h"

namespace dp::nn {

Embedding::Embedding(const EmbeddingOptions& o, Generator* gen) : options_(o) {
  const std::int64_t V = o.num_embeddings(), D = o.embedding_dim();
  DP_CHECK(V > 0 && D > 0, "Embedding: expected positive num_embeddings and embedding_dim, got ", V, " and ", D);
  if (o.padding_idx()) {
    const std::int64_t p = *o.padding_idx();
    DP_CHECK(p >= -V && p < V, "Embedding: expected padding_idx in [", -V, ", ", V, "), got ", p);
    options_.padding_idx(p < 0 ? p + V : p);
  }
  Tensor w = empty({V, D});
  init::normal_(w, 0.0, 1.0, gen ? *gen : default_generator());
  if (options_.padding_idx()) w.narrow(0, *options_.padding_idx(), 1).zero_();
  weight_ = register_parameter("weight", w);
}

Embedding::Embedding(std::int64_t num_embeddings, std::int64_t embedding_dim, Generator* gen)
    : Embedding(EmbeddingOptions(num_embeddings, embedding_dim), gen) {}

Tensor Embedding::forward(const Tensor& input) {
  DP_CHECK(input.defined(), "Embedding: expected a defined input, got an undefined tensor");
  return embedding(input, weight_.get(), options_.padding_idx());
}

std::string Embedding::extra_repr() const {
  std::string s = detail::str_cat(options_.num_embeddings(), ", ", options_.embedding_dim());
  if (options_.padding_idx()) s += detail::str_cat(", padding_idx=", *options_.padding_idx());
  return s;
}

}  // namespace dp::nn
