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
  check_rank(rank, "process_times (mpi)");
  return process_times_of(*group_);
}

void MpiCommunicator::reset_process_times() { group_->reset_timings(); }

MpiCommunicator::MpiCommunicator(Setup setup)
    : Communicator(std::move(setup.devices)), group_(std::move(setup.group)) {
  const int me = group_->rank();
  set_rank_range({me, 1, me, "; the mpi communicator has one rank per process: pass dp::dist::rank()",
                  /*refuse_out_of_range=*/true});
}

MpiCommunicator::~MpiCommunicator() = default;

int MpiCommunicator::process_rank() const { return group_->rank(); }

bool process_level_supports(Communicator::Collective kind, Dtype dtype) {
  using Kind = Communicator::Collective;
  if (kind == Kind::Broadcast) return true;
  if (kind == Kind::AllGather) return with_process_type(dtype, []<typename T>() {});
  return with_process_summand(dtype, []<typename T>() {});
}

bool MpiCommunicator::supports(Collective kind, Dtype dtype) const { return process_level_supports(kind, dtype); }

void refuse_on_group(ProcessGroup& g, Communicator::Collective kind, const char* what, const std::string& problem) {
  // The same kind of call the other processes make, so their message names the
  // collective; with `problem` set no data moves and every process throws.
  using Kind = Communicator::Collective;
  switch (kind) {
    case Kind::AllReduce: g.all_reduce<float>(nullptr, nullptr, 0, Reduction::Sum, what, problem); break;
    case Kind::Broadcast: g.broadcast(nullptr, 0, 0, what, sizeof(float), {}, problem); break;
    case Kind::Reduce: g.reduce<float>(nullptr, nullptr, 0, 0, Reduction::Sum, what, problem); break;
    case Kind::ReduceScatter: g.reduce_scatter<float>(nullptr, nullptr, 0, Reduction::Sum, what, problem); break;
    case Kind::AllGather: g.all_gather<float>(nullptr, nullptr, 0, what, problem); break;
    case Kind::kCount: break;  // not a collective
  }
  DP_FAIL(what, ": ", problem);  // not reached: the group threw
}

namespace {

/// "all_reduce (mpi)": the name the group's messages give a call.
std::string mpi_name(Communicator::Collective kind) {
  return dp::detail::str_cat(Communicator::collective_name(kind), " (mpi)");
}

}  // namespace

void MpiCommunicator::refuse(int /*rank*/, Collective kind, const std::string& problem) {
  refuse_on_group(*group_, kind, mpi_name(kind).c_str(), problem);
}

void MpiCommunicator::do_all_reduce(int /*rank*/, const Tensor& send, const Tensor& recv, ReduceOp op) {
  const std::string what = mpi_name(Collective::AllReduce);
  with_process_summand(send.dtype(), [&]<typename T>() {
    group_->all_reduce<T>(send.data<const T>(), recv.data<T>(), send.numel(), reduction_of(op), what.c_str());
  });
}

void MpiCommunicator::do_broadcast(int /*rank*/, const Tensor& data, int root) {
  group_->broadcast(data.raw_data(), static_cast<std::int64_t>(data.nbytes()), root,
                    mpi_name(Collective::Broadcast).c_str(), static_cast<std::int64_t>(element_size(data.dtype())));
}

void MpiCommunicator::do_reduce(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) {
  const std::string what = mpi_name(Collective::Reduce);
  with_process_summand(send.dtype(), [&]<typename T>() {
    group_->reduce<T>(send.data<const T>(), rank == root ? recv.data<T>() : nullptr, send.numel(), root,
                      reduction_of(op), what.c_str());
  });
}

void MpiCommunicator::do_reduce_scatter(int /*rank*/, const Tensor& send, const Tensor& recv, ReduceOp op) {
  const std::string what = mpi_name(Collective::ReduceScatter);
  with_process_summand(send.dtype(), [&]<typename T>() {
    group_->reduce_scatter<T>(send.data<const T>(), recv.data<T>(), recv.numel(), reduction_of(op), what.c_str());
  });
}

void MpiCommunicator::do_all_gather(int /*rank*/, const Tensor& send, const Tensor& recv) {
  const std::string what = mpi_name(Collective::AllGather);
  with_process_type(send.dtype(), [&]<typename T>() {
    group_->all_gather<T>(send.data<const T>(), recv.data<T>(), send.numel(), what.c_str());
  });
}

void MpiCommunicator::synchronize(int rank) { check_rank(rank, "synchronize (mpi)"); }

void MpiCommunicator::abort(const std::string& reason) {
  dist::abort("the mpi communicator was aborted: " + reason + "; ending the job");
}

void MpiCommunicator::reset() {}

std::unique_ptr<Communicator> make_mpi_communicator(Device device) {
  return std::make_unique<MpiCommunicator>(device);
}

}  // namespace dp::comm
