// samples/resnet18 — ResNet-18 (CIFAR variant) trained with DataParallel, DP or DDP.
//
// Reads CIFAR-10 binary batches with --data DIR (data_batch_1..5.bin), else trains on
// synthetic 3×32×32 Gaussian-blob data and says so. SGD with momentum 0.9 and weight
// decay 5e-4; the loss of every step is printed (or collected with --json).
//
//   resnet18 --data /data/cifar-10-batches-bin --mode ddp --batch 128 --max-steps 200
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <iostream>
#include <memory>
#include <string>

#include "common/models.h"
#include "common/options.h"
#include "common/util.h"
#include "dp/data/cifar10.h"
#include "dp/data/dataloader.h"
#include "dp/data/synthetic.h"
#include "dp/dp.h"

int main(int argc, char** argv) {
  CLI::App app{"ResNet-18 (CIFAR variant) trained with dp::DataParallel (DP or DDP) on CIFAR-10 or synthetic data."};
  std::string data_dir, mode = "ddp";
  int steps = 100, log_every = 1, shard_stage = 2;
  std::string devices_spec;
  std::int64_t batch = 128;
  double lr = 0.05;
  std::uint64_t seed = 1;
  bool json = false, overfit = false, channels_last = false;
  app.add_option("--data", data_dir, "directory with CIFAR-10 binary batches (default: synthetic data)");
  samples::add_mode_option(app, mode, {"dp", "ddp", "sharded"});
  samples::add_shard_stage_option(app, shard_stage);
  app.add_option("--max-steps", steps, "training steps")->check(CLI::Range(1, 1 << 30))->capture_default_str();
  samples::add_batch_option(app, batch);
  samples::add_devices_option(app, devices_spec);
  app.add_option("--lr", lr, "SGD learning rate (momentum 0.9, weight decay 5e-4)")
      ->check(CLI::Range(1e-9, 10.0))
      ->capture_default_str();
  app.add_option("--seed", seed, "seed of the model, the data order and synthetic data")->capture_default_str();
  app.add_option("--log-every", log_every, "print the loss every N steps")->check(CLI::Range(1, 1 << 30))->capture_default_str();
  app.add_flag("--overfit-batch", overfit, "train on the first batch only (a sanity check: the loss must fall)");
  app.add_flag("--json", json, "print one JSON object (losses per step, throughput) instead of text");
  app.add_flag("--channels-last", channels_last,
               "lay the batches out channels-last (N x H x W x C), as PyTorch's torch.channels_last: the "
               "convolutions, batch norms and elementwise ops compute in that layout");
  CLI11_PARSE(app, argc, argv);

  try {
    const auto ids = samples::parse_device_ids(devices_spec, dp::device_count());
    const int ndev = static_cast<int>(ids.size());
    std::vector<dp::Device> devices;
    for (int id : ids) devices.push_back(dp::device(id));
    if (batch < ndev)
      throw std::invalid_argument("--batch " + std::to_string(batch) + " is smaller than " + std::to_string(ndev) +
                                  " devices");

    std::shared_ptr<const dp::data::Dataset> dataset;
    std::string source;
    if (!data_dir.empty()) {
      dataset = std::make_shared<dp::data::Cifar10Dataset>(data_dir, dp::data::Split::Train,
                                                           dp::data::Cifar10Options{.normalize = true});
      source = "cifar10";
    } else {
      // Lazy: every example is computed from (seed, index) when a batch asks for it.
      dataset = std::make_shared<dp::data::SyntheticDataset>(
          dp::data::SyntheticOptions{.size = 50000, .example_shape = {3, 32, 32}, .seed = seed});
      source = "synthetic";
      std::cerr << "note: no --data DIR given: training on synthetic 3x32x32 data (10 Gaussian-blob classes), "
                   "not CIFAR-10\n";
    }
    // Pinned batches on GPUs: each shard's host→device copy is then asynchronous.
    const bool pin = dp::default_device_type() == dp::DeviceType::CUDA;
    dp::data::DataLoader loader(dataset, {.batch_size = batch, .shuffle = true, .seed = seed,
                                          .drop_last = true, .pin_memory = pin});
    if (loader.size() == 0)
      throw std::invalid_argument("--batch " + std::to_string(batch) + " is larger than the dataset (" +
                                  std::to_string(dataset->size()) + " examples)");

    auto net = std::make_shared<samples::ResNet18>(seed);
    dp::DataParallel model(net, devices, samples::mode_options(mode, shard_stage));
    dp::optim::SGD opt(model.parameters(), {.lr = lr, .momentum = 0.9, .weight_decay = 5e-4});
    auto loss_fn = [](const dp::Tensor& out, const dp::Tensor& y) { return dp::nn::cross_entropy(out, y); };
    if (!json)
      std::cout << "resnet18: " << net->parameters().set()->numel() << " parameters, " << mode << " on " << ndev
                << " " << samples::device_kind() << " device(s), global batch " << batch << ", " << source
                << " data" << (overfit ? " (one batch, --overfit-batch)" : "") << ", " << steps << " steps\n";

    nlohmann::json losses = nlohmann::json::array();
    dp::data::Batch first;
    int step = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (std::uint64_t epoch = 0; step < steps; ++epoch) {
      loader.set_epoch(epoch);
      for (auto it = loader.begin(); it != loader.end() && step < steps; ++it) {
        if (overfit && !first.data.defined()) first = *it;
        const dp::data::Batch& b = overfit ? first : *it;
        opt.zero_grad();
        const dp::Tensor x = channels_last ? b.data.contiguous(dp::MemoryFormat::ChannelsLast) : b.data;
        double loss = model.forward_backward(x, b.target, loss_fn).item();
        opt.step();
        ++step;
        losses.push_back(loss);
        if (!std::isfinite(loss)) throw std::runtime_error("loss became " + std::to_string(loss) + " at step " +
                                                           std::to_string(step) + "; lower --lr");
        if (!json && (step % log_every == 0 || step == steps)) {
          double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          std::cout << "step " << step << "  loss " << samples::fmt(loss, 4) << "  " << samples::fmt(step * batch / s, 1)
                    << " samples/s\n";
        }
      }
    }
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (json) {
      std::cout << nlohmann::json{{"sample", "resnet18"},
                                  {"mode", mode},
                                  {"devices", ndev},
                                  {"global_batch", batch},
                                  {"data", source},
                                  {"overfit_batch", overfit},
                                  {"steps", steps},
                                  {"losses", losses},
                                  {"seconds", seconds},
                                  {"samples_per_s", steps * batch / seconds}}
                       .dump()
                << "\n";
    }
  } catch (const std::invalid_argument& e) {
    std::cerr << "error: " << e.what() << "\nRun with --help for more information.\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
