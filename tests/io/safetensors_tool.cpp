// safetensors_tool — the C++ side of tests/io/safetensors_interop.py.
//
//   safetensors_tool write <path>   saves a small seeded CNN with dp::save and prints
//                                   its state_dict as JSON (name → dtype, shape, values)
//   safetensors_tool load <path>    loads <path> into the same CNN (strict) and prints
//                                   the loaded state_dict the same way
// Exit status 1 with the dp::Error on stderr when a load fails.
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "dp/dp.h"
#include "dp/io/checkpoint.h"

namespace {

struct SmallCNN : dp::nn::Module {
  SmallCNN() {
    features = register_module("features", std::make_shared<dp::nn::Sequential>());
    features->push_back(std::make_shared<dp::nn::Conv2d>(1, 4, 3, 1, 1));
    features->push_back(std::make_shared<dp::nn::BatchNorm2d>(4));
    features->push_back(std::make_shared<dp::nn::ReLU>());
    features->push_back(std::make_shared<dp::nn::MaxPool2d>(2));
    classifier = register_module("classifier", std::make_shared<dp::nn::Sequential>());
    classifier->push_back(std::make_shared<dp::nn::Flatten>());
    classifier->push_back(std::make_shared<dp::nn::Linear>(4 * 4 * 4, 10));
  }
  dp::Tensor forward(const dp::Tensor& x) override { return classifier->forward(features->forward(x)); }
  std::shared_ptr<dp::nn::Sequential> features, classifier;
};

nlohmann::ordered_json describe(dp::nn::Module& m) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (auto& [name, t] : m.state_dict()) {
    nlohmann::ordered_json e;
    e["dtype"] = t.dtype() == dp::Dtype::Float32 ? "F32" : "I64";
    e["shape"] = t.shape();
    if (t.dtype() == dp::Dtype::Float32) {
      nlohmann::ordered_json v = nlohmann::ordered_json::array();
      for (float f : t.to_vector()) v.push_back(static_cast<double>(f));  // exact
      e["values"] = std::move(v);
    } else {
      e["values"] = t.to_vector_i64();
    }
    out[name] = std::move(e);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 || (std::string(argv[1]) != "write" && std::string(argv[1]) != "load")) {
    std::cerr << "usage: safetensors_tool write|load <path>\n";
    return 2;
  }
  const std::string cmd = argv[1], path = argv[2];
  try {
    dp::manual_seed(cmd == "write" ? 17 : 99);
    SmallCNN net;
    if (cmd == "write") {
      // One training-mode forward so BatchNorm's running stats and counter are non-trivial.
      dp::Generator gen(5);
      net.forward(dp::randn({6, 1, 8, 8}, gen));
      dp::save(net, path, {{"producer", "dp safetensors_tool"}});
    } else {
      dp::load(net, path);
    }
    std::cout << describe(net).dump() << "\n";
  } catch (const dp::Error& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
