#include "dp/nn/utils.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "backend/backend.h"
#include "dp/autograd/grad_mode.h"
#include "dp/core/error.h"
#include "dp/tensor/ops.h"

namespace dp::nn::utils {
namespace {

// The `p`-norm of every element of g, as a 1-element tensor on g's device.
Tensor norm_of(const Tensor& g, double p) {
  Tensor flat = g.reshape({g.numel()});
  if (std::isinf(p)) return max(abs(flat), 0, /*keepdim=*/true);
  if (p == 2.0) return sqrt(sum(square(flat))).reshape({1});
  if (p == 1.0) return sum(abs(flat)).reshape({1});
  return pow(sum(pow(abs(flat), p)), 1.0 / p).reshape({1});
}

// |g|^p elementwise, the summand of a p-norm (|g| for the inf-norm, whose blocks take
// the max instead of the sum).
Tensor norm_terms(const Tensor& g, double p) {
  if (p == 2.0) return square(g);
  if (p == 1.0 || std::isinf(p)) return abs(g);
  return pow(abs(g), p);
}

// The runs of the set's flat buffers that the list's parameters cover, merged: a
// whole model's parameters are one run, so every copy is clipped in one call.
std::vector<std::pair<std::int64_t, std::int64_t>> flat_ranges(const ParameterList& params) {
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
  for (const auto& slot : params.slots()) ranges.emplace_back(slot->offset, slot->offset + slot->copies[0].numel());
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<std::int64_t, std::int64_t>> merged;
  for (const auto& r : ranges) {
    if (!merged.empty() && r.first <= merged.back().second) merged.back().second = std::max(merged.back().second, r.second);
    else merged.push_back(r);
  }
  return merged;
}

// The list's ranges that copy r steps, as views of the gradient of its span (Note
// [Copy spans] in dp/nn/copy_spans.h: the reduced gradient of its range in a sharded
// set, the whole gradient buffer otherwise), each with its first flat index, in
// ascending order. Only the span's gradient is indexed, relative to its `begin`; nothing
// here reads the parameters at all, so clipping gathers no unit on any device.
std::vector<std::pair<std::int64_t, Tensor>> owned_pieces(const CopySpan& c,
                                                          const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges) {
  std::vector<std::pair<std::int64_t, Tensor>> pieces;
  for (const auto& [lo, hi] : ranges) {
    const std::int64_t s = std::max(lo, c.begin), t = std::min(hi, c.end);
    if (s >= t) continue;
    const Tensor& owned = c.owned_grad();
    DP_ASSERT(owned.numel() == c.end - c.begin, "owned gradient of the copy on ", owned.device(), " has ",
              owned.numel(), " elements for its range [", c.begin, ", ", c.end, ")");
    pieces.emplace_back(s, owned.narrow(0, s - c.begin, t - s));
  }
  return pieces;
}

// Note [Clipping in blocks]
// The total norm of a parameter set is the p-norm of every element of the list's
// ranges (the same number as PyTorch's norm of per-parameter norms, rounded
// differently). To make it the same bits whether one copy holds the whole gradient
// (single device, DP, DDP) or each device holds its 1/N (Sharded), it is computed in
// blocks fixed by the flat index alone: block k is [16k, 16k + 16) (kNormBlock, on
// which every range a runtime cuts starts, so a shard boundary never cuts a block),
// clipped to the ranges. Each device reduces the blocks it owns (one partial per block, every partial a reduction of the same
// elements in the same order whatever N is), the partials travel to copy 0's device
// in flat order — (N-1)/N · P/16 floats, 1/16 of a gradient exchange — and one final
// reduction over that vector gives the total: the same vector, so the same bits, for
// every design and every N.
// Stage 3 (sharded parameters) is the same computation: between backward and step
// each device holds exactly the reduced gradient of its range, its span's gradient
// (the full buffer is released, stage 2's detached path), and the blocks and the partials'
// route do not depend on where the parameters live. Neither the norm nor the edit
// reads a parameter, so clipping gathers no unit: what it costs is the partials'
// exchange above, and each device scales or clamps its own range in place, which its
// optimizer step then reads. (A list taken from model.parameters() in stage 3
// gathers device 0's copy for the user until the next step; clipping does not need
// that: the list kept from before the loop, as the optimizer keeps it, does as well.)
// Across processes (stages 1 and 2; Note [Ranges across processes] in
// src/parallel/shard_store.h) a process holds the partials of its own devices' blocks only.
// Processes own ascending runs of ranges, so each process's partials, concatenated in
// process order (the set's ProcessExchange: a collective every process makes, one host
// exchange of P/16 floats in all), are again the vector in flat order, and the one
// final reduction runs over the same vector on every process: the same bits as DDP's
// norm across processes, which reduces that vector from copy 0's whole gradient.
// Stage 3 across processes shards within each process only (its owners hold whole
// sums of their ranges, Note [Stage 3 across processes]): nothing to exchange.
constexpr std::int64_t kBlock = kNormBlock;

// One partial per block of g, which starts at flat index `first`: (head, whole
// blocks, tail), each the sum (max for the inf-norm) of its terms.
Tensor block_partials(const Tensor& g, std::int64_t first, double p) {
  const bool inf = std::isinf(p);
  auto reduce_rows = [&](const Tensor& t, std::int64_t rows) {
    Tensor m = norm_terms(t, p).reshape({rows, t.numel() / rows});
    return inf ? max(m, 1) : sum(m, 1);
  };
  const std::int64_t n = g.numel();
  const std::int64_t head = std::min(n, (kBlock - first % kBlock) % kBlock);
  const std::int64_t body = (n - head) / kBlock * kBlock;
  const std::int64_t tail = n - head - body;
  std::vector<Tensor> parts;
  if (head > 0) parts.push_back(reduce_rows(g.narrow(0, 0, head), 1));
  if (body > 0) parts.push_back(reduce_rows(g.narrow(0, head, body), body / kBlock));
  if (tail > 0) parts.push_back(reduce_rows(g.narrow(0, head + body, tail), 1));
  return parts.size() == 1 ? parts[0] : cat(parts);
}

// The total norm of a set's gradients (Note [Clipping in blocks]), on the host.
double set_norm(ParameterSet& set, const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges, double p) {
  std::vector<Tensor> partials(set.num_copies());
  // Each copy on its own device (its worker under DataParallel). Uncut, every
  // persistent copy holds the same gradient: copy 0's is the one read.
  const bool cut = spans_cut(set);
  set.for_each_copy([&](int r) {
    if (!cut && r != 0) return;
    std::vector<Tensor> parts;
    for (const auto& [first, g] : owned_pieces(copy_span(set, r), ranges)) parts.push_back(block_partials(g, first, p));
    if (!parts.empty()) partials[r] = parts.size() == 1 ? parts[0] : cat(parts);
  });
  // Copies own ascending ranges, so copy order is flat order.
  const Device home = set.copy(0).device;
  std::vector<Tensor> all;
  for (const Tensor& t : partials)
    if (t.defined()) all.push_back(t.device() == home ? t : t.to(home));
  if (ProcessExchange* exchange = process_exchange(set)) {
    // Note [Clipping in blocks]: the other processes' partials, in process order.
    std::vector<float> mine;
    for (const Tensor& t : all) {
      const std::vector<float> part = t.to_vector();
      mine.insert(mine.end(), part.begin(), part.end());
    }
    std::vector<float> every;
    for (const std::vector<float>& part : exchange->gather(mine))
      every.insert(every.end(), part.begin(), part.end());
    all.clear();
    if (!every.empty()) all.push_back(from_vector(every, {static_cast<std::int64_t>(every.size())}, home));
  }
  if (all.empty()) return 0.0;
  Tensor v = all.size() == 1 ? all[0] : cat(all);
  if (std::isinf(p)) return max(v, 0).item();
  if (p == 2.0) return sqrt(sum(v)).item();
  if (p == 1.0) return sum(v).item();
  return pow(sum(v), 1.0 / p).item();
}

// Applies edit(view) to the list's gradients on every copy that an optimizer steps:
// each copy's whole gradient, or in a sharded set the owned range, which is all an
// optimizer step of that copy reads.
void edit_every_copy(const ParameterList& params, const std::function<void(Tensor&)>& edit) {
  NoGradGuard no_grad;
  const auto& set = params.set();
  if (!set) {
    for (const Tensor& p : params) {
      Tensor g = p.grad();
      if (g.defined()) edit(g);
    }
    return;
  }
  auto ranges = flat_ranges(params);
  set->for_each_copy([&](int r) {
    for (auto& [first, view] : owned_pieces(copy_span(*set, r), ranges)) edit(view);
  });
}

// Note [Gradients PyTorch would not see]
// PyTorch's clip_grad_norm_, clip_grad_value_ and GradScaler.unscale_ pass over the
// parameters whose .grad is not None. A set's gradients live in flat buffers and are
// never undefined; an entry PyTorch would hold None for is one that does not require
// grad (frozen) or that no gradient reached since zero_grad(true) (Note [Parameters
// without a gradient] in dp/optim/optimizer.h), and the optimizer skips it. These
// functions skip it too. Its buffer holds zeros, which change no norm, clamp or scale,
// until a NaN factor reaches it: clip_grad_norm_ of a NaN total multiplies what it
// passes over by NaN, and a frozen entry so poisoned made the next unscale_ find a NaN
// PyTorch has not, and skip a step PyTorch takes (the optimizer fuzzer, program 2496:
// frozen parameters, an overflow, no zero_grad() before the next step).
ParameterList with_a_gradient(const ParameterList& params) {
  const auto& set = params.set();
  if (!set) return params;
  set->collect_arrived_grads();
  std::vector<Tensor> tensors;
  std::vector<std::shared_ptr<Parameter::Slot>> slots;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!params[i].requires_grad() || !params.slots()[i]->got_grad) continue;
    tensors.push_back(params[i]);
    slots.push_back(params.slots()[i]);
  }
  return ParameterList(std::move(tensors), std::move(slots), set);
}

}  // namespace

double clip_grad_norm_(const ParameterList& given, double max_norm, double norm_type, bool error_if_nonfinite) {
  DP_CHECK(max_norm >= 0, "clip_grad_norm_: expected max_norm >= 0 (infinity: only measure), got ", max_norm);
  DP_CHECK(norm_type > 0, "clip_grad_norm_: expected norm_type > 0 (2 for the Euclidean norm, "
           "dp::nn::utils::kInfNorm for the largest element), got ", norm_type);
  NoGradGuard no_grad;
  const ParameterList params = with_a_gradient(given);
  double total = 0.0;
  if (const auto& set = params.set()) {
    total = set_norm(*set, flat_ranges(params), norm_type);
  } else {
    std::vector<Tensor> norms;
    for (const Tensor& p : params) {
      Tensor g = p.grad();
      if (g.defined() && g.numel() > 0) norms.push_back(norm_of(g.detach(), norm_type).to(params[0].device()));
    }
    if (norms.empty()) return 0.0;
    // As PyTorch: the norm of the per-parameter norms (the max of them for the inf-norm).
    total = norm_of(cat(norms), norm_type).item();
  }
  DP_CHECK(!error_if_nonfinite || std::isfinite(total), "clip_grad_norm_: the total norm of the gradients is ",
           total, "; check the loss and the data for NaN/Inf, or pass error_if_nonfinite = false");
  // In float32, as PyTorch computes clip_coef from a float32 total. PyTorch multiplies
  // every gradient by clamp(coef, max=1); by 1 changes nothing, so only a coef below 1 or
  // NaN is applied. A NaN total (a NaN in any gradient) makes every gradient NaN, as in
  // PyTorch: skipping the multiplication kept the others finite, so a loop that steps
  // again without zero_grad() (accumulating after a GradScaler skipped a step) stepped
  // where PyTorch's scaler skips again (the optimizer fuzzer, program 5335).
  const float coef = static_cast<float>(max_norm) / (static_cast<float>(total) + 1e-6f);
  if (!(coef >= 1.0f)) edit_every_copy(params, [coef](Tensor& g) { g.mul_(coef); });
  return total;
}

// Note [Unscaling with one read per device]
// Unscaling touches every gradient of a step (every parameter, or every owned piece of
// a set's copies), and on CUDA every host read is a synchronisation. Asking "did this
// gradient overflow?" gradient by gradient (count_nonfinite, synchronous by contract)
// would stall the host once per parameter — some 50 times in a GPT's step — and read
// each gradient twice, for the check and for the multiply. So each gradient goes
// through one backend op, ScaleFindNonfinite: one pass that multiplies in place and,
// where it meets a NaN or an infinity, sets a float32 flag in the device's memory that
// nothing clears. Each device gets one flag, zeroed once; all its gradients are
// enqueued against it; each flag is read once, after the work of every device has been
// queued — as PyTorch's _amp_foreach_non_finite_check_and_unscale_ fills one found_inf
// per device. A step is thus one host read per device however many parameters there
// are, and while the host waits for one device the others keep running. The answer is
// the per-gradient check's: any non-finite element before scaling, on any copy; every
// gradient is scaled even when one overflowed (the step is skipped anyway; PyTorch
// unscales them all too); the multiply gives Tensor::mul_'s bits. The processes'
// answers still meet in one exchange (Note [One decision everywhere] in
// dp/optim/grad_scaler.h).
bool scale_grads_find_nonfinite_(const ParameterList& given, double factor) {
  DP_CHECK(std::isfinite(factor), "scale_grads_find_nonfinite_: expected a finite factor, got ", factor);
  const ParameterList params = with_a_gradient(given);  // Note [Gradients PyTorch would not see]
  const float f = static_cast<float>(factor);
  std::mutex mu;  // copies run on their own workers
  std::vector<Tensor> flags;  // one per device, in the order first used
  auto flag_on = [&](Device dev) -> float* {
    std::lock_guard<std::mutex> lock(mu);
    for (const Tensor& t : flags)
      if (t.device() == dev) return t.data<float>();
    flags.push_back(zeros({1}, TensorOptions{Dtype::Float32, dev}));
    return flags.back().data<float>();
  };
  edit_every_copy(params, [&](Tensor& g) {
    if (g.numel() == 0) return;
    DP_CHECK(g.dtype() == Dtype::Float32, "scale_grads_find_nonfinite_: expected float32 gradients (master "
             "weights), got ", g.str());
    float* found = flag_on(g.device());
    backend::get(g.device()).run<backend::Op::ScaleFindNonfinite>(
        g.device(), backend::DType::F32, {g.mutable_data<float>(), g.numel(), f, found});
  });
  bool any = false;
  for (const Tensor& flag : flags) any = any || flag.item() != 0.0;
  const auto& set = params.set();
  if (ProcessExchange* exchange = set ? process_exchange(*set) : nullptr) {
    // Each process checked only its own ranges (Note [Ranges across processes]).
    for (const std::vector<float>& part : exchange->gather({any ? 1.0f : 0.0f}))
      any = any || (!part.empty() && part[0] != 0.0f);
  }
  return any;
}

void clip_grad_value_(const ParameterList& params, double clip_value) {
  DP_CHECK(clip_value >= 0, "clip_grad_value_: expected clip_value >= 0, got ", clip_value);
  edit_every_copy(with_a_gradient(params), [clip_value](Tensor& g) {
    Tensor lo = full({}, -clip_value, {.device = g.device()});
    // clamp(g, -c, c) = max(-max(-g, -c), -c)
    g.copy_(maximum(neg(maximum(neg(g), lo)), lo));
  });
}

}  // namespace dp::nn::utils
