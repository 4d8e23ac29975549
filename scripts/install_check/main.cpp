// Built outside the source tree against the installed library (scripts/install_check.sh),
// once with pkg-config and once with CMake's find_package(dp).
#include <dp/dp.h>

#include <cstring>
#include <iostream>

int main() {
  // The headers' version and the loaded libdp's must be the same release.
  std::cout << "dp " << dp::version() << " (headers " << DP_VERSION_STRING << ")\n";
  if (std::strcmp(dp::version(), DP_VERSION_STRING) != 0) {
    std::cerr << "the loaded libdp is not the release of the headers\n";
    return 1;
  }
  auto net = std::make_shared<dp::nn::Sequential>();
  net->push_back(std::make_shared<dp::nn::Linear>(4, 8));
  net->push_back(std::make_shared<dp::nn::ReLU>());
  net->push_back(std::make_shared<dp::nn::Linear>(8, 2));
  dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)}, {.mode = dp::Mode::DDP});
  dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
  dp::Generator gen(1);
  dp::Tensor x = dp::randn({8, 4}, gen, dp::cpu(0));
  dp::Tensor y = dp::from_vector(std::vector<std::int64_t>{0, 1, 0, 1, 0, 1, 0, 1}, {8}, dp::cpu(0));
  double first = 0, last = 0;
  for (int step = 0; step < 20; ++step) {
    opt.zero_grad();
    double loss = model.forward_backward(x, y, [](const dp::Tensor& o, const dp::Tensor& t) {
                        return dp::nn::cross_entropy(o, t);
                      }).item();
    opt.step();
    if (step == 0) first = loss;
    last = loss;
  }
  std::cout << "installed dp works: loss " << first << " -> " << last << "\n";
  return last < first ? 0 : 1;
}
