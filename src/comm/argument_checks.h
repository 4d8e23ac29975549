// src/comm/argument_checks.h — the argument checks the host-side communicators share.
//
// Internal header of the comm layer. The local and hierarchical communicators check
// every rank's tensors the same way and give the same messages; they hand the result
// to their rendezvous so that a bad argument on one rank fails every rank alike.
#pragma once

#include <cstdint>
#include <string>

#include "dp/core/error.h"
#include "dp/tensor/tensor.h"

namespace dp::comm {

/// True when the float ranges [a, a + na) and [b, b + nb) share an element.
/// "sum" or "avg", as the communicators' mismatch messages name a reduction.
inline const char* op_name(ReduceOp op) { return op == ReduceOp::Sum ? "sum" : "avg"; }

inline bool overlaps(const float* a, std::int64_t na, const float* b, std::int64_t nb) {
  if (na == 0 || nb == 0 || a == nullptr || b == nullptr) return false;
  return a < b + nb && b < a + na;
}

/// "" when t is a defined float32 tensor on `dev`, else why not.
inline std::string tensor_problem(const Tensor& t, const char* name, Device dev) {
  if (!t.defined()) return dp::detail::str_cat(name, " is undefined; pass a float32 tensor on ", dev);
  if (t.dtype() != Dtype::Float32)
    return dp::detail::str_cat(name, " has dtype ", dtype_name(t.dtype()), "; collectives take float32 tensors");
  if (t.device() != dev)
    return dp::detail::str_cat(name, " lives on ", t.device(), " but this rank's device is ", dev,
                               "; move it with .to(", dev, ")");
  return {};
}

}  // namespace dp::comm
