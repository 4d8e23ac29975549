// Communicator's checking front (Note [Checked collectives]) and make_communicator, which
// picks the local or the NCCL communicator for a device list.
#include "dp/comm/communicator.h"

#include <cstddef>
#include <cstdint>
#include <span>
#include <sstream>
#include <string>
#include <unordered_set>

#include "comm/argument_checks.h"
#include "comm/nccl_factory.h"
#include "comm/summation.h"
#include "comm/world_factory.h"
#include "dp/dist/dist.h"
#include "dp/core/error.h"

namespace dp::comm {
namespace {

std::string list_str(const std::vector<Device>& devices) {
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < devices.size(); ++i) os << (i ? ", " : "") << devices[i];
  os << ']';
  return os.str();
}

}  // namespace

// ---- the checking front (Note [Checked collectives]) ------------------------------

namespace {

/// "float32, int64" : the dtypes `comm` takes for `kind`.
std::string dtypes_taken(const Communicator& comm, Communicator::Collective kind) {
  std::string out;
  for (Dtype d : kEveryDtype)
    if (comm.supports(kind, d)) out += dp::detail::str_cat(out.empty() ? "" : ", ", dtype_name(d));
  return out.empty() ? std::string("none") : out;
}

/// The first problem of a call's arguments, found by checks in the order they are
/// made ("" when every check passed). Each check runs only while none has failed.
class ArgumentCheck {
 public:
  using Collective = Communicator::Collective;
  ArgumentCheck(const Communicator& comm, Collective kind, Device dev)
      : comm_(comm), kind_(kind), dev_(dev) {}

  const std::string& problem() const { return problem_; }

  /// A defined tensor on the rank's device, of a dtype the collective takes here.
  ArgumentCheck& tensor(const Tensor& t, const char* name) {
    if (!problem_.empty()) return *this;
    if (!t.defined()) {
      problem_ = dp::detail::str_cat(name, " is undefined; pass a tensor on ", dev_);
    } else if (t.device() != dev_) {
      problem_ = dp::detail::str_cat(name, " lives on ", t.device(), " but this rank's device is ", dev_,
                                     "; move it with .to(", dev_, ")");
    } else if (!comm_.supports(kind_, t.dtype())) {
      problem_ = dp::detail::str_cat(name, " has dtype ", dtype_name(t.dtype()), ", which ",
                                     Communicator::collective_name(kind_), " does not take on the ",
                                     comm_.backend_name(), " communicator (it takes ",
                                     dtypes_taken(comm_, kind_), ")");
    }
    return *this;
  }
  /// recv is a tensor (above) of send's dtype, of the collective's size: send's elements
  /// (all_reduce, reduce), world_size() x send's (all_gather), send's / world_size()
  /// (reduce_scatter).
  ArgumentCheck& matches(const Tensor& send, const Tensor& recv, const char* recv_name) {
    tensor(recv, recv_name);
    if (!problem_.empty()) return *this;
    if (recv.dtype() != send.dtype()) {
      problem_ = dp::detail::str_cat(recv_name, " has dtype ", dtype_name(recv.dtype()), " but send has ",
                                     dtype_name(send.dtype()), "; they must match");
      return *this;
    }
    const std::int64_t w = comm_.world_size();
    if (kind_ == Collective::ReduceScatter) {
      if (send.numel() != recv.numel() * w)
        problem_ = dp::detail::str_cat("recv has ", recv.numel(), " elements and send ", send.numel(),
                                       "; reduce_scatter needs send = ", w,
                                       " x recv (one recv-sized block per world rank)");
    } else if (kind_ == Collective::AllGather) {
      if (recv.numel() != send.numel() * w)
        problem_ = dp::detail::str_cat("recv has ", recv.numel(), " elements and send ", send.numel(),
                                       "; all_gather needs recv = ", w, " x send (one block per world rank)");
    } else if (recv.numel() != send.numel()) {
      problem_ = dp::detail::str_cat("recv has ", recv.numel(), " elements but send has ", send.numel(),
                                     "; they must match");
    }
    return *this;
  }
  /// A world rank as root.
  ArgumentCheck& root(int root) {
    if (problem_.empty() && (root < 0 || root >= comm_.world_size()))
      problem_ = dp::detail::str_cat("root ", root, " is out of range (expected a world rank 0..",
                                     comm_.world_size() - 1, ")");
    return *this;
  }
  /// all_gather's send, when it overlaps recv, is block `world_rank` of it (in place).
  ArgumentCheck& own_block(const Tensor& send, const Tensor& recv, int world_rank) {
    if (!problem_.empty()) return *this;
    const auto* sp = static_cast<const std::byte*>(send.raw_data());
    const auto* rp = static_cast<const std::byte*>(recv.raw_data());
    if (overlaps(sp, send.nbytes(), rp, recv.nbytes()) &&
        sp != rp + send.nbytes() * static_cast<std::size_t>(world_rank))
      problem_ = dp::detail::str_cat("send overlaps recv but is not recv's block ", world_rank,
                                     " (this rank's world rank); in place, pass send = recv.narrow(0, ",
                                     world_rank, " * n, n)");
    return *this;
  }

 private:
  const Communicator& comm_;
  const Collective kind_;
  const Device dev_;
  std::string problem_;
};

}  // namespace

bool Communicator::supports(Collective kind, Dtype dtype) const {
  const bool reduces = kind == Collective::AllReduce || kind == Collective::Reduce ||
                       kind == Collective::ReduceScatter;
  return reduces ? summable(dtype) : true;
}

std::string Communicator::rank_problem(int rank) const {
  const RankRange& r = callers_;
  if (rank >= r.first && rank < r.first + r.count) return {};
  const std::string expected = r.count == 1 ? dp::detail::str_cat(r.first)
                                            : dp::detail::str_cat(r.first, "..", r.first + r.count - 1);
  return dp::detail::str_cat("rank ", rank, " is out of range for the ", backend_name(), " communicator (expected ",
                             expected, r.hint, ")");
}

void Communicator::check_rank(int rank, const char* what) const {
  const std::string problem = rank_problem(rank);
  DP_CHECK(problem.empty(), what, ": ", problem);
}

std::string Communicator::call_site(const char* what, int rank) const {
  return dp::detail::str_cat(what, " on rank ", rank, " (", devices_[static_cast<std::size_t>(rank)], ") of the ",
                             backend_name(), " communicator");
}

void Communicator::admit_rank(Collective kind, int rank) {
  const std::string problem = rank_problem(rank);
  if (problem.empty()) return;
  if (callers_.refuse_out_of_range) refuse(rank, kind, problem);
  DP_FAIL(collective_name(kind), ": ", problem);
}

void Communicator::admit(Collective kind, int rank, const std::string& problem) {
  if (problem.empty()) return;
  refuse(rank, kind, problem);
  DP_FAIL(call_site(collective_name(kind), rank), ": ", problem);
}

void Communicator::all_reduce(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) {
  admit_rank(Collective::AllReduce, rank);
  ArgumentCheck check(*this, Collective::AllReduce, devices_[static_cast<std::size_t>(rank)]);
  admit(Collective::AllReduce, rank, check.tensor(send, "send").matches(send, recv, "recv").problem());
  do_all_reduce(rank, send, recv, op);
}

void Communicator::all_reduce_deferred(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) {
  admit_rank(Collective::AllReduce, rank);
  ArgumentCheck check(*this, Collective::AllReduce, devices_[static_cast<std::size_t>(rank)]);
  admit(Collective::AllReduce, rank, check.tensor(send, "send").matches(send, recv, "recv").problem());
  do_all_reduce_deferred(rank, send, recv, op);
}

void Communicator::broadcast(int rank, const Tensor& data, int root) {
  admit_rank(Collective::Broadcast, rank);
  ArgumentCheck check(*this, Collective::Broadcast, devices_[static_cast<std::size_t>(rank)]);
  admit(Collective::Broadcast, rank, check.root(root).tensor(data, "data").problem());
  do_broadcast(rank, data, root);
}

/// reduce's checks: recv only on the root (a world rank), where it must match send.
static std::string reduce_problem(ArgumentCheck& check, const Tensor& send, const Tensor& recv, int root,
                                  bool is_root) {
  check.root(root).tensor(send, "send");
  if (is_root) check.matches(send, recv, "recv (on the root)");
  return check.problem();
}

void Communicator::reduce(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) {
  admit_rank(Collective::Reduce, rank);
  ArgumentCheck check(*this, Collective::Reduce, devices_[static_cast<std::size_t>(rank)]);
  admit(Collective::Reduce, rank, reduce_problem(check, send, recv, root, world_rank_of(rank) == root));
  do_reduce(rank, send, recv, root, op);
}

void Communicator::reduce_deferred(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) {
  admit_rank(Collective::Reduce, rank);
  ArgumentCheck check(*this, Collective::Reduce, devices_[static_cast<std::size_t>(rank)]);
  admit(Collective::Reduce, rank, reduce_problem(check, send, recv, root, world_rank_of(rank) == root));
  do_reduce_deferred(rank, send, recv, root, op);
}

void Communicator::reduce_scatter(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) {
  admit_rank(Collective::ReduceScatter, rank);
  ArgumentCheck check(*this, Collective::ReduceScatter, devices_[static_cast<std::size_t>(rank)]);
  admit(Collective::ReduceScatter, rank, check.tensor(send, "send").matches(send, recv, "recv").problem());
  do_reduce_scatter(rank, send, recv, op);
}

void Communicator::all_gather(int rank, const Tensor& send, const Tensor& recv) {
  admit_rank(Collective::AllGather, rank);
  ArgumentCheck check(*this, Collective::AllGather, devices_[static_cast<std::size_t>(rank)]);
  check.tensor(send, "send").matches(send, recv, "recv").own_block(send, recv, world_rank_of(rank));
  admit(Collective::AllGather, rank, check.problem());
  do_all_gather(rank, send, recv);
}

void Communicator::throw_aborted(const char* what, int rank, const std::string& reason) const {
  throw CollectiveAborted(
      dp::detail::str_cat(what, " on rank ", rank, " (", devices_[static_cast<std::size_t>(rank)],
                          ") of the ", backend_name(), " communicator: collective aborted: ",
                          reason, " (call reset() once every rank has left the collective)"),
      reason);
}

CollectiveGroup::~CollectiveGroup() {
  if (comm_ == nullptr) return;
  try {  // a failure path: the group must still close (Note [Grouped collectives])
    comm_->group_end(rank_);
  } catch (const std::exception& e) {  // destructors never throw
    detail::log_warning(detail::str_cat("group_end on rank ", rank_, " while unwinding: ", e.what()));
  }
}

const char* Communicator::collective_name(Collective c) {
  switch (c) {
    case Collective::AllReduce: return "all_reduce";
    case Collective::Broadcast: return "broadcast";
    case Collective::Reduce: return "reduce";
    case Collective::ReduceScatter: return "reduce_scatter";
    case Collective::AllGather: return "all_gather";
    case Collective::kCount: break;
  }
  return "?";
}

static void make_communicator_checks(const std::vector<Device>& devices, const CommOptions& options) {
  DP_CHECK(!devices.empty(),
           "make_communicator: expected at least one device, got an empty list");
  DP_CHECK(options.timeout.count() > 0, "make_communicator: expected a positive timeout, got ",
           options.timeout.count(), " ms");
  std::unordered_set<Device> seen;
  for (const Device& d : devices) {
    DP_CHECK(d.type == devices[0].type, "make_communicator: expected devices of one type, got ",
             list_str(devices), " (mixed CPU and CUDA); a communicator connects either CPU ",
             "virtual devices or CUDA devices");
    DP_CHECK(seen.insert(d).second, "make_communicator: device ", d, " appears twice in ",
             list_str(devices), "; each rank needs its own device");
  }
}

std::unique_ptr<Communicator> make_communicator(const std::vector<Device>& devices,
                                                const CommOptions& options) {
  make_communicator_checks(devices, options);
  if (devices[0].is_cuda()) return make_nccl_communicator(devices, options);
  return make_local_communicator(devices);
}

std::unique_ptr<Communicator> make_world_communicator(const std::vector<Device>& devices,
                                                      const CommOptions& options) {
  if (!dist::is_distributed()) return make_communicator(devices, options);
  // Every process learns what the others passed before anything is built, so a bad
  // list fails on every process alike instead of leaving the others waiting.
  std::string mine;
  try {
    make_communicator_checks(devices, options);
  } catch (const Error& e) {
    mine = e.what();
  }
  const std::int64_t count = static_cast<std::int64_t>(devices.size());
  const std::int64_t type = devices.empty() ? -1 : static_cast<std::int64_t>(devices[0].type);
  std::int64_t facts[] = {count, -count, type, -type, mine.empty() ? 0 : 1};
  dist::all_reduce(std::span<std::int64_t>(facts), dist::Op::Max);
  DP_CHECK(mine.empty(), mine);
  DP_CHECK(facts[4] == 0, "make_world_communicator: another process of the job passed a bad device list "
           "(its own error says which); this process (rank ", dist::rank(), ") passed ", list_str(devices));
  DP_CHECK(facts[0] == -facts[1], "make_world_communicator: every process must use the same number of devices "
           "(world rank = process * local devices + local index), but the processes passed between ", -facts[1],
           " and ", facts[0], " (this process, rank ", dist::rank(), ": ", count, ")");
  DP_CHECK(facts[2] == -facts[3], "make_world_communicator: every process must use devices of one type, but "
           "some passed CPU devices and others CUDA devices (this process, rank ", dist::rank(), ": ",
           list_str(devices), ")");
  if (devices[0].is_cuda()) return make_nccl_world_communicator(devices, options);
  return make_hierarchical_communicator(devices, options);
}

}  // namespace dp::comm
