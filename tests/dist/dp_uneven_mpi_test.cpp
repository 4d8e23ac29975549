// Uneven batch counts across processes through DataParallel (Note [Uneven data],
// src/dist/dist.cpp), under mpirun -np 2 (tests/dist/meson.build):
//   --uneven=ddp        DDP, forward_backward: the last process runs one step fewer and
//                       returns from main; every process must end non-zero, naming it;
//   --uneven=dp_module  the same in DP mode through model(x) + backward();
//   --uneven=agree      the workaround: the processes' loaders differ in length, they
//                       agree on the step count first (dist::all_reduce(..., Min)), and
//                       the job ends well with the same parameters on every process.
// A process that gets past a step its peer never joined prints "got through", which the
// runner refuses.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "../parallel/mlp_fixture.h"
#include "dp/dp.h"

namespace dist = dp::dist;

namespace {

constexpr int kSteps = 3;
constexpr std::int64_t kRows = 8;  // per process and step

int run(const std::string& mode) {
  auto net = make_mlp(7);
  const dp::Mode design = mode == "dp_module" ? dp::Mode::DP : dp::Mode::DDP;
  dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)}, {.mode = design});
  dp::optim::SGD opt(model.parameters(), {.lr = 0.05});
  const bool last = dist::rank() == dist::world_size() - 1;
  // This process's loader: the last one has a batch fewer.
  const int batches = last ? kSteps - 1 : kSteps;
  int steps = batches;
  if (mode == "agree") steps = static_cast<int>(dist::all_reduce(std::int64_t{batches}, dist::Op::Min));
  for (int s = 0; s < steps; ++s) {
    Batch b = make_batch(kRows, 100 * static_cast<std::uint64_t>(dist::rank()) + static_cast<std::uint64_t>(s));
    opt.zero_grad();
    if (mode == "dp_module") {
      dp::Tensor loss = loss_fn(model(b.x), b.y);
      loss.backward();
    } else {
      (void)model.forward_backward(b.x, b.y, loss_fn);
    }
    opt.step();
    if (s == kSteps - 1)
      std::cout << "UNEVEN-TEST: rank " << dist::rank() << " got through step " << s
                << " that a peer never joined\n" << std::flush;
  }
  if (mode != "agree") {
    std::cout << "UNEVEN-TEST: rank " << dist::rank() << " leaves after " << steps << " steps\n" << std::flush;
    return 0;  // the last process returns early: main's normal exit
  }
  const std::vector<float> mine = flat(net->state_dict());
  const std::vector<float> rank0 = dist::broadcast_object(mine, 0);
  const bool same = mine.size() == rank0.size() &&
                    std::memcmp(mine.data(), rank0.data(), mine.size() * sizeof(float)) == 0;
  if (steps != kSteps - 1 || !same) {
    std::cerr << "rank " << dist::rank() << ": agreed on " << steps << " steps (expected " << kSteps - 1
              << "), parameters " << (same ? "equal to" : "differ from") << " rank 0's\n";
    return 1;
  }
  if (dist::is_main()) std::cout << "UNEVEN-TEST: every process ran " << steps << " steps, parameters equal\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--uneven=", 0) == 0) mode = arg.substr(9);
  }
  if (mode != "ddp" && mode != "dp_module" && mode != "agree") {
    std::cerr << "usage: dp_uneven_mpi_test --uneven=ddp|dp_module|agree\n";
    return 2;
  }
  return run(mode);
}
