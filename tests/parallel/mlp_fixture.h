// tests/parallel/mlp_fixture.h — the small MLP and batches the DataParallel suites share.
//
// 6-16-8-3: 275 parameters in three Linear layers. With tiny bucket caps they span
// several DDP buckets; on 4 devices the Sharded ranges (80 elements, a multiple of
// 16) cut through weights and gather units. Labels are deterministic in (row, seed).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "dp/dp.h"

namespace {

std::shared_ptr<dp::nn::Sequential> make_mlp(std::uint64_t seed) {
  dp::Generator gen(seed);
  auto net = std::make_shared<dp::nn::Sequential>();
  net->push_back(std::make_shared<dp::nn::Linear>(6, 16, true, &gen));
  net->push_back(std::make_shared<dp::nn::ReLU>());
  net->push_back(std::make_shared<dp::nn::Linear>(16, 8, true, &gen));
  net->push_back(std::make_shared<dp::nn::ReLU>());
  net->push_back(std::make_shared<dp::nn::Linear>(8, 3, true, &gen));
  return net;
}

struct Batch {
  dp::Tensor x, y;
};

Batch make_batch(std::int64_t rows, std::uint64_t seed, std::int64_t features = 6, std::int64_t classes = 3) {
  dp::Generator gen(seed);
  dp::Tensor x = dp::randn({rows, features}, gen, dp::cpu(0));
  std::vector<std::int64_t> labels(static_cast<std::size_t>(rows));
  for (std::int64_t i = 0; i < rows; ++i)
    labels[static_cast<std::size_t>(i)] = (i * 7 + static_cast<std::int64_t>(seed)) % classes;
  return {x, dp::from_vector(labels, {rows}, dp::cpu(0))};
}

dp::Tensor loss_fn(const dp::Tensor& out, const dp::Tensor& y) { return dp::nn::cross_entropy(out, y); }

}  // namespace
