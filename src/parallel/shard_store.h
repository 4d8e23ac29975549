// src/parallel/shard_store.h — the Sharded design's store: gather units, their
// buffers and prefetches, and the exchange with the other processes (internal).
//
// The parameter set (dp/nn/parameter_set.h) keeps flat buffers, views, copies and the
// replica binding. What sharding adds on top lives here, owned by the Sharded design
// (src/parallel/designs/sharded.h): the gather units, each copy's unit buffers and
// their pieces on the way, the tracked units of the deferred gather, and the process
// exchange. The store is the set's ViewProvider (Note [View providers] in
// dp/nn/view_provider.h) and, across processes, its ProcessExchange (Note [Process
// exchange] in dp/nn/process_exchange.h). It knows nothing of the design's policy
// (which unit is gathered when): reads on workers go to the design's read hook.
//
//   ShardStore store(set, processes, process);
//   store.shard_params(units);         // stage 3: every copy keeps its range only
//   store.gather_unit(r, u);           // copy r's unit u readable, pulled from the owners
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

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

/// Gather units, unit buffers, prefetches and process gathers of a sharded set.
class ShardStore final : public nn::ViewProvider, public nn::ProcessExchange {
 public:
  /// A store for `set`, which lives in process `process` of `processes`.
  ShardStore(nn::ParameterSet& set, int processes, int process);
  ~ShardStore() override;
  ShardStore(const ShardStore&) = delete;
  ShardStore& operator=(const ShardStore&) = delete;

  /// The store of a set, or null when its views have no ShardStore behind them.
  static ShardStore* of(const nn::ParameterSet& set);

  /// Installs the store on the set (view provider; process exchange when the set's
  /// ranges span processes). release() undoes it and every copy's data is whole again.
  void install();
  void release();

  /// Note [Sharded parameter buffers]
  /// shard_params() (after the set's shard(true)) keeps, per copy, only its own range
  /// of the parameters (ParameterCopy::data becomes that range) and gives each *gather
  /// unit* — a contiguous run [lo, hi) of the flat layout, e.g. one top-level child's
  /// parameters — a buffer of its own per copy, released (Note [Released storage])
  /// except while gathered. Every parameter view of copy r points into its unit's
  /// buffer, so handles held anywhere (autograd's saved tensors too) see the values
  /// whenever the unit is gathered, and a clear dp::Error when it is not.
  /// gather_unit(r, u) allocates copy r's unit buffer and fills it from every copy's
  /// range: a pull, one device copy per owner that has a piece of the unit — no
  /// rendezvous, so a copy can gather whatever the others do (see Note [Sharded
  /// parameters] for when units are gathered and released). Parameter::get()
  /// reports each access to a unit (before_read): on a worker (a bound thread) to the
  /// read hook, which gathers; elsewhere (user code) it gathers every unit of copy 0,
  /// as do gather_primary() and Module's parameters(), named_parameters() and
  /// state_dict() (make_primary_readable).
  void shard_params(Runs units);
  bool shards_params() const { return shards_params_; }
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

  /// Called on a bound thread for a parameter of unit `unit` of copy `copy`; unset: the
  /// unit is gathered.
  using ReadHook = std::function<void(int copy, int unit)>;
  void set_read_hook(ReadHook hook) { read_hook_ = std::move(hook); }

  // nn::ViewProvider
  void before_read(int copy, int unit) override;
  void make_primary_readable() override { gather_primary(); }
  // nn::ProcessExchange: one dp::dist broadcast per process, on the calling thread,
  // bounded by dp::dist::timeout() (Note [Fault policy]).
  std::vector<std::vector<float>> gather(const std::vector<float>& mine) override;

 private:
  struct Copy {
    std::vector<Tensor> units;                  // stage 3: each unit's buffer, released unless gathered
    std::vector<std::uint64_t> unit_versions;   // units[u]'s storage version when gathered
    std::vector<std::vector<UnitPiece>> ahead;  // units[u]'s pieces on their way
  };
  void assign_units(const Runs& units);
  void unshard_params();

  nn::ParameterSet& set_;
  int processes_, process_;
  Runs units_;
  bool shards_params_ = false;
  std::vector<Copy> copies_;
  ReadHook read_hook_;
};

}  // namespace dp::parallel
