// dp/nn/flatten.h — merges trailing dims into one, e.g. (N, C, H, W) → (N, C·H·W).
//
// A parameter-free view (Tensor::flatten). Knows nothing of parameters or DataParallel.
//
//   auto flat = std::make_shared<dp::nn::Flatten>();   // start_dim = 1
#pragma once

#include <cstdint>
#include <string>

#include "dp/nn/module.h"

namespace dp::nn {

/// Flattens dims [start_dim, end_dim] (negative counts from the end) into one.
class Flatten : public Module {
 public:
  explicit Flatten(std::int64_t start_dim = 1, std::int64_t end_dim = -1)
      : start_(start_dim), end_(end_dim) {}
  Tensor forward(const Tensor& x) override { return x.flatten(start_, end_); }
  /// "start_dim=1, end_dim=-1".
  std::string extra_repr() const override;

 private:
  std::int64_t start_, end_;
};

}  // namespace dp::nn
