// samples/toy — the smallest complete DataParallel program: PyTorch's DDP-tutorial
// ToyModel (Linear 10→10, ReLU, Linear 10→5), MSE loss, SGD lr 0.001, one fixed batch.
//
//   toy --mode ddp --max-steps 5
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <iostream>

#include "common/models.h"
#include "common/options.h"
#include "dp/dp.h"

int main(int argc, char** argv) {
  CLI::App app{"ToyModel (10-10-5) trained with dp::DataParallel; prints the loss per step."};
  std::string mode = "dp";
  int steps = 10, shard_stage = 2;
  bool json = false;
  samples::add_mode_option(app, mode, {"dp", "ddp", "sharded"});
  samples::add_shard_stage_option(app, shard_stage);
  app.add_option("--max-steps", steps, "training steps")->check(CLI::Range(1, 1 << 30))->capture_default_str();
  samples::add_json_option(app, json, "print one JSON object instead of text");
  CLI11_PARSE(app, argc, argv);
  try {
    auto net = std::make_shared<samples::ToyModel>(/*seed=*/0);
    dp::DataParallel model(net, std::vector<int>{}, samples::mode_options(mode, shard_stage));  // every device
    dp::optim::SGD opt(model.parameters(), {.lr = 0.001});
    dp::Generator gen(42);
    dp::Tensor x = dp::randn({20, 10}, gen), y = dp::randn({20, 5}, gen);  // one batch of 20
    nlohmann::json losses = nlohmann::json::array();
    for (int step = 1; step <= steps; ++step) {
      opt.zero_grad();
      dp::Tensor loss = dp::nn::mse_loss(model(x), y);
      loss.backward();
      opt.step();
      losses.push_back(loss.item());
      if (!json) std::cout << "step " << step << "  loss " << loss.item() << "\n";
    }
    if (json)
      std::cout << nlohmann::json{{"sample", "toy"}, {"mode", mode}, {"devices", model.devices().size()},
                                  {"steps", steps}, {"losses", losses}}.dump() << "\n";
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
