// The communicator among the processes of a job (see mpi_communicator.h).
#include "comm/mpi/mpi_communicator.h"

#include <cstdint>

#include "dist/process_group.h"
#include "dp/core/error.h"
#include "dp/dist/dist.h"

namespace dp::comm {
namespace {

using dist::detail::ProcessGroup;
using dist::detail::Reduction;

Reduction reduction_of(ReduceOp op) {
  return op == ReduceOp::Sum ? Reduction::Sum : Reduction::Mean;
}

/// A device as one int64 (type in the high half, index in the low), for the exchange.
std::int64_t device_code(Device d) {
  return (static_cast<std::int64_t>(d.type) << 32) | static_cast<std::uint32_t>(d.index);
}
Device device_of(std::int64_t code) {
  return Device{static_cast<DeviceType>(code >> 32), static_cast<int>(code & 0xffffffff)};
}

}  // namespace

struct MpiCommunicator::Setup {
  std::unique_ptr<ProcessGroup> group;
  std::vector<Device> devices;
};

MpiCommunicator::Setup MpiCommunicator::open(Device device) {
  Setup s;
  s.group = dist::detail::new_world_group("the mpi communicator");
  const int p = s.group->size();
  std::string error;
  if (!device.is_cpu())
    error = dp::detail::str_cat(
        "device ", device, " is not a CPU device; the mpi communicator moves CPU tensors "
        "between processes (CUDA devices across processes will use NCCL; not implemented yet)");
  // Every process learns every process's device: devices()[r] is rank r's.
  std::vector<std::int64_t> codes(static_cast<std::size_t>(p));
  const std::int64_t mine = device_code(device);
  s.group->all_gather<std::int64_t>(&mine, codes.data(), 1, "make_mpi_communicator", error);
  for (std::int64_t c : codes) s.devices.push_back(device_of(c));
  return s;
}

Communicator::ProcessTimes process_times_of(const ProcessGroup& group) {
  using dist::detail::Kind;
  const ProcessGroup::Timings t = group.timings();
  Communicator::ProcessTimes out;
  auto take = [&](Kind k, Communicator::Collective c) {
    const ProcessGroup::Timing& from = t[static_cast<std::size_t>(k)];
    const auto i = static_cast<std::size_t>(c);
    out.ms[i] = from.ms;
    out.calls[i] = from.calls;
    out.bytes[i] = from.bytes;
  };
  take(Kind::AllReduce, Communicator::Collective::AllReduce);
  take(Kind::Broadcast, Communicator::Collective::Broadcast);
  take(Kind::Reduce, Communicator::Collective::Reduce);
  take(Kind::ReduceScatter, Communicator::Collective::ReduceScatter);
  take(Kind::AllGather, Communicator::Collective::AllGather);
  return out;
}

MpiCommunicator::MpiCommunicator(Device device) : MpiCommunicator(open(device)) {}

Communicator::ProcessTimes MpiCommunicator::process_times(int rank) const {
  DP_CHECK(rank == group_->rank(), "process_times (mpi): rank ", rank, " was passed but this process is rank ",
           group_->rank(), "; pass dp::dist::rank()");
  return process_times_of(*group_);
}

void MpiCommunicator::reset_process_times() { group_->reset_timings(); }

MpiCommunicator::MpiCommunicator(Setup setup)
    : Communicator(std::move(setup.devices)), group_(std::move(setup.group)) {}

MpiCommunicator::~MpiCommunicator() = default;

int MpiCommunicator::process_rank() const { return group_->rank(); }

std::string MpiCommunicator::problem(int rank, const Tensor& t, const char* name) const {
  const int me = group_->rank();
  if (rank != me)
    return dp::detail::str_cat("rank ", rank, " was passed but this process is rank ", me,
                               "; the mpi communicator has one rank per process: pass "
                               "dp::dist::rank()");
  const Device dev = devices_[static_cast<std::size_t>(me)];
  if (!t.defined()) return dp::detail::str_cat(name, " is undefined; pass a float32 tensor on ", dev);
  if (t.dtype() != Dtype::Float32)
    return dp::detail::str_cat(name, " has dtype ", dtype_name(t.dtype()),
                               "; collectives take float32 tensors");
  if (t.device() != dev)
    return dp::detail::str_cat(name, " lives on ", t.device(), " but this process's device is ",
                               dev, "; move it with .to(", dev, ")");
  return {};
}

void MpiCommunicator::all_reduce(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) {
  std::string err = problem(rank, send, "send");
  if (err.empty()) err = problem(rank, recv, "recv");
  if (err.empty() && recv.numel() != send.numel())
    err = dp::detail::str_cat("recv has ", recv.numel(), " elements but send has ", send.numel(),
                              "; they must match");
  const bool ok = err.empty();
  group_->all_reduce<float>(ok ? send.data<const float>() : nullptr, ok ? recv.data<float>() : nullptr,
                            ok ? send.numel() : 0, reduction_of(op), "all_reduce (mpi)", err);
}

void MpiCommunicator::broadcast(int rank, const Tensor& data, int root) {
  const std::string err = problem(rank, data, "data");
  const bool ok = err.empty();
  group_->broadcast(ok ? data.data<float>() : nullptr,
                    ok ? static_cast<std::int64_t>(data.nbytes()) : 0, root, "broadcast (mpi)",
                    sizeof(float), {}, err);
}

void MpiCommunicator::reduce(int rank, const Tensor& send, const Tensor& recv, int root,
                             ReduceOp op) {
  std::string err = problem(rank, send, "send");
  if (err.empty() && rank == root) {
    err = problem(rank, recv, "recv (on the root)");
    if (err.empty() && recv.numel() != send.numel())
      err = dp::detail::str_cat("recv has ", recv.numel(), " elements but send has ",
                                send.numel(), "; they must match");
  }
  const bool ok = err.empty();
  group_->reduce<float>(ok ? send.data<const float>() : nullptr,
                        ok && rank == root ? recv.data<float>() : nullptr,
                        ok ? send.numel() : 0, root, reduction_of(op), "reduce (mpi)", err);
}

void MpiCommunicator::reduce_scatter(int rank, const Tensor& send, const Tensor& recv,
                                     ReduceOp op) {
  std::string err = problem(rank, send, "send");
  if (err.empty()) err = problem(rank, recv, "recv");
  if (err.empty() && send.numel() != recv.numel() * size())
    err = dp::detail::str_cat("recv has ", recv.numel(), " elements and send ", send.numel(),
                              "; reduce_scatter needs send = ", size(), " x recv (one "
                              "recv-sized block per process)");
  const bool ok = err.empty();
  group_->reduce_scatter<float>(ok ? send.data<const float>() : nullptr,
                                ok ? recv.data<float>() : nullptr, ok ? recv.numel() : 0,
                                reduction_of(op), "reduce_scatter (mpi)", err);
}

void MpiCommunicator::all_gather(int rank, const Tensor& send, const Tensor& recv) {
  std::string err = problem(rank, send, "send");
  if (err.empty()) err = problem(rank, recv, "recv");
  if (err.empty() && recv.numel() != send.numel() * size())
    err = dp::detail::str_cat("recv has ", recv.numel(), " elements and send ", send.numel(),
                              "; all_gather needs recv = ", size(), " x send");
  const bool ok = err.empty();
  group_->all_gather<float>(ok ? send.data<const float>() : nullptr,
                            ok ? recv.data<float>() : nullptr, ok ? send.numel() : 0,
                            "all_gather (mpi)", err);
}

void MpiCommunicator::synchronize(int rank) {
  DP_CHECK(rank == group_->rank(), "synchronize (mpi): rank ", rank,
           " was passed but this process is rank ", group_->rank());
}

void MpiCommunicator::abort(const std::string& reason) {
  dist::abort("the mpi communicator was aborted: " + reason + "; ending the job");
}

void MpiCommunicator::reset() {}

std::unique_ptr<Communicator> make_mpi_communicator(Device device) {
  return std::make_unique<MpiCommunicator>(device);
}

}  // namespace dp::comm
