// dp/nn/utils.h — gradient clipping, as torch.nn.utils spells it.
//
// Both functions act on EVERY copy of a parameter set: under DataParallel's DDP mode
// each replica's gradient is clipped with the same factor, computed once from the
// combined gradient, so replicas stay bitwise equal (Note [Gradient edits] in
// src/parallel/designs/ddp.cpp). In Sharded mode each device edits the range of
// the reduced gradient it owns (its span's, Note [Copy spans] in dp/nn/copy_spans.h), and the norm is
// assembled from every device's range in flat order, so single device, DP, DDP and
// Sharded (any stage, any device count) compute the same total norm, bit for bit
// (Note [Clipping in blocks] in src/nn/utils.cpp). They read no parameter: in stage 3
// they gather nothing (pass the list kept from before the loop rather than a fresh
// model.parameters(), which gathers device 0's copy for the user). Under DP and on
// one device they act on the one gradient the optimizer steps. Knows nothing of
// DataParallel itself. Call them after a synchronised backward (not inside no_sync()).
//
//   loss.backward();
//   double norm = dp::nn::utils::clip_grad_norm_(model.parameters(), 1.0);
//   opt.step();
#pragma once

#include <cstdint>
#include <limits>

#include "dp/nn/parameter_set.h"

namespace dp::nn::utils {

/// The norm type of the max norm: clip_grad_norm_(params, 1.0, kInfNorm).
inline constexpr double kInfNorm = std::numeric_limits<double>::infinity();

/// clip_grad_norm_ reduces a set's gradient in blocks of this many elements, fixed by
/// the flat index (Note [Clipping in blocks] in src/nn/utils.cpp): a runtime that cuts
/// a set into ranges starts each range on a multiple of it, so that no range boundary
/// cuts a block and every design computes the same norm, bit for bit.
inline constexpr std::int64_t kNormBlock = 16;

/// Scales the gradients so that their total `norm_type`-norm (the norm of the
/// per-parameter norms, as PyTorch computes it) is at most `max_norm`: each gradient
/// is multiplied by min(1, max_norm / (total + 1e-6)). Returns the total norm before
/// clipping. Loose tensors without a gradient are skipped, and so are a parameter set's
/// parameters that PyTorch would hold a None .grad for: frozen ones and ones no gradient
/// reached since zero_grad() (Note [Gradients PyTorch would not see] in
/// src/nn/utils.cpp; the same in clip_grad_value_ and scale_grads_find_nonfinite_). Throws
/// dp::Error for max_norm < 0 or NaN, norm_type <= 0 or NaN, or — with
/// error_if_nonfinite — a NaN/Inf total. The total is read on the host (on CUDA: one
/// synchronisation, like .item()). The gradients of a set sharded across processes
/// (Mode::Sharded stages 1 and 2 under mpirun) are spread over the job: the call is
/// then COLLECTIVE — every process makes it — and each process's partial norms are
/// exchanged, so the total (and the clipping) is the same bits on every process, and
/// the same as DDP's (Note [Clipping in blocks], src/nn/utils.cpp).
double clip_grad_norm_(const ParameterList& params, double max_norm, double norm_type = 2.0,
                       bool error_if_nonfinite = false);

/// Clamps every gradient element into [-clip_value, clip_value] (in Sharded mode:
/// every element of each device's owned gradient range). Throws dp::Error for
/// clip_value < 0 or NaN.
void clip_grad_value_(const ParameterList& params, double clip_value);

/// Multiplies every gradient of `params` by `factor`, on every copy an optimizer steps
/// (as clip_grad_norm_ edits them: each copy's gradients, or a sharded copy's owned
/// range), and returns true when any of them held a NaN or an infinity before — on any
/// copy, and for a set sharded across processes on any process (then collective: every
/// process must call it). The same answer on every copy and process, so a decision
/// taken on it is taken everywhere. One pass over each gradient and one host read per
/// device (on CUDA one synchronisation per device, however many parameters; Note
/// [Unscaling with one read per device] in src/nn/utils.cpp). dp::amp::GradScaler's
/// unscale_.
bool scale_grads_find_nonfinite_(const ParameterList& params, double factor);

}  // namespace dp::nn::utils
