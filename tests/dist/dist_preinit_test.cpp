// dp::dist in a program that initialises MPI itself (built only with MPI; run under
// mpirun by run_mpi.py):
//   dist_preinit_test serialized  MPI_Init_thread(MPI_THREAD_SERIALIZED): dp works (it
//                                 serialises its own MPI calls) and leaves MPI_Finalize
//                                 to the program; a world communicator over 2 devices
//                                 per process is refused (it needs MULTIPLE), over 1 works;
//   dist_preinit_test single      MPI_Init (MPI_THREAD_SINGLE): dp::dist::init throws a
//                                 dp::Error naming the levels, and the program can still
//                                 finalise MPI and exit cleanly.
// Exit status 0 when every check held; each failed check prints a line.
#include <mpi.h>

#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "dp/comm/communicator.h"
#include "dp/comm/mpi_communicator.h"
#include "dp/core/error.h"
#include "dp/dist/dist.h"
#include "dp/tensor/tensor.h"

namespace {

int g_failures = 0;

void check(bool ok, const char* what, const std::string& detail = {}) {
  if (ok) return;
  ++g_failures;
  std::printf("CHECK FAILED: %s %s\n", what, detail.c_str());
}

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

void serialized() {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  check(provided >= MPI_THREAD_SERIALIZED, "MPI provides SERIALIZED");
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  check(dp::dist::world_size() == size, "world_size() == MPI's size");
  check(dp::dist::rank() == world_rank(), "rank() == MPI's rank");
  check(dp::dist::all_reduce(1.0) == size, "all_reduce");
  // Two threads run collectives on two communicators at the same time: with
  // SERIALIZED dp takes turns inside MPI, call by call. Each communicator's calls are
  // made by one thread, in the same order on every process.
  auto a = dp::comm::make_mpi_communicator(dp::cpu(0));
  auto b = dp::comm::make_mpi_communicator(dp::cpu(0));
  const int r = dp::dist::rank();
  auto work = [r, size](dp::comm::Communicator& c, float v, bool* ok) {
    for (int i = 0; i < 20; ++i) {
      dp::Tensor x = dp::full({40000}, v, {dp::Dtype::Float32, dp::cpu(0)});
      c.all_reduce(r, x, x, dp::comm::ReduceOp::Sum);
      const std::vector<float> got = x.to_vector();
      *ok = *ok && got.front() == v * static_cast<float>(size) && got.back() == got.front();
    }
  };
  bool ok_a = true, ok_b = true;
  std::thread ta(work, std::ref(*a), 1.0f, &ok_a);
  std::thread tb(work, std::ref(*b), 2.0f, &ok_b);
  ta.join();
  tb.join();
  check(ok_a && ok_b, "concurrent collectives on two communicators");
  a.reset();
  b.reset();
  // The hierarchical communicator's L ranks cross processes concurrently: with more
  // than one device per process it needs MULTIPLE, and says so on every process; with
  // one it works.
  if (provided < MPI_THREAD_MULTIPLE) {
    std::string msg = "(no exception)";
    try {
      (void)dp::comm::make_world_communicator({dp::cpu(0), dp::cpu(1)});
    } catch (const dp::Error& e) {
      msg = e.what();
    }
    check(msg.find("MPI provides MPI_THREAD_SERIALIZED") != std::string::npos &&
              msg.find("needs MPI_THREAD_MULTIPLE") != std::string::npos,
          "make_world_communicator refuses 2 devices per process without MULTIPLE:", msg);
  }
  auto world = dp::comm::make_world_communicator({dp::cpu(0)});
  check(world->world_size() == size, "a world communicator of one device per process");
  dp::Tensor ones = dp::ones({7}, dp::cpu(0));
  world->all_reduce(0, ones, ones, dp::comm::ReduceOp::Sum);
  check(ones.to_vector() == std::vector<float>(7, static_cast<float>(size)),
        "all_reduce on it");
  world.reset();
  dp::dist::finalize();  // dp's last rendezvous; MPI stays up: the program owns it
  int finalized = 1;
  MPI_Finalized(&finalized);
  check(finalized == 0, "dp leaves MPI_Finalize to the program that initialised MPI");
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Finalize();
}

void single() {
  MPI_Init(nullptr, nullptr);
  int provided = 0;
  MPI_Query_thread(&provided);
  if (provided >= MPI_THREAD_SERIALIZED) {
    std::printf("MPI_Init gave a thread level >= SERIALIZED here; nothing to test\n");
  } else {
    std::string msg = "(no exception)";
    try {
      dp::dist::init();
    } catch (const dp::Error& e) {
      msg = e.what();
    }
    check(msg.find("at least MPI_THREAD_SERIALIZED") != std::string::npos &&
              msg.find("MPI_Init_thread") != std::string::npos,
          "init() refuses a thread level below SERIALIZED:", msg);
  }
  MPI_Finalize();  // the program's own; dp's exit hook must not finalise again
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "serialized") {
    serialized();
  } else if (mode == "single") {
    single();
  } else {
    std::printf("usage: dist_preinit_test serialized|single\n");
    return 2;
  }
  std::printf("%s: %d failed check(s)\n", mode.c_str(), g_failures);
  return g_failures == 0 ? 0 : 1;
}
