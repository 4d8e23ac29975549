// Copy spans (dp/nn/copy_spans.h, Note [Copy spans]): without a runtime every copy
// owns the whole flat buffers; a runtime's CopySpans, installed on the set, answers
// for each copy instead, and what reads spans — copy_span, spans_cut,
// process_exchange, the set's zero_grad and its copy checks — follows it.
#include <doctest/doctest.h>

#include <memory>
#include <vector>

#include "dp/core/error.h"
#include "dp/nn/nn.h"
#include "dp/tensor/ops.h"

namespace nn = dp::nn;

namespace {

std::shared_ptr<nn::Sequential> make_net() {
  dp::Generator gen(3);
  return std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(4, 3, true, &gen),
                                          std::make_shared<nn::Linear>(3, 2, true, &gen));
}

/// Every process's part is this process's, twice: enough to tell it was asked.
struct Twice final : nn::ProcessExchange {
  std::vector<std::vector<float>> gather(const std::vector<float>& mine) override { return {mine, mine}; }
};

/// A runtime that cuts the buffers of a set with two copies in halves, and keeps copy
/// 1's gradient of its half itself while its buffer is released.
struct Halves final : nn::CopySpans {
  explicit Halves(nn::ParameterSet& set) : set(set) {}
  nn::CopySpan span(int copy) const override {
    const std::int64_t half = set.buffer_numel() / 2, begin = copy * half;
    const nn::ParameterCopy& c = set.copy(copy);
    const dp::Tensor grad = c.grad.defined() ? c.grad.narrow(0, begin, half) : kept;
    return {.begin = begin, .end = begin + half, .data = c.data.narrow(0, begin, half), .grad = grad};
  }
  nn::ProcessExchange* exchange() override { return across ? &twice : nullptr; }
  nn::ParameterSet& set;
  dp::Tensor kept;
  bool across = false;
  Twice twice;
};

}  // namespace

TEST_CASE("without a runtime every copy owns the whole flat buffers") {
  auto net = make_net();
  auto& set = *net->parameter_set();
  set.add_copy(dp::cpu(1), false);
  for (int r = 0; r < set.num_copies(); ++r) {
    const nn::CopySpan s = nn::copy_span(set, r);
    CHECK(s.begin == 0);
    CHECK(s.end == set.buffer_numel());
    CHECK(s.data.storage() == set.copy(r).data.storage());
    CHECK(s.data.numel() == set.buffer_numel());
    CHECK(s.owned_grad().storage() == set.copy(r).grad.storage());
  }
  CHECK_FALSE(nn::spans_cut(set));
  CHECK(nn::process_exchange(set) == nullptr);
  set.drop_copies();
}

TEST_CASE("a runtime's spans: copy_span, spans_cut, process_exchange and the set's zero_grad follow them") {
  auto net = make_net();
  auto& set = *net->parameter_set();
  set.pad_buffers(26);  // 23 parameters, padded to two halves of 13
  set.add_copy(dp::cpu(1), false);
  Halves halves(set);
  set.set_spans(&halves);
  CHECK(nn::spans_cut(set));
  const nn::CopySpan s1 = nn::copy_span(set, 1);
  CHECK(s1.begin == 13);
  CHECK(s1.end == 26);
  CHECK(s1.data.numel() == 13);
  CHECK(nn::process_exchange(set) == nullptr);
  halves.across = true;
  CHECK(nn::process_exchange(set) == &halves.twice);
  CHECK_THROWS_WITH_AS(set.add_copy(dp::cpu(2), false), doctest::Contains("cannot add a copy"), dp::Error);
  CHECK_THROWS_WITH_AS(set.drop_copies(), doctest::Contains("drop_copies"), dp::Error);
  // Copy 1's buffer released: its span's gradient is the runtime's, and zero_grad reaches it.
  halves.kept = dp::full({13}, 2.0, {.device = dp::cpu(1)});
  set.set_grad_buffer(1, dp::Tensor());
  set.copy(0).grad.fill_(3.0);
  CHECK(nn::copy_span(set, 1).grad.storage() == halves.kept.storage());
  set.zero_grad();
  for (float v : halves.kept.to_vector()) CHECK(v == 0.0f);
  for (float v : set.copy(0).grad.to_vector()) CHECK(v == 0.0f);
  // A copy with no gradient anywhere says so when its gradient is asked for.
  halves.kept = dp::Tensor();
  CHECK_THROWS_WITH_AS(nn::copy_span(set, 1).owned_grad(), doctest::Contains("has no gradient buffer"), dp::Error);
  set.set_grad_buffer(1, dp::zeros({26}, dp::cpu(1)));
  set.set_spans(nullptr);
  CHECK_FALSE(nn::spans_cut(set));
  set.drop_copies();
}
