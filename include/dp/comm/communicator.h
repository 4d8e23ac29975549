// dp/comm/communicator.h — collectives over the devices of one process.
//
// A Communicator connects N ranks, rank i being devices()[i]. Like NCCL with one
// thread per GPU, every rank's own thread calls each collective with its rank; the
// calls of one collective must be made by all ranks in the same order. Two
// implementations: `local` for CPU virtual devices (shared memory, reduce-scatter +
// all-gather, a fixed summation order, so results are bitwise identical on every
// rank and run to run) and `nccl` for CUDA devices (enqueued on a per-device
// communication stream ordered after the device's compute stream; no host wait).
// This header knows nothing of modules, optimizers or DataParallel.
//
//   auto comm = dp::comm::make_communicator({dp::cpu(0), dp::cpu(1)});
//   // on rank r's thread:
//   comm->all_reduce(r, grad, grad, dp::comm::ReduceOp::Sum);
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dp/core/error.h"
#include "dp/tensor/tensor.h"

namespace dp::comm {

enum class ReduceOp { Sum, Average };

/// Options of a communicator.
struct CommOptions {
  /// A stream-ordered backend (NCCL) aborts every rank when one collective has not
  /// completed on its device this long after it was enqueued (a peer failed or never
  /// called it), naming the device and the collective; the CUDA copy communicator (dp
  /// devices sharing a GPU) aborts when a rank waits this long in a rendezvous, naming
  /// the ranks that never came; the local communicator's ranks are released by
  /// abort() instead, which DataParallel calls on any failure. The
  /// hierarchical communicator (CPU devices across processes) ends the job when a wait
  /// between processes makes no progress for this long or for dp::dist::timeout(),
  /// whichever is shorter (Note [Communicator timeouts], src/dist/process_group.cpp).
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
};

/// Collectives among the devices of one process (see the file comment).
class Communicator {
 public:
  virtual ~Communicator() = default;

  /// "local", "nccl", "mpi" or "hierarchical".
  virtual std::string backend_name() const = 0;
  int size() const { return static_cast<int>(devices_.size()); }
  const std::vector<Device>& devices() const { return devices_; }

  /// Note [World ranks]
  /// A communicator may span the processes of a job (make_world_communicator). Its
  /// size() ranks are still this process's devices, and the `rank` argument of every
  /// call is still the local rank (the calling device's thread); but they are world
  /// ranks [first_rank(), first_rank() + size()) of world_size() ranks in all — world
  /// rank p * size() + i is local rank i of process p, every process having the same
  /// number of devices. Everything else speaks world ranks: a root, the blocks of
  /// reduce_scatter and all_gather (block w belongs to world rank w), and every
  /// reduction, which runs over all world ranks. In one process world_size() ==
  /// size() and first_rank() == 0, so code written for world ranks runs unchanged.
  int world_size() const { return world_size_; }
  int first_rank() const { return first_rank_; }
  /// This process's ranks alone: collectives among its devices only (the communicator
  /// itself when it spans one process).
  virtual Communicator& local() { return *this; }
  /// The peers of local rank `rank` across processes: local rank `rank` of every
  /// process, one rank per process, numbered by process rank (a communicator whose
  /// `rank` argument is dp::dist::rank()); null when the communicator spans one
  /// process. Local rank `rank`'s thread alone calls it.
  virtual Communicator* peers(int /*rank*/) { return nullptr; }

  /// Note [Checked collectives]
  /// The collectives below are the same non-virtual functions for every communicator:
  /// each checks its arguments once, here in the base class, with one set of messages
  /// (the collective, the rank and its device, what was expected and what came), then
  /// calls the implementation's do_* with arguments that passed. The checks: `rank` is
  /// one this process's threads call with (rank_range()); every tensor is defined and
  /// on the rank's device; send and recv share one dtype, which the collective takes
  /// here (supports(), Note [Collective dtypes]); sizes match (reduce_scatter: send =
  /// world_size() blocks of recv; all_gather: recv = world_size() blocks of send); a
  /// root is a world rank; an all_gather's send that overlaps recv is this rank's own
  /// block of it. A rank out of range throws dp::Error on the calling thread at once
  /// (unless the implementation can still tell its peers). Any other bad argument
  /// goes to refuse(): a communicator whose ranks meet in a rendezvous (local,
  /// hierarchical, mpi, cuda-copy) makes every rank throw dp::Error naming it, so the
  /// others never wait for a rank that left; the others (nccl) throw on the calling
  /// thread. An implementation checks only what is its own (the cuda-copy
  /// communicator's overlap rules) and what needs every rank's arguments (that the
  /// ranks made the same call).

  /// recv = reduction of every rank's send. send and recv: same shape and dtype, on
  /// this rank's device; recv may be send (in place).
  void all_reduce(int rank, const Tensor& send, const Tensor& recv, ReduceOp op);
  /// Every rank's data becomes root's data.
  void broadcast(int rank, const Tensor& data, int root);
  /// Root's recv = reduction of every rank's send; recv is ignored on other ranks
  /// (may be undefined there).
  void reduce(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op);
  /// recv (count n) on rank r = reduction of every rank's send[r*n, (r+1)*n).
  void reduce_scatter(int rank, const Tensor& send, const Tensor& recv, ReduceOp op);
  /// recv[r*n, (r+1)*n) = rank r's send (count n) on every rank.
  void all_gather(int rank, const Tensor& send, const Tensor& recv);
  /// Waits (host) until this rank's enqueued collectives have finished (no-op for local).
  virtual void synchronize(int rank) = 0;

  /// Note [Deferred collectives]
  /// all_reduce() orders the device's later compute work after the collective. A
  /// gradient bucket's all-reduce must not: the compute stream would stall behind
  /// each bucket while backward still has work to do. all_reduce_deferred() leaves
  /// the compute stream running; join(rank) makes it wait, once, for every collective
  /// the rank enqueued before (no host wait). Until join, the result must not be
  /// read and the buffers must not be written by compute work. Host-synchronous
  /// backends (local) finish the collective inside the call: there the two are
  /// all_reduce() and a no-op. Checked as all_reduce (Note [Checked collectives]).
  void all_reduce_deferred(int rank, const Tensor& send, const Tensor& recv, ReduceOp op);
  /// reduce() without ordering the compute stream after it (see above).
  void reduce_deferred(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op);
  /// Orders the rank's later compute work after its deferred collectives.
  virtual void join(int /*rank*/) {}
  /// Note [Work after deferred collectives]
  /// What a deferred collective's result feeds before join — a reduced gradient piece
  /// added into the range gradient its owner keeps, a sent piece zeroed (Note [Sharded
  /// gradients]) — may not run on the compute stream: that would make it wait for the
  /// collective, the stall the deferral avoids. after_deferred(rank, work) runs `work`
  /// on rank's thread at once, with rank's device's current stream being the one its
  /// collectives run on: what `work` enqueues on that device follows every collective
  /// the rank enqueued before (reading their results, writing their buffers) and is
  /// covered by join(rank) as they are. `work` may use only memory that outlives the
  /// join or that those collectives already read (it is declared to their stream), and
  /// must not call this communicator. Host-synchronous backends finish collectives
  /// inside the call: there it is work().
  virtual void after_deferred(int /*rank*/, const std::function<void()>& work) { work(); }

  /// Note [Grouped collectives]
  /// group_start(rank) ... group_end(rank) lets a stream-ordered backend launch the
  /// collectives that rank's thread calls in between together: NCCL fuses them into
  /// one launch (ncclGroupStart/ncclGroupEnd), where each would otherwise be a launch
  /// of its own (a Sharded bucket's per-owner reduces). Results are those of the same
  /// calls made one by one, and every other communicator (local, mpi, hierarchical,
  /// cuda-copy) runs each call at once, so there the pair does nothing. In between,
  /// rank's thread calls only this communicator's collectives (not local()'s or
  /// peers()'s: NCCL's group belongs to the thread), every rank calls the same ones in
  /// the same order, and nothing reads their results or enqueues compute work on their
  /// buffers: on NCCL they are launched at group_end, where a plain collective also
  /// orders the compute stream after itself. Pairs nest (the outermost launches). Each
  /// group_start needs its group_end on every path, failures included (CollectiveGroup).
  virtual void group_start(int /*rank*/) {}
  virtual void group_end(int /*rank*/) {}

  /// Device time of the deferred collectives of completed join windows, read without
  /// waiting (stream-ordered backends time them with events; host-synchronous ones
  /// leave timing to the caller and return nothing).
  struct StreamTimes {
    double busy_ms = 0;     // the collectives' own time on the comm stream
    double exposed_ms = 0;  // compute stream waiting at join() for them to finish
    int windows = 0;        // join windows these figures cover
  };
  virtual bool times_on_device() const { return false; }
  /// Moves out the figures of every window completed since the last call.
  virtual StreamTimes take_times(int /*rank*/) { return {}; }

  /// Note [Inter-process time]
  /// A communicator that spans processes over CPU devices (hierarchical, mpi) moves
  /// its data between processes in process-level steps (Note [Hierarchical
  /// collectives]), each on one local rank's thread. process_times(rank) says how long
  /// local rank `rank`'s thread spent in them, per collective: the wall time of its
  /// process-level calls, including the wait for the slowest process (a process that
  /// arrives late makes the others' figure grow) and the zero-sized calls on the local
  /// ranks a broadcast or reduce does not route through; the local levels are left
  /// out. Thread-safe; a collective still running is left out. Every other
  /// communicator returns zeros: within one process nothing crosses, and NCCL's world
  /// communicator moves both levels in one ring on the device (time its collectives
  /// with take_times()). The caller takes the difference of two readings or calls
  /// reset_process_times() (DataParallel's reset_stats() calls it).
  enum class Collective : int { AllReduce, Broadcast, Reduce, ReduceScatter, AllGather, kCount };
  struct ProcessTimes {
    static constexpr int kKinds = static_cast<int>(Collective::kCount);
    double ms[kKinds] = {};            // wall time in process-level steps
    std::int64_t calls[kKinds] = {};   // process-level calls
    std::int64_t bytes[kKinds] = {};   // their payload, counted as nccl-tests' "size"
    double total_ms() const {
      double t = 0;
      for (double m : ms) t += m;
      return t;
    }
  };
  virtual ProcessTimes process_times(int /*rank*/) const { return {}; }
  virtual void reset_process_times() {}
  /// "all_reduce", "broadcast", "reduce", "reduce_scatter", "all_gather".
  static const char* collective_name(Collective c);

  /// Note [Collective dtypes]
  /// Broadcast and all_gather move bytes (element_size() per element); all_reduce,
  /// reduce and reduce_scatter also add, so they take a dtype only where a summation
  /// for it exists (src/comm/summation.h: a storage type accumulated in float, Sum and
  /// Average alike: float32, bfloat16 and float16, within and between processes). NCCL
  /// is the exception: it adds 16-bit tensors in its own order rounding at each hop,
  /// and its Average of them first multiplies each input by 1/N rounded to the dtype
  /// (with float16 a tiny input can become 0); dp's designs call Sum only, and the CUDA
  /// copy communicator (devices sharing a GPU) sums in float and rounds once.
  /// Integer dtypes are moved, never reduced, on every communicator: a sum of labels or
  /// indices is no training collective, an Average of them has no integer answer, and
  /// one rule everywhere keeps a model's behaviour the same on CPU and GPU. A call with
  /// a dtype its collective does not take is a dp::Error naming the dtypes it takes. A
  /// new floating dtype is a row in each table (a summand, an NCCL type, a process-group
  /// type), not a code path.
  /// True when collective `kind` takes tensors of `dtype` on this communicator. The
  /// default: movement takes every dtype, reductions the summable ones.
  virtual bool supports(Collective kind, Dtype dtype) const;

  /// Releases every rank blocked in a collective with dp::CollectiveAborted naming
  /// `reason` (used when one worker fails, so the others never hang). Until reset(),
  /// every collective and synchronize() throws dp::CollectiveAborted too. Never throws.
  /// Tensors passed to the collectives it interrupts must stay alive until every rank
  /// has returned: a released rank may leave while another still reads its buffers
  /// (the local communicator waits for that: Note [Leaving an aborted collective]).
  virtual void abort(const std::string& reason) = 0;
  /// Makes an aborted communicator usable again (all ranks idle).
  virtual void reset() = 0;

 protected:
  explicit Communicator(std::vector<Device> devices)
      : devices_(std::move(devices)), world_size_(static_cast<int>(devices_.size())),
        callers_{0, world_size_, 0, {}, false} {}
  /// A communicator spanning processes (Note [World ranks]).
  Communicator(std::vector<Device> devices, int world_size, int first_rank)
      : devices_(std::move(devices)), world_size_(world_size), first_rank_(first_rank),
        callers_{0, static_cast<int>(devices_.size()), first_rank, {}, false} {}

  /// The collectives themselves, called by the public ones with arguments that passed
  /// the checks (Note [Checked collectives]): `rank` is one of this process's, the
  /// tensors are defined, on rank's device, of one dtype that supports() allows, with
  /// matching sizes, and `root` is a world rank. The deferred ones default to the plain
  /// ones (host-synchronous backends).
  virtual void do_all_reduce(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) = 0;
  virtual void do_broadcast(int rank, const Tensor& data, int root) = 0;
  virtual void do_reduce(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) = 0;
  virtual void do_reduce_scatter(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) = 0;
  virtual void do_all_gather(int rank, const Tensor& send, const Tensor& recv) = 0;
  virtual void do_all_reduce_deferred(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) {
    do_all_reduce(rank, send, recv, op);
  }
  virtual void do_reduce_deferred(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) {
    do_reduce(rank, send, recv, root, op);
  }
  /// A call of `kind` on `rank` whose arguments failed the checks for `problem`. A
  /// communicator whose ranks meet in a rendezvous overrides it to make every rank
  /// throw dp::Error naming the problem (the others must not wait for this one); when
  /// it returns, the caller throws dp::Error on this thread alone (the default).
  /// `rank` is one of this process's ranks unless rank_range().refuse_out_of_range.
  virtual void refuse(int /*rank*/, Collective /*kind*/, const std::string& /*problem*/) {}

  /// The `rank` arguments this process's threads pass (Note [World ranks]): ranks
  /// first .. first + count - 1, of world ranks first_world ...; by default every
  /// rank 0..size()-1, at first_rank(). `hint` ends the out-of-range message ("; pass
  /// dp::dist::rank()"); refuse_out_of_range hands a bad rank to refuse() too (a
  /// communicator of one rank per process can still tell its peers).
  struct RankRange {
    int first = 0;
    int count = 0;
    int first_world = 0;
    std::string hint;
    bool refuse_out_of_range = false;
  };
  void set_rank_range(RankRange range) { callers_ = std::move(range); }
  const RankRange& rank_range() const { return callers_; }
  /// The world rank of the thread that passes `rank`.
  int world_rank_of(int rank) const { return callers_.first_world + (rank - callers_.first); }
  /// "rank 2 is out of range for the local communicator (expected 0..1)", or "" for a
  /// rank of this process.
  std::string rank_problem(int rank) const;
  /// Throws dp::Error for `what` ("synchronize", ...) unless `rank` is one of this
  /// process's ranks.
  void check_rank(int rank, const char* what) const;
  /// "all_reduce on rank 1 (cpu:1) of the local communicator": where a call was made,
  /// the start of every message about it.
  std::string call_site(const char* what, int rank) const;
  /// Throws dp::CollectiveAborted for `what` ("all_reduce", ...) called on `rank` of a
  /// communicator aborted with `reason`: the one message every implementation gives.
  [[noreturn]] void throw_aborted(const char* what, int rank, const std::string& reason) const;

  std::vector<Device> devices_;
  int world_size_ = 0;
  int first_rank_ = 0;

 private:
  /// Admits a call of `kind` on `rank` whose other arguments have `problem` ("" when
  /// none), or refuses it (Note [Checked collectives]); throws when refused.
  void admit(Collective kind, int rank, const std::string& problem);
  /// Throws (or refuses, see RankRange) unless `rank` is one of this process's ranks.
  void admit_rank(Collective kind, int rank);

  RankRange callers_;
};

/// A group of rank's collectives (Note [Grouped collectives]) from construction to
/// end(), or to destruction on a failure path (which logs what group_end throws).
///   { CollectiveGroup g(comm, rank); comm.reduce(rank, a, ...); comm.reduce(rank, b, ...); g.end(); }
class CollectiveGroup {
 public:
  CollectiveGroup(Communicator& comm, int rank) : comm_(&comm), rank_(rank) { comm.group_start(rank); }
  ~CollectiveGroup();
  CollectiveGroup(const CollectiveGroup&) = delete;
  CollectiveGroup& operator=(const CollectiveGroup&) = delete;
  /// Ends the group: on NCCL, launches its collectives; throws what group_end throws.
  void end() { std::exchange(comm_, nullptr)->group_end(rank_); }

 private:
  Communicator* comm_;
  int rank_;
};

/// A communicator over `devices` (all CPU → local, all CUDA → nccl). Throws dp::Error
/// for an empty or mixed list, duplicates, a timeout <= 0, or CUDA without NCCL.
std::unique_ptr<Communicator> make_communicator(const std::vector<Device>& devices,
                                                const CommOptions& options = {});

/// A communicator over `devices` of this process and the devices of every other
/// process of the job (dp::dist; Note [World ranks]). Collective: every process calls
/// it with its own devices, the same number and type on every process (dp::Error on
/// every process otherwise). CPU devices: a hierarchical communicator (the local one
/// within the process, the mpi one between processes); CUDA devices: one NCCL
/// communicator over every device of the job. In a job of one process (not launched
/// by mpirun, or built without MPI) it is make_communicator(devices, options).
std::unique_ptr<Communicator> make_world_communicator(const std::vector<Device>& devices,
                                                      const CommOptions& options = {});

/// The shared-memory communicator for CPU virtual devices.
std::unique_ptr<Communicator> make_local_communicator(const std::vector<Device>& devices);

}  // namespace dp::comm
