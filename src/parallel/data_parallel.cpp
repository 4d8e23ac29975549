#include "dp/parallel/data_parallel.h"

#include <algorithm>
#include <set>

#include "backend/backend.h"
#include "dp/autograd/grad_mode.h"
#include "dp/autograd/node.h"
#include "dp/comm/communicator.h"
#include "dp/core/error.h"
#include "dp/parallel/worker_pool.h"
#include "dp/tensor/ops.h"
#include "parallel/ddp_reducer.h"

namespace dp {

using parallel::Phase;
using Clock = parallel::Trace::Clock;

namespace {

std::vector<Device> devices_from_ids(const std::vector<int>& ids) {
  DeviceType type = default_device_type();
  std::vector<Device> out;
  if (ids.empty()) {
    int n = device_count(type);
    for (int i = 0; i < n; ++i) out.push_back(Device{type, i});
    return out;
  }
  for (int id : ids) {
    int n = device_count(type);
    DP_CHECK(id >= 0 && id < n, "DataParallel: device id ", id, " is out of range: expected [0, ", n,
             ") ", type, " devices");
    out.push_back(Device{type, id});
  }
  return out;
}

// Note [Gather backward]
// The gathered output's grad_fn is this node. It has no edges into the replicas'
// graphs: each replica's graph was recorded by its own worker thread and is run by
// that worker. apply() splits the incoming gradient by shard and hands each piece
// to its device's worker, which runs backward on its own tape concurrently; the
// gradients are then reduced (DP) or have been all-reduced during backward (DDP).
class GatherBackward final : public autograd::Node {
 public:
  GatherBackward(std::vector<Tensor> outputs, std::vector<std::int64_t> sizes,
                 std::function<Tensor(const std::vector<Tensor>&, const std::vector<Tensor>&)> run)
      : outputs_(std::move(outputs)), sizes_(std::move(sizes)), run_(std::move(run)) {}
  std::string name() const override { return "DataParallelGatherBackward"; }
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override {
    DP_CHECK(!released_, "backward through DataParallel's output a second time: the replicas' graphs "
             "were freed by the first backward");
    std::vector<Tensor> pieces = split(grads[0].detach(), sizes_);
    Tensor input_grad = run_(outputs_, pieces);
    if (next_edges.empty()) return {};
    return {input_grad};
  }
  void release_saved() override {
    outputs_.clear();
    released_ = true;
  }

 private:
  std::vector<Tensor> outputs_;
  std::vector<std::int64_t> sizes_;
  std::function<Tensor(const std::vector<Tensor>&, const std::vector<Tensor>&)> run_;
};

}  // namespace

// ---- construction -------------------------------------------------------------------------

DataParallel::DataParallel(std::shared_ptr<nn::Module> net, std::vector<int> device_ids,
                           DataParallelOptions options)
    : net_(std::move(net)), options_(std::move(options)) {
  init(devices_from_ids(device_ids));
}

DataParallel::DataParallel(std::shared_ptr<nn::Module> net, std::vector<Device> devices,
                           DataParallelOptions options)
    : net_(std::move(net)), options_(std::move(options)) {
  init(std::move(devices));
}

void DataParallel::init(std::vector<Device> devices) {
  DP_CHECK(net_ != nullptr, "DataParallel: expected a module, got null");
  DP_CHECK(!devices.empty(), "DataParallel: expected at least one device, got an empty list");
  std::set<int> seen;
  for (const Device& d : devices) {
    DP_CHECK(d.type == devices[0].type, "DataParallel: expected devices of one type, got ", devices[0],
             " and ", d);
    int n = device_count(d.type);
    DP_CHECK(d.index >= 0 && d.index < n, "DataParallel: device ", d, " is out of range: ", n, " ",
             d.type, " devices exist");
    DP_CHECK(seen.insert(d.index).second, "DataParallel: device ", d,
             " appears twice in the device list; each device may be listed once");
  }
  int n = static_cast<int>(devices.size());
  DP_CHECK(options_.output_device >= 0 && options_.output_device < n, "DataParallel: output_device ",
           options_.output_device, " is not an index into the ", n, " devices");
  devices_ = std::move(devices);

  net_->to(devices_[0]);
  set_ = net_->parameter_set();
  DP_CHECK(set_ != nullptr, "DataParallel: the module has no parameters to train");
  DP_CHECK(set_->num_copies() == 1, "DataParallel: this module is already wrapped by another "
           "DataParallel; wrap a module once");
  buffers_ = net_->buffer_slots();
  for (auto& [name, t] : net_->named_parameters()) param_names_.push_back(name);

  backend::get(devices_[0]).set_concurrent_devices(n);
  workers_ = std::make_unique<parallel::WorkerPool>(devices_, "worker");
  comm_ = comm::make_communicator(devices_);
  bool ddp = options_.mode == Mode::DDP;
  for (int r = 1; r < n; ++r) set_->add_copy(devices_[r], /*transient=*/!ddp);
  for (auto& b : buffers_) {
    b->copies.resize(n);
    NoGradGuard no_grad;
    for (int r = 1; r < n; ++r) b->copies[r] = b->copies[0].to(devices_[r]).detach().clone();
  }
  storage_base_.assign(n, 0);
  end_replicate();

  // Optimizer steps run each copy on its own device's worker.
  set_->set_executor([this](int copies, const std::function<void(int)>& fn) {
    try {
      workers_->run(
          [&](int r) {
            if (r >= copies) return;
            nn::ReplicaBinding bind(r);
            auto t0 = Clock::now();
            fn(r);
            add_time(r, Phase::Step, t0);
          },
          [this](int, const std::string& what) { abort_step(what); });
    } catch (...) {
      // abort_step() aborted the communicator; re-arm it, or every later step
      // would fail with "collective aborted".
      comm_->reset();
      throw;
    }
  });

  if (ddp) {
    std::vector<std::int64_t> numel;
    for (auto& s : set_->slots()) numel.push_back(s->copies[0].numel());
    reducer_ = std::make_unique<parallel::DdpReducer>(numel, n, options_.bucket_cap_mb,
                                                      options_.first_bucket_mb);
    auto& slots = set_->slots();
    for (int r = 0; r < n; ++r)
      for (int i = 0; i < static_cast<int>(slots.size()); ++i)
        autograd::add_post_accumulate_hook(slots[i]->copies[r],
                                           [red = reducer_.get(), r, i](const Tensor&) { red->mark_ready(r, i); });
    comm_threads_ = std::make_unique<parallel::WorkerPool>(devices_, "comm");
  }
  stats_.devices.resize(n);
  for (int r = 0; r < n; ++r) stats_.devices[r].device = devices_[r];
}

DataParallel::~DataParallel() {
  // Hand the module back as a plain single-device module.
  try {
    set_->set_executor(nullptr);
    for (auto& s : set_->slots()) autograd::clear_post_accumulate_hooks(s->copies[0]);
    set_->drop_copies();
    for (auto& b : buffers_) b->copies.resize(1);
    backend::get(devices_[0]).set_concurrent_devices(1);
  } catch (const std::exception& e) {
    detail::log_warning(detail::str_cat("DataParallel: cleanup failed: ", e.what()));
  }
}

// ---- helpers ---------------------------------------------------------------------------------

std::uint64_t DataParallel::primary_version() const {
  // The set's version counts optimizer steps and loads; the storage's counts in-place
  // writes through parameter tensors. Both only grow, so their sum changes whenever
  // either does.
  return set_->version() + set_->copy(0).data.storage()->version();
}

void DataParallel::add_time(int rank, Phase p, Clock::time_point start, std::string args) {
  auto end = Clock::now();
  double ms = std::chrono::duration<double, std::milli>(end - start).count();
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.devices[rank].ms[static_cast<int>(p)] += ms;
  }
  if (trace_.enabled()) {
    const char* track = p == Phase::AllReduceHidden ? "comm " : "worker ";
    trace_.record(track + devices_[rank].str(), parallel::phase_name(p), start, end, std::move(args));
  }
}

parallel::Stats DataParallel::stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  parallel::Stats s = stats_;
  for (auto& d : s.devices) d.peak_memory_bytes = backend::get(d.device).max_memory_allocated(d.device);
  return s;
}

void DataParallel::reset_stats() {
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.iterations = 0;
  for (auto& d : stats_.devices) std::fill(std::begin(d.ms), std::end(d.ms), 0.0);
  for (auto& d : devices_) backend::get(d).reset_peak_memory(d);
}

std::vector<std::pair<std::int64_t, std::int64_t>> DataParallel::buckets() const {
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  if (reducer_)
    for (auto& b : reducer_->buckets) out.emplace_back(b.lo, b.hi);
  return out;
}

std::vector<std::int64_t> DataParallel::shard_sizes(std::int64_t rows) const {
  int n = static_cast<int>(devices_.size());
  std::vector<std::int64_t> sizes;
  if (!options_.chunk_sizes.empty()) {
    const auto& cs = options_.chunk_sizes;
    DP_CHECK(static_cast<int>(cs.size()) <= n, "DataParallel: ", cs.size(), " chunk_sizes for ", n,
             " devices; expected at most one per device");
    std::int64_t total = 0;
    for (auto c : cs) {
      DP_CHECK(c >= 0, "DataParallel: chunk_sizes must be >= 0, got ", c);
      total += c;
    }
    DP_CHECK(total == rows, "DataParallel: chunk_sizes sum to ", total, " but the batch has ", rows, " rows");
    sizes = cs;
  } else {
    std::int64_t step = (rows + n - 1) / n;  // torch.chunk: ceil-sized chunks
    for (std::int64_t at = 0; at < rows; at += step) sizes.push_back(std::min(step, rows - at));
  }
  sizes.resize(n, 0);
  return sizes;
}

nn::LoadResult DataParallel::load_state_dict(const nn::StateDict& state, bool strict) {
  nn::LoadResult r = net_->load_state_dict(state, strict);
  // DDP replicas pick the new values up at the next forward (primary_version changed).
  return r;
}

// Copies what replica `rank` needs from device 0 before its forward. Runs on every
// worker (collectives need every rank); the caller decides what to copy, once, so
// every rank makes the same sequence of collectives.
void DataParallel::replicate(int rank, bool sync_params) {
  if (devices_.size() == 1) return;
  auto t0 = Clock::now();
  if (sync_params) comm_->broadcast(rank, set_->copy(rank).data, 0);
  bool sync_buffers = options_.mode == Mode::DP || options_.broadcast_buffers;
  bool moved = sync_params;
  if (sync_buffers) {
    for (auto& b : buffers_) {
      // int64 buffers (num_batches_tracked) are counters read from device 0 only.
      if (b->copies[rank].dtype() != Dtype::Float32) continue;
      comm_->broadcast(rank, b->copies[rank], 0);
      moved = true;
    }
  }
  if (options_.mode == Mode::DP && rank > 0) set_->copy(rank).grad.zero_();
  if (moved) add_time(rank, Phase::Replicate, t0, sync_params ? "\"parameters\": true" : "\"parameters\": false");
}

// Note [When replicas are refreshed]
// DP: the replicas are transient, so they need device 0's parameters whenever those
// changed since the last forward (an optimizer step, a load, an in-place write).
// DDP: every replica is stepped by the optimizer along with device 0, so they stay
// equal without any copy; they need device 0's parameters only when the copies were
// written unequally — a load or an in-place write into device 0's parameters, or a
// failed step that updated some copies and not others. Every write through a tensor
// or an optimizer step bumps the written buffer's storage version, so "written
// unequally" is "storage versions moved by different amounts since the last sync".
// Decided once on the calling thread, so every rank makes the same collectives.
bool DataParallel::begin_replicate() {
  bool sync;
  if (options_.mode == Mode::DP) {
    sync = primary_version() != synced_version_;
  } else {
    sync = synced_version_ == kUnsynced;
    std::uint64_t moved0 = set_->copy(0).data.storage()->version() - storage_base_[0];
    for (int r = 1; r < set_->num_copies(); ++r)
      sync = sync || set_->copy(r).data.storage()->version() - storage_base_[r] != moved0;
  }
  synced_version_ = kUnsynced;  // stays so if the step fails half way
  return sync;
}

void DataParallel::end_replicate() {
  synced_version_ = primary_version();
  for (int r = 0; r < set_->num_copies(); ++r) storage_base_[r] = set_->copy(r).data.storage()->version();
}

// ---- forward ---------------------------------------------------------------------------------

Tensor DataParallel::forward(const Tensor& x) {
  DP_CHECK(x.defined() && x.dim() >= 1, "DataParallel: expected a batched input (N, ...), got ",
           x.defined() ? x.str() : "an undefined tensor");
  DP_CHECK(x.size(0) >= 1, "DataParallel: expected a batch with at least one row, got ", x.str());
  DP_CHECK(!busy_, "DataParallel: forward called re-entrantly (from inside a worker?)");
  busy_ = true;
  struct Busy {
    bool& b;
    ~Busy() { b = false; }
  } busy{busy_};
  int n = static_cast<int>(devices_.size());
  std::vector<std::int64_t> sizes = shard_sizes(x.size(0));
  std::vector<std::int64_t> offsets(n, 0);
  for (int r = 1; r < n; ++r) offsets[r] = offsets[r - 1] + sizes[r - 1];
  std::vector<Tensor> outs(n);
  bool grad_mode = is_grad_enabled();
  // Note [Scatter backward]: when x needs a gradient, each worker's shard becomes a
  // leaf of that worker's graph; after the workers' backward, GatherBackward returns
  // the shards' gradients, concatenated on x's device, along its edge to x.
  Tensor input = x.detach();
  bool input_grad = grad_mode && x.requires_grad();
  std::vector<Tensor> shards(n);
  bool sync_params = begin_replicate();

  try {
    workers_->run(
        [&](int r) {
          nn::ReplicaBinding bind(r);
          GradModeGuard grad_guard(grad_mode);
          replicate(r, sync_params);
          if (sizes[r] == 0) return;
          auto t0 = Clock::now();
          Tensor xr = input.narrow(0, offsets[r], sizes[r]).to(devices_[r]);
          if (input_grad) {
            if (xr.storage() == input.storage()) xr = xr.clone();  // own the leaf's storage
            xr.set_requires_grad(true);
            shards[r] = xr;
          }
          add_time(r, Phase::Scatter, t0);
          t0 = Clock::now();
          outs[r] = net_->forward(xr);
          add_time(r, Phase::Forward, t0);
        },
        [this](int, const std::string& what) { abort_step(what); });
  } catch (...) {
    comm_->reset();
    throw;
  }
  end_replicate();
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.iterations;
  }

  // Gather onto the output device without recording: the replicas' graphs stay with
  // their workers (Note [Gather backward]).
  auto t0 = Clock::now();
  std::vector<Tensor> live, moved;
  std::vector<std::int64_t> live_sizes;
  bool needs_grad = false;
  for (int r = 0; r < n; ++r) {
    if (sizes[r] == 0) continue;
    DP_CHECK(outs[r].defined() && outs[r].dim() >= 1 && outs[r].size(0) == sizes[r],
             "DataParallel: the module's output on ", devices_[r], " must keep the batch in dim 0 (",
             sizes[r], " rows), got ", outs[r].str());
    needs_grad = needs_grad || outs[r].requires_grad();
    NoGradGuard no_grad;
    moved.push_back(outs[r].detach().to(output_device()));
    live_sizes.push_back(sizes[r]);
  }
  Tensor out;
  {
    NoGradGuard no_grad;
    out = moved.size() == 1 ? moved[0].clone() : cat(moved);
  }
  add_time(options_.output_device, Phase::Gather, t0);
  if (needs_grad && grad_mode) {
    Device input_device = x.device();
    auto node = std::make_shared<GatherBackward>(
        outs, live_sizes,
        [this, alive = std::weak_ptr<int>(alive_), sizes, shards, input_device](
            const std::vector<Tensor>& roots, const std::vector<Tensor>& pieces) -> Tensor {
          DP_CHECK(!alive.expired(), "backward through an output of a DataParallel that was destroyed; "
                   "keep the DataParallel alive until backward() has run");
          // Map the live pieces back onto ranks.
          int n = static_cast<int>(devices_.size());
          std::vector<Tensor> rr(n), gg(n);
          std::size_t k = 0;
          for (int r = 0; r < n; ++r)
            if (sizes[r] > 0) {
              rr[r] = roots[r];
              gg[r] = pieces[k++];
            }
          run_backward_on_workers(rr, gg);
          if (!shards[0].defined()) return Tensor();
          std::vector<Tensor> grads;
          for (int r = 0; r < n; ++r) {
            if (sizes[r] == 0) continue;
            Tensor g = shards[r].grad();
            grads.push_back(g.defined() ? g.to(input_device) : zeros(shards[r].shape(), input_device));
          }
          return grads.size() == 1 ? grads[0] : cat(grads);
        });
    std::vector<Tensor> node_inputs;
    if (input_grad) node_inputs.push_back(x);
    autograd::connect(node, node_inputs, {&out});
  }
  return out;
}

Tensor DataParallel::forward_backward(const Tensor& x, const Tensor& target, const LossFn& loss_fn) {
  DP_CHECK(x.defined() && x.dim() >= 1 && x.size(0) >= 1,
           "DataParallel::forward_backward: expected a batched input (N, ...), got ",
           x.defined() ? x.str() : "an undefined tensor");
  DP_CHECK(target.defined() && target.dim() >= 1 && target.size(0) == x.size(0),
           "DataParallel::forward_backward: expected a target with ", x.size(0), " rows, got ",
           target.defined() ? target.str() : "an undefined tensor");
  DP_CHECK(loss_fn != nullptr, "DataParallel::forward_backward: expected a loss function");
  DP_CHECK(!busy_, "DataParallel: forward_backward called re-entrantly");
  busy_ = true;
  struct Busy {
    bool& b;
    ~Busy() { b = false; }
  } busy{busy_};
  int n = static_cast<int>(devices_.size());
  std::int64_t rows = x.size(0);
  std::vector<std::int64_t> sizes = shard_sizes(rows);
  std::vector<std::int64_t> offsets(n, 0);
  for (int r = 1; r < n; ++r) offsets[r] = offsets[r - 1] + sizes[r - 1];
  std::vector<Tensor> losses(n);
  Tensor input = x.detach(), tgt = target.detach();
  bool sync_params = begin_replicate();
  run_synced([&](int r) {
    nn::ReplicaBinding bind(r);
    GradModeGuard grad_guard(true);
    replicate(r, sync_params);
    if (sizes[r] > 0) {
      auto t0 = Clock::now();
      Tensor xr = input.narrow(0, offsets[r], sizes[r]).to(devices_[r]);
      Tensor yr = tgt.narrow(0, offsets[r], sizes[r]).to(devices_[r]);
      add_time(r, Phase::Scatter, t0);
      t0 = Clock::now();
      Tensor out = net_->forward(xr);
      // Note [Loss scaling]: each shard's mean loss is weighted by its share of
      // the batch, so the SUM over devices is the full-batch mean — exact for
      // uneven shards, and the same arithmetic in DP and DDP.
      Tensor loss = mul(loss_fn(out, yr), static_cast<double>(sizes[r]) / static_cast<double>(rows));
      DP_CHECK(loss.numel() == 1, "DataParallel::forward_backward: the loss function must return a "
               "scalar, got ", loss.str());
      add_time(r, Phase::Forward, t0);
      t0 = Clock::now();
      losses[r] = loss.detach();
      loss.backward();
      add_time(r, Phase::Backward, t0);
    }
    after_backward(r);
  });
  end_replicate();
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.iterations;
  }
  // The batch loss: the weighted shard losses summed in device order.
  NoGradGuard no_grad;
  Tensor total;
  for (int r = 0; r < n; ++r) {
    if (!losses[r].defined()) continue;
    Tensor l = losses[r].reshape({}).to(output_device());
    total = total.defined() ? add(total, l) : l;
  }
  return total;
}

// ---- backward ---------------------------------------------------------------------------------

void DataParallel::run_backward_on_workers(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads) {
  run_synced([&](int r) {
    nn::ReplicaBinding bind(r);
    if (roots[r].defined()) {
      auto t0 = Clock::now();
      GradModeGuard grad_guard(true);
      autograd::run_backward({roots[r]}, {grads[r].to(devices_[r])}, false);
      add_time(r, Phase::Backward, t0);
    }
    after_backward(r);
  });
}

// Runs fn(rank) on every worker as a step whose gradients are synchronised: DDP's
// comm threads are armed first, and a failure on any device aborts the step on all.
void DataParallel::run_synced(const std::function<void(int)>& fn) {
  bool sync = begin_backward();
  try {
    workers_->run(fn, [this](int, const std::string& what) { abort_step(what); });
  } catch (...) {
    end_backward(sync, /*failed=*/true);
    throw;
  }
  end_backward(sync, /*failed=*/false);
}

// Note [Comm threads]
// Each device has a comm thread, the CPU model of a CUDA communication stream: it
// takes the device's buckets in index order, waits until each is complete and
// all-reduces it, while the device's worker goes on with backward.
bool DataParallel::begin_backward() {
  if (!reducer_) return false;
  reducer_->prepare();
  reducer_->active.store(require_sync_);
  if (!require_sync_) return false;
  comm_threads_->launch(
      [this](int r) {
        auto& red = *reducer_;
        for (int b = 0; b < static_cast<int>(red.buckets.size()); ++b) {
          if (!red.wait_ready(r, b)) return;
          auto t0 = Clock::now();
          const auto& bk = red.buckets[b];
          // Note [Finite gradient check]: before the all-reduce spreads it everywhere.
          if (options_.check_finite_grads) check_finite(r, bk.lo, bk.hi);
          Tensor slice = set_->copy(r).grad.narrow(0, bk.lo, bk.hi - bk.lo);
          comm_->all_reduce(r, slice, slice, comm::ReduceOp::Sum);
          auto t1 = Clock::now();
          red.ranks[r].comm_ms.store(red.ranks[r].comm_ms.load() +
                                     std::chrono::duration<double, std::milli>(t1 - t0).count());
          if (trace_.enabled())
            trace_.record("comm " + devices_[r].str(), "allreduce bucket " + std::to_string(b), t0, t1,
                          "\"bytes\": " + std::to_string((bk.hi - bk.lo) * 4));
        }
      },
      [this](int, const std::string& what) { abort_step(what); });
  return true;
}

void DataParallel::end_backward(bool sync, bool failed) {
  if (sync && failed)
    for (int r = 0; r < static_cast<int>(devices_.size()); ++r) comm_threads_->wait(r);
  if (reducer_) reducer_->active.store(false);
  if (failed) comm_->reset();
}

void DataParallel::abort_step(const std::string& what) {
  comm_->abort(what);
  if (reducer_) reducer_->abort();
}

// Runs on worker `rank` once its backward is done.
void DataParallel::after_backward(int rank) {
  auto t0 = Clock::now();
  if (options_.mode == Mode::DP) {
    // Note [Finite gradient check]: each replica's own gradient is checked before
    // the reduction, so the error names the device the NaN/Inf came from; device 0
    // checks the sum again (a sum of finite values can overflow).
    const std::int64_t numel = set_->copy(rank).grad.numel();
    if (options_.check_finite_grads) check_finite(rank, 0, numel);
    // Sum every replica's gradient onto device 0, in device order.
    if (devices_.size() > 1) {
      const Tensor& g = set_->copy(rank).grad;
      comm_->reduce(rank, g, rank == 0 ? g : Tensor(), 0, comm::ReduceOp::Sum);
      add_time(rank, Phase::Reduce, t0);
    }
    if (options_.check_finite_grads && rank == 0 && devices_.size() > 1) check_finite(0, 0, numel);
    return;
  }
  if (!require_sync_) return;
  reducer_->finish(rank);
  std::string err = comm_threads_->wait(rank);
  auto t1 = Clock::now();
  double exposed = std::chrono::duration<double, std::milli>(t1 - t0).count();
  double total = reducer_->ranks[rank].comm_ms.load();
  add_time(rank, Phase::AllReduceExposed, t0);
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.devices[rank].ms[static_cast<int>(Phase::AllReduceHidden)] += std::max(0.0, total - exposed);
  }
  DP_CHECK(err.empty(), "all-reduce on ", devices_[rank], " failed: ", err);
  if (options_.check_finite_grads) check_finite(rank, 0, set_->copy(rank).grad.numel());
}

// Throws naming the first parameter inside [lo, hi) of rank's flat gradient that holds
// a NaN or Inf. Buckets never split a parameter, so a range is whole parameters.
void DataParallel::check_finite(int rank, std::int64_t lo, std::int64_t hi) {
  const Tensor& g = set_->copy(rank).grad;
  auto& be = backend::get(devices_[rank]);
  if (be.count_nonfinite(devices_[rank], g.data<float>() + lo, hi - lo) == 0) return;
  const auto& slots = set_->slots();
  for (std::size_t i = 0; i < slots.size(); ++i) {
    std::int64_t cnt = slots[i]->copies[0].numel();
    if (slots[i]->offset < lo || slots[i]->offset + cnt > hi) continue;
    if (be.count_nonfinite(devices_[rank], g.data<float>() + slots[i]->offset, cnt) > 0)
      DP_FAIL("non-finite gradient (NaN or Inf) in parameter '", param_names_[i], "' on ", devices_[rank],
              " — lower the learning rate, check the loss for log(0) or the data for NaN");
  }
}

DataParallel::NoSyncGuard::NoSyncGuard(DataParallel& dp) : dp_(dp), prev_(dp.require_sync_) {
  dp_.require_sync_ = false;
}
DataParallel::NoSyncGuard::~NoSyncGuard() { dp_.require_sync_ = prev_; }

}  // namespace dp
