// src/parallel/grad_wire.h — gradients on the wire in 16 bits (internal).
//
// The buffers a gradient strategy hands its collectives when
// DataParallelOptions::mixed_precision.reduce_dtype is bfloat16 or float16: one
// 16-bit buffer per device, as long as the flat gradient buffer, allocated once and
// reused every step. Knows nothing of modules, optimizers or designs.
//
//   GradWire wire(devices, Dtype::BFloat16, set.numel());
//   Tensor w = wire.pack(rank, grad_slice, offset);   // the float32 slice, rounded
//   comm.all_reduce(rank, w, w, comm::ReduceOp::Sum);  // 16 bits on the wire
//   GradWire::unpack(w, grad_slice);                   // the sum, widened back
#pragma once

#include <cstdint>
#include <vector>

#include "dp/core/device.h"
#include "dp/tensor/tensor.h"

namespace dp::parallel {

/// Note [Gradients on the wire]
/// With reduce_dtype set (FSDP's MixedPrecision.reduce_dtype), every gradient
/// collective of every design (DP's reduce, DDP's all-reduce, Sharded's per-owner
/// reduces) moves the 16-bit dtype instead of float32: half the bytes. A bucket (or a
/// detached parameter's gradient, or a sharded piece) is rounded to nearest even into
/// its place in the device's wire buffer — elements [lo, hi) of the flat layout live
/// at [lo, hi) of the wire, so buckets in flight never share memory — the collective
/// reduces the wire, and the owner of the result widens it back into its float32
/// gradient (exactly: every 16-bit value is a float32). The local communicator adds
/// 16-bit inputs in float32 in the fixed rank order and rounds once (src/comm/
/// summation.h), so a synced element's result is
///     float(round16(round16(g_0) + round16(g_1) + ... + round16(g_{N-1})))
/// with the additions in float32 in device order — in DP, DDP and Sharded alike, which
/// therefore stay bitwise identical to one another (NCCL adds in its own precision and
/// order; there only the designs' agreement within NCCL holds).
/// Across processes (mpirun) the wire crosses two hops, and each hop is one such sum,
/// rounded once: the L devices of process p give s_p = round16(sum_j round16(g_pj)) as
/// above, and the processes' process groups move the s_p as 2-byte elements (MPI has
/// no bfloat16, and dp never lets MPI add) and sum them the same way, in process order
/// (Note [Deterministic process collectives] in src/dist/process_group.cpp):
///     float(round16(s_0 + s_1 + ... + s_{P-1}))
/// Every design takes that route (Note [DP across processes] in reducer.cpp, Note
/// [Hierarchical collectives] in src/comm/hier/), so the designs stay bitwise alike
/// across processes, every process gets the same bits, and a run is reproducible. With
/// one device per process the first hop rounds nothing new and the result is, bit for
/// bit, one process over P devices; with more the extra rounding makes it a different
/// sum from one process over P * L devices (to 16-bit rounding, as float32's own
/// regrouping differs in its last bits). Between processes too the bytes are halved.
/// No division on the wire: each worker's loss is already scaled by its rows over the
/// batch's rows (Note [Loss scaling] in data_parallel.cpp), so every input
/// is already the rank's share of the mean and the sum IS the mean. That is PyTorch's
/// fp16_compress_hook's choice (divide by the world size BEFORE the sum, so that float16
/// holds the partial sums: the sum of N unscaled gradients overflows float16's 65504 N
/// times sooner), made here by the loss scaling itself. bfloat16 has float32's range:
/// what it loses is precision — 8 significant bits, so a value rounds by up to 2^-9 of
/// itself on the way in and the sum once more on the way out; the error of the sum
/// grows with the number of ranks when the inputs round differently.
/// Unsynced elements (a DP replica's own gradient, Sharded's ranges owned elsewhere)
/// are never rounded: only the result a rank keeps comes back from the wire.
/// Memory: 2 bytes per parameter per device, besides the float32 gradient.
/// dst[i] = src[i] converted to dst's dtype, on the tensors' device (equal numel), through
/// the backend's cast (the bits of Tensor::to); no storage version moves, nothing is
/// allocated.
void cast_into(const Tensor& src, const Tensor& dst);

class GradWire {
 public:
  /// `dtype`: BFloat16 or Float16; `numel`: elements of the flat gradient layout.
  GradWire(const std::vector<Device>& devices, Dtype dtype, std::int64_t numel);

  Dtype dtype() const { return dtype_; }
  /// Rank's wire elements [offset, offset + grad.numel()), holding `grad` (float32)
  /// rounded to dtype(). Writes through the backend (Note [Deferred reduce-scatter] in
  /// reducer.cpp: the wire's storage version does not move).
  Tensor pack(int rank, const Tensor& grad, std::int64_t offset) const;
  /// grad (float32) = wire widened, element by element; grad's storage version does not
  /// move (a collective's write, Note [Combined gradients are writes] in reducer.cpp).
  static void unpack(const Tensor& wire, const Tensor& grad);

 private:
  Dtype dtype_;
  std::vector<Tensor> buffers_;  // per device: numel elements of dtype_
};

}  // namespace dp::parallel
