// src/parallel/shard_store.h — the Sharded design's store: the ranges, the gather
// units, their buffers and prefetches, and the exchange with the other processes
// (internal).
//
// The parameter set (dp/nn/parameter_set.h) keeps flat buffers, views, copies and the
// replica binding. What sharding adds on top lives here, owned by the Sharded design
// (src/parallel/designs/sharded.h): each copy's range and stage 2's range
// gradients, the gather units, each copy's unit buffers and their pieces on the way,
// the tracked units of the deferred gather and its pulls, and the process exchange.
// The store is the set's CopySpans while sharded (Note [Copy spans] in
// dp/nn/copy_spans.h: what an optimizer step and clipping read of each copy), its
// ViewProvider (Note [View providers] in dp/nn/view_provider.h) and, across processes,
// its ProcessExchange (Note [Process exchange] in dp/nn/process_exchange.h). It knows
// nothing of the design's policy (which unit is gathered when): reads on workers go
// to the design's read hook.
//
//   ShardStore store(set, processes, process);
//   store.shard(/*shard_grads=*/true);  // every copy steps its range
//   store.shard_params(units);          // stage 3: every copy keeps its range only
//   store.gather_unit(r, u);            // copy r's unit u readable, pulled from the owners
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "dp/nn/copy_spans.h"
#include "dp/nn/parameter_set.h"
#include "dp/nn/process_exchange.h"
#include "dp/nn/view_provider.h"

namespace dp::backend {
class PendingCopy;
}  // namespace dp::backend

namespace dp::parallel {

/// A piece of a unit on its way from its owner (Note [Copies ahead] in
/// src/backend/backend.h): where it lands in the unit, and its copy.
struct UnitPiece {
  std::int64_t at = 0, numel = 0;
  std::shared_ptr<backend::PendingCopy> copy;
};

using Runs = std::vector<std::pair<std::int64_t, std::int64_t>>;

/// Ranges, range gradients, gather units, unit buffers, prefetches and process gathers
/// of a sharded set.
class ShardStore final : public nn::CopySpans, public nn::ViewProvider, public nn::ProcessExchange {
 public:
  /// A store for `set`, which lives in process `process` of `processes`.
  ShardStore(nn::ParameterSet& set, int processes, int process);
  ~ShardStore() override;
  ShardStore(const ShardStore&) = delete;
  ShardStore& operator=(const ShardStore&) = delete;

  /// The store of a set, or null when its views have no ShardStore behind them.
  static ShardStore* of(const nn::ParameterSet& set);

  /// Installs the store on the set as its view provider (shard() makes it the set's
  /// CopySpans, and so, when the ranges span processes, its process exchange).
  /// release() undoes it and unshards: every copy holds and steps its whole buffers
  /// again.
  void install();
  void release();

  /// Note [Sharded parameter sets]
  /// shard() splits the set's flat buffers into num_copies() contiguous ranges of
  /// equal length S, copy r owning [r*S, (r+1)*S) (clipped to the padded buffer; its
  /// span, Note [Copy spans] in dp/nn/copy_spans.h, which the store answers for the
  /// set from shard() to unshard()): an optimizer step of copy r updates only that
  /// range and keeps optimizer state only for it. Ranges are element-exact, not
  /// whole parameters: one parameter may span two copies, and every copy owns the same
  /// number of elements, however unequal the parameters are (whole-parameter ranges
  /// would give one copy the MLP's 1024x1024 weight, 56% of the model). S is rounded
  /// up to kShardAlign elements (a cache line, and aligned vector loads on a GPU), and
  /// the buffers are padded with zeros to num_copies() * S, so that every range has
  /// the same length and an equal-count all-gather reassembles the parameters. The
  /// padding belongs to no parameter: no optimizer steps it and no gradient reaches it.
  /// Whatever gradient copy 0 holds is handed out by range: copy r's buffer holds
  /// copy 0's values on its own range and zeros elsewhere, so the sum over copies is
  /// unchanged. With `shard_grads` (ZeRO stage 2) each copy keeps between backward
  /// passes only the gradient of its range, here (its span's gradient), and a full gradient buffer
  /// only while a backward needs it: acquire_grad before the backward, release_grad
  /// once its buckets were reduced; the parameters' .grad are undefined between.
  /// Across processes (Note [World ranks] in dp/comm/communicator.h) the ranges are
  /// cut for `world` copies in all, this set's copy r owning world range `first` + r;
  /// 0 (the default) means this set's copies are all there are.
  /// Throws dp::Error when already sharded or when a copy is transient.
  void shard(bool shard_grads, int world = 0, int first = 0);
  /// Undoes shard(): every copy steps all of the buffers again and has a full
  /// gradient buffer; copy 0's gradient receives every other copy's range of its
  /// owned gradient, so after a synced backward it holds the whole summed gradient.
  void unshard();
  bool sharded() const { return sharded_; }
  bool shards_grads() const { return shard_grads_; }
  /// The ranges the buffers were cut into: num_copies(), or more when the other
  /// ranges belong to copies in other processes.
  int shard_world() const { return shard_world_; }
  /// Note [Ranges across processes]
  /// A set sharded across processes keeps only world ranges [first, first +
  /// num_copies()); the other ranges (their optimizer state, their gradients) live in
  /// the other processes, process p owning the contiguous world ranges [p *
  /// num_copies(), (p + 1) * num_copies()). What needs a value of every range — an
  /// optimizer's state_dict, the total norm of clip_grad_norm_ — reaches the other
  /// processes through the set's process exchange, this store (exchange(), gather();
  /// Note [Process exchange] in dp/nn/process_exchange.h).
  bool sharded_across_processes() const { return sharded_ && shard_world_ > set_.num_copies(); }
  /// floats: 64 bytes; a multiple of clip_grad_norm_'s blocks (Note [Clipping in blocks]).
  static constexpr std::int64_t kShardAlign = 16;
  /// Sharded gradients: gives copy r a full gradient buffer — zeros, its own range
  /// taking over the range gradient (freed), so that gradients keep accumulating — and
  /// points copy r's .grad views at it. A no-op when copy r has one.
  void acquire_grad(int r);
  /// Sharded gradients: moves copy r's own range of its gradient buffer into its range
  /// gradient and frees the buffer (copy r's .grad become undefined).
  void release_grad(int r);

  /// Note [Sharded parameter buffers]
  /// shard_params() (after shard(true)) keeps, per copy, only its own range
  /// of the parameters (ParameterCopy::data becomes that range) and gives each *gather
  /// unit* — a contiguous run [lo, hi) of the flat layout, e.g. one top-level child's
  /// parameters — a buffer of its own per copy, released (Note [Released storage])
  /// except while gathered. Every parameter view of copy r points into its unit's
  /// buffer, so handles held anywhere (autograd's saved tensors too) see the values
  /// whenever the unit is gathered, and a clear dp::Error when it is not.
  /// gather_unit(r, u) allocates copy r's unit buffer (the one its worker reads: in
  /// the compute dtype, Note [Sharded compute units], when there is one) and fills it
  /// from every copy's range: a pull, one device copy per owner that has a piece of
  /// the unit — no rendezvous, so a copy can gather whatever the others do (see Note
  /// [Sharded parameters] for when units are gathered and released). Parameter::get()
  /// reports each access to a unit (before_read): on a worker (a bound thread) to the
  /// read hook, which gathers; elsewhere (user code) it gathers every unit of copy 0,
  /// as do gather_primary() and Module's parameters(), named_parameters() and
  /// state_dict() (make_primary_readable).
  void shard_params(Runs units);
  bool shards_params() const { return shards_params_; }
  /// Note [Sharded compute units]
  /// With a compute dtype (DataParallel's mixed_precision.param_dtype, Note [Parameters
  /// in low precision] in src/parallel/design.cpp), after shard_params(): every copy's
  /// ParameterCopy::compute is its own range cast to `dtype` (the design casts it), and
  /// every unit u with computed[u] gets, per copy, a buffer in `dtype` as well, released
  /// except while gathered. What copy r's worker reads of such a unit are views of that
  /// buffer (the set's compute views), so gather_unit(r, u) and gather_unit_ahead(r, u)
  /// pull the owners' 16-bit ranges into it: half the bytes of the float32 gather, FSDP's
  /// param_dtype all-gather. The float32 ranges stay the master, and the float32 unit
  /// buffers are what user code reads of copy 0 (gather_primary(), scatter_primary()).
  /// A unit without computed[u] (a BatchNorm's, which keeps float32: the Sharded design
  /// cuts the units so that each is one or the other, as FSDP gives a BatchNorm a
  /// float32 unit of its own) is gathered in float32 as without a compute dtype. The
  /// ranges are cast by the design (refresh_compute); the store only moves them.
  /// Throws dp::Error unless the parameters are sharded.
  void shard_compute(Dtype dtype, const std::vector<bool>& computed);
  /// Copy r's buffer of unit u in the compute dtype (undefined: the unit keeps float32).
  const Tensor& compute_unit(int r, int u) const;
  /// Bytes of parameters copy r received from the other copies' ranges since
  /// construction: the pieces of its unit gathers and prefetches (stage 3) and of its
  /// pulls (Note [Tracked units]), in the dtype they travelled in.
  std::int64_t received_bytes(int r) const;
  const Runs& units() const { return units_; }
  void gather_unit(int r, int u);
  /// Starts copy r's pieces of unit u on their way without gathering it (Note [Copies
  /// ahead] in src/backend/backend.h): gather_unit(r, u) then only lands them, and
  /// what copy r computes meanwhile does not wait for them. The prefetch of stage 3.
  /// A no-op when u is gathered or already on its way; release_unit drops it.
  void gather_unit_ahead(int r, int u);
  /// Copy r's pieces on their way, per unit (empty when none).
  const std::vector<std::vector<UnitPiece>>& ahead(int r) const {
    return copies_.at(static_cast<std::size_t>(r)).ahead;
  }
  void release_unit(int r, int u);
  /// Releases every unit of copy r.
  void release_units(int r);
  bool unit_gathered(int r, int u) const;
  /// Gathers every unit of copy 0 (user access between steps). A no-op unless the
  /// parameters are sharded.
  void gather_primary();
  /// Writes every gathered unit of copy 0 that was written since it was gathered (a
  /// load, an in-place edit) into every copy's range, then releases copy 0's units.
  /// Returns whether anything was written back.
  bool scatter_primary();

  /// Note [Tracked units]
  /// track_units() gives an unsharded set's parameters gather units without
  /// sharding their data: every copy keeps its full buffer, and Parameter::get() on
  /// a bound thread reports each access to the read hook, which can bring the copy's
  /// unit up to date just before it is used (the deferred gather of stages 1 and 2,
  /// Note [Deferred gather]). Accesses on unbound threads report nothing: copy 0 is
  /// always whole. Throws dp::Error once shard_params() ran.
  void track_units(Runs units);
  /// Tracked units: copies every other owner's piece of unit u into copy r's buffer
  /// (Note [Deferred gather]), landing the pieces pull_unit_ahead started, if any.
  void pull_unit(int r, int u);
  /// Tracked units: starts the other owners' pieces of unit u on their way to copy r
  /// (Note [Copies ahead]); a no-op when they are on their way already.
  void pull_unit_ahead(int r, int u);
  /// Tracked units: drops every piece on its way (pulled afresh when needed).
  void drop_pulls_ahead();

  /// Called on a bound thread for a parameter of unit `unit` of copy `copy`; unset: the
  /// unit is gathered.
  using ReadHook = std::function<void(int copy, int unit)>;
  void set_read_hook(ReadHook hook) { read_hook_ = std::move(hook); }

  // nn::CopySpans: copy r's range, its part of the parameters, and its gradient (the
  // range gradient while the buffer is released, else the buffer's range); this store
  // as the exchange when the ranges span processes.
  nn::CopySpan span(int copy) const override;
  nn::ProcessExchange* exchange() override;
  // nn::ViewProvider
  void before_read(int copy, int unit) override;
  void make_primary_readable() override { gather_primary(); }
  // nn::ProcessExchange: one dp::dist broadcast per process, on the calling thread,
  // bounded by dp::dist::timeout() (Note [Fault policy]).
  std::vector<std::vector<float>> gather(const std::vector<float>& mine) override;

 private:
  struct Copy {
    std::vector<Tensor> units;                  // stage 3: each unit's buffer, released unless gathered
    std::vector<Tensor> compute_units;          // Note [Sharded compute units]: undefined for a float32 unit
    std::vector<std::uint64_t> unit_versions;   // units[u]'s storage version when gathered
    // The summed versions of the owners' ranges that units[u] (compute_units[u]) was last
    // filled from; kNeverFilled before the first fill (Note [Refills are not writes]).
    std::vector<std::uint64_t> unit_sources, compute_sources;
    std::vector<std::vector<UnitPiece>> ahead;  // unit u's pieces on their way
  };
  // Note [Sharded parameter sets]: copy r's range of the flat buffers and, with
  // shard_grads while its gradient buffer is released, the summed gradient of the range
  // ((end - begin) float32; undefined otherwise).
  struct Range {
    std::int64_t begin = 0, end = 0;
    Tensor grad;
  };
  void assign_units(const Runs& units);
  static constexpr std::uint64_t kNeverFilled = ~std::uint64_t{0};
  // The summed storage versions of the owners' ranges that unit u's buffer t is filled
  // from, and the slot in copy r's records that keeps it for t.
  std::uint64_t sources_version(int u, const Tensor& t) const;
  std::uint64_t& filled_from(int r, int u, const Tensor& t);
  void unshard_params();
  // What copy r's worker reads of unit u: its compute buffer, or else its float32 one.
  const Tensor& read_unit(int r, int u) const;
  // Copy q's range in the dtype of `unit` (a unit buffer): its compute range or its data.
  const Tensor& source_range(int q, const Tensor& unit) const;
  // Fills the released unit buffer `t` of copy r's unit u from every owner's range.
  void fill_unit(int r, int u, Tensor& t);
  void count_received(int r, int q, std::int64_t numel, Dtype dtype);

  nn::ParameterSet& set_;
  int processes_, process_;
  bool sharded_ = false;
  bool shard_grads_ = false;
  int shard_world_ = 0;
  std::vector<Range> ranges_;  // per copy, while sharded
  Runs units_;
  bool shards_params_ = false;
  std::vector<Copy> copies_;
  std::vector<std::int64_t> received_bytes_;  // per copy; each counted on its own thread
  ReadHook read_hook_;
};

}  // namespace dp::parallel
