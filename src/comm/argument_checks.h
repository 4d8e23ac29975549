// src/comm/argument_checks.h — what the communicators whose ranks meet in a rendezvous
// share about checking a call.
//
// Internal header of the comm layer. Each rank's own arguments are checked once, by
// Communicator's front (Note [Checked collectives], communicator.cpp). What is left
// needs every rank's call at once: the local, hierarchical and cuda-copy communicators
// publish a CallShape per rank (or the rank's problem) in their rendezvous, and every
// rank judges the same snapshot with rendezvous_problem(), so a bad argument or a
// mismatch fails every rank alike with the same words.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dp/comm/communicator.h"
#include "dp/core/error.h"
#include "dp/tensor/tensor.h"

namespace dp::comm {

/// "sum" or "avg", as the communicators' messages name a reduction.
inline const char* op_name(ReduceOp op) { return op == ReduceOp::Sum ? "sum" : "avg"; }

/// True when the byte ranges [a, a + na) and [b, b + nb) share a byte.
inline bool overlaps(const void* a, std::size_t na, const void* b, std::size_t nb) {
  if (na == 0 || nb == 0 || a == nullptr || b == nullptr) return false;
  const auto* pa = static_cast<const std::byte*>(a);
  const auto* pb = static_cast<const std::byte*>(b);
  return pa < pb + nb && pb < pa + na;
}

/// One rank's call as its peers compare it: the collective, its element type and
/// count (what count measures is the communicator's own choice, the same on every
/// rank), and the root and op where the collective has them.
struct CallShape {
  Communicator::Collective kind = Communicator::Collective::AllReduce;
  Dtype dtype = Dtype::Float32;
  ReduceOp op = ReduceOp::Sum;
  int root = 0;
  std::int64_t count = 0;
};

inline bool has_root(Communicator::Collective k) {
  return k == Communicator::Collective::Broadcast || k == Communicator::Collective::Reduce;
}
inline bool has_op(Communicator::Collective k) {
  return k != Communicator::Collective::Broadcast && k != Communicator::Collective::AllGather;
}

/// "all_reduce(count 10, float32, sum)", "broadcast(count 4, int64, root 0)".
inline std::string describe(const CallShape& c) {
  std::string d = dp::detail::str_cat(Communicator::collective_name(c.kind), "(count ", c.count, ", ",
                                      dtype_name(c.dtype));
  if (has_root(c.kind)) d += dp::detail::str_cat(", root ", c.root);
  if (has_op(c.kind)) d += dp::detail::str_cat(", ", op_name(c.op));
  return d + ")";
}

inline bool same_call(const CallShape& a, const CallShape& b) {
  return a.kind == b.kind && a.dtype == b.dtype && a.count == b.count &&
         (!has_root(a.kind) || a.root == b.root) && (!has_op(a.kind) || a.op == b.op);
}

/// The verdict of a rendezvous on `rank`, the same words on every rank: "" when every
/// rank's arguments passed (slots[r].error empty) and every rank made the same call as
/// rank 0 (slots[r].call, a CallShape); else this rank's own problem, another rank's
/// ("<who(r)> failed: ..."), or the first disagreement. `who(r)` names rank r ("rank 2
/// (cpu:2)").
template <typename Slot, typename Who>
std::string rendezvous_problem(int rank, const std::vector<Slot>& slots, const Who& who) {
  auto at = [&](int r) -> const Slot& { return slots[static_cast<std::size_t>(r)]; };
  const int ranks = static_cast<int>(slots.size());
  if (!at(rank).error.empty()) return at(rank).error;
  for (int r = 0; r < ranks; ++r)
    if (!at(r).error.empty()) return dp::detail::str_cat(who(r), " failed: ", at(r).error);
  for (int r = 1; r < ranks; ++r) {
    if (same_call(at(0).call, at(r).call)) continue;
    return dp::detail::str_cat("ranks disagree: ", who(0), " called ", describe(at(0).call), ", ", who(r), " called ",
                               describe(at(r).call), "; every rank must make the same collective calls in the same ",
                               "order with the same sizes");
  }
  return {};
}

}  // namespace dp::comm
