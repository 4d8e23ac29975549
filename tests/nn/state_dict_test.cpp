// Tests for dp/nn/state_dict.h: match_state_dict's names, shapes, dtypes, strict and
// not, and its one message format (which Module, dp::load and Optimizer share).
#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dp/core/error.h"
#include "dp/nn/linear.h"
#include "dp/nn/state_dict.h"
#include "dp/optim/adam.h"

namespace nn = dp::nn;
using dp::Tensor;

namespace {

using Names = std::vector<std::string>;

Names names_of(const nn::StateDict& sd) {
  Names out;
  for (const auto& [k, v] : sd) out.push_back(k);
  return out;
}

// The dp::Error message of fn, without the " [file:line]" DP_FAIL appends.
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const dp::Error& e) {
    std::string m = e.what();
    return m.substr(0, m.rfind(" ["));
  }
  FAIL("expected a dp::Error");
  return {};
}

// A small target: a weight, a bias and an int64 counter.
nn::StateDict target() {
  return {{"fc.weight", dp::zeros({3, 2})},
          {"fc.bias", dp::zeros({3})},
          {"bn.num_batches_tracked", dp::zeros({}, dp::TensorOptions{dp::Dtype::Int64})}};
}

}  // namespace

TEST_CASE("equal names, shapes and dtypes match in the target's order") {
  nn::StateDict given = {{"bn.num_batches_tracked", dp::full({}, 7, dp::TensorOptions{dp::Dtype::Int64})},
                         {"fc.bias", dp::ones({3})},
                         {"fc.weight", dp::ones({3, 2})}};
  for (bool strict : {true, false}) {
    CAPTURE(strict);
    nn::StateDictMatch m = nn::match_state_dict(target(), given, strict);
    CHECK(names_of(m.matched) == Names{"fc.weight", "fc.bias", "bn.num_batches_tracked"});
    CHECK(m.matched[0].second.is_same(given[2].second));  // the given tensor itself, not a copy
    CHECK(m.keys.missing_keys.empty());
    CHECK(m.keys.unexpected_keys.empty());
  }
}

TEST_CASE("missing and unexpected names: strict throws naming both, non-strict reports them") {
  nn::StateDict given = {{"extra.weight", dp::zeros({1})}, {"fc.weight", dp::zeros({3, 2})},
                         {"extra.bias", dp::zeros({1})}};
  CHECK(error_of([&] { nn::match_state_dict(target(), given, /*strict=*/true); }) ==
        "load_state_dict: the names in the state dict do not match the module's. Missing from "
        "the state dict: 'fc.bias', 'bn.num_batches_tracked'. Unexpected (in the state dict, not in "
        "the module): 'extra.weight', 'extra.bias'. Pass strict=false to load the names both have.");

  nn::StateDictMatch m = nn::match_state_dict(target(), given, /*strict=*/false);
  CHECK(names_of(m.matched) == Names{"fc.weight"});
  CHECK(m.keys.missing_keys == Names{"fc.bias", "bn.num_batches_tracked"});  // target order
  CHECK(m.keys.unexpected_keys == Names{"extra.weight", "extra.bias"});      // given order

  SUBCASE("only missing, or only unexpected: the message has that part alone") {
    std::string missing = error_of([&] { nn::match_state_dict(target(), {given[1]}, true); });
    CHECK(missing.find("Missing from the state dict: 'fc.bias', 'bn.num_batches_tracked'.") != std::string::npos);
    CHECK(missing.find("Unexpected") == std::string::npos);
    nn::StateDict more = target();
    more.emplace_back("extra.weight", dp::zeros({1}));
    std::string unexpected = error_of([&] { nn::match_state_dict(target(), more, true); });
    CHECK(unexpected.find("Missing") == std::string::npos);
    CHECK(unexpected.find("Unexpected (in the state dict, not in the module): 'extra.weight'.") !=
          std::string::npos);
  }
  SUBCASE("long lists are cut after ten names") {
    nn::StateDict many;
    for (int i = 0; i < 13; ++i) many.emplace_back("x" + std::to_string(i), dp::zeros({1}));
    std::string m = error_of([&] { nn::match_state_dict({}, many, true); });
    CHECK(m.find("'x8', 'x9' … and 3 more.") != std::string::npos);
    CHECK(m.find("'x10'") == std::string::npos);
  }
}

TEST_CASE("a shape mismatch throws, strict or not, naming every misfit") {
  nn::StateDict given = target();
  given[0].second = dp::zeros({2, 3});
  given[1].second = dp::zeros({4});
  for (bool strict : {true, false}) {
    CAPTURE(strict);
    CHECK(error_of([&] { nn::match_state_dict(target(), given, strict); }) ==
          "load_state_dict: 2 tensors do not fit the module: expected [3, 2], got [2, 3] for "
          "'fc.weight'; expected [3], got [4] for 'fc.bias'. Was it saved from another architecture?");
  }
  // Non-strict skips absent names but still checks the ones both have.
  CHECK(error_of([&] { nn::match_state_dict(target(), {given[1]}, false); }) ==
        "load_state_dict: 1 tensor does not fit the module: expected [3], got [4] for 'fc.bias'. "
        "Was it saved from another architecture?");
}

TEST_CASE("a dtype mismatch names both dtypes; an undefined tensor is a misfit") {
  nn::StateDict given = target();
  given[2].second = dp::zeros({});  // float32 for the int64 counter
  CHECK(error_of([&] { nn::match_state_dict(target(), given, true); }) ==
        "load_state_dict: 1 tensor does not fit the module: expected [] int64, got [] float32 for "
        "'bn.num_batches_tracked'. Was it saved from another architecture?");
  given = target();
  given[1].second = Tensor();
  CHECK(error_of([&] { nn::match_state_dict(target(), given, false); })
            .find("expected [3] float32, got an undefined tensor for 'fc.bias'") != std::string::npos);
}

TEST_CASE("a name twice on either side is refused; the context names the load and its fixes") {
  nn::StateDict twice = target();
  twice.push_back(twice[0]);
  CHECK(error_of([&] { nn::match_state_dict(target(), twice, false); }) ==
        "load_state_dict: the name 'fc.weight' appears twice in the state dict; every name must be unique");
  nn::MatchContext ctx{.what = "load 'a.safetensors'", .target = "the target", .source = "the file",
                       .fix_names = "Rename them.", .fix_shapes = "Resize them."};
  CHECK(error_of([&] { nn::match_state_dict(twice, target(), false, ctx); }) ==
        "load 'a.safetensors': the name 'fc.weight' appears twice in the target; every name must be unique");
  CHECK(error_of([&] { nn::match_state_dict(target(), {}, true, ctx); }) ==
        "load 'a.safetensors': the names in the file do not match the target's. Missing from the "
        "file: 'fc.weight', 'fc.bias', 'bn.num_batches_tracked'. Rename them.");
  nn::StateDict wide = target();
  wide[1].second = dp::zeros({5});
  CHECK(error_of([&] { nn::match_state_dict(target(), wide, true, ctx); }) ==
        "load 'a.safetensors': 1 tensor does not fit the target: expected [3], got [5] for 'fc.bias'. "
        "Resize them.");
}

TEST_CASE("Module and Optimizer loads report through the same format") {
  auto fc = std::make_shared<nn::Linear>(2, 3);
  nn::StateDict sd = fc->state_dict();
  sd[1].second = dp::zeros({4});
  CHECK(error_of([&] { fc->load_state_dict(sd); }) ==
        "load_state_dict: 1 tensor does not fit the module: expected [3], got [4] for 'bias'. "
        "Was it saved from another architecture?");
  sd.pop_back();
  CHECK(error_of([&] { fc->load_state_dict(sd); }) ==
        "load_state_dict: the names in the state dict do not match the module's. Missing from the "
        "state dict: 'bias'. Pass strict=false to load the names both have.");
  nn::LoadResult r = fc->load_state_dict(sd, /*strict=*/false);
  CHECK(r.missing_keys == Names{"bias"});

  dp::optim::Adam opt(fc->parameters(), {.lr = 0.1});
  nn::StateDict state = {{"step", dp::full({}, 1, dp::TensorOptions{dp::Dtype::Int64})},
                         {"state.1.exp_avg", dp::zeros({3})}};
  CHECK(error_of([&] { opt.load_state_dict(state); }) ==
        "Adam.load_state_dict: the names in the state dict do not match this optimizer's. Missing "
        "from the state dict: 'state.1.exp_avg_sq'. Was it saved by another optimizer type, or "
        "for other parameters than these 2?");
  state.emplace_back("state.1.exp_avg_sq", dp::zeros({2}));
  CHECK(error_of([&] { opt.load_state_dict(state); }) ==
        "Adam.load_state_dict: 1 tensor does not fit this optimizer: expected [3], got [2] for "
        "'state.1.exp_avg_sq'. Was it saved for another model?");
}
