// std::cout << t (src/tensor/print.cpp, Note [Tensor printing]): libtorch's layout,
// PyTorch's summary of large tensors, the type line, and tensors that cannot be read.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "dp/core/device.h"
#include "dp/tensor/ops.h"
#include "dp/tensor/tensor.h"

namespace {

std::string printed(const dp::Tensor& t) {
  std::ostringstream os;
  os << t;
  return os.str();
}

}  // namespace

TEST_CASE("a matrix prints one row per line, then its type and shape") {
  dp::Tensor t = dp::from_vector(std::vector<float>{0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f}, {2, 3});
  CHECK(printed(t) == " 0.1000  0.2000  0.3000\n 0.4000  0.5000  0.6000\n[ CPUFloatType{2,3} ]");
  CHECK(printed(dp::ones({2, 2})) == " 1  1\n 1  1\n[ CPUFloatType{2,2} ]");
  // Signs take the column a positive value leaves blank.
  dp::Tensor s = dp::from_vector(std::vector<float>{-1.5f, 2.25f, 10.0f, -0.125f}, {2, 2});
  CHECK(printed(s) == " -1.5000   2.2500\n 10.0000  -0.1250\n[ CPUFloatType{2,2} ]");
}

TEST_CASE("a vector prints as a column; a scalar as its value; integers without decimals") {
  CHECK(printed(dp::arange(3, {dp::Dtype::Int64})) == " 0\n 1\n 2\n[ CPULongType{3} ]");
  CHECK(printed(dp::arange(3, {dp::Dtype::Int32})) == " 0\n 1\n 2\n[ CPUIntType{3} ]");
  CHECK(printed(dp::scalar_tensor(0.5)) == "0.5000\n[ CPUFloatType{} ]");
  CHECK(printed(dp::from_vector(std::vector<std::int64_t>{-12, 7}, {2})) == "-12\n  7\n[ CPULongType{2} ]");
}

TEST_CASE("magnitudes far apart print in scientific notation; NaN and infinities by name") {
  dp::Tensor t = dp::from_vector(std::vector<float>{1e-5f, 1.0f}, {2});
  CHECK(printed(t) == " 1.0000e-05\n 1.0000e+00\n[ CPUFloatType{2} ]");
  dp::Tensor n = dp::from_vector(std::vector<float>{NAN, -INFINITY, 1.5f}, {3});
  CHECK(printed(n) == "    nan\n   -inf\n 1.5000\n[ CPUFloatType{3} ]");
}

TEST_CASE("beyond 1000 elements each long dim shows its first and last three entries") {
  CHECK(printed(dp::arange(2000, {dp::Dtype::Float32})) ==
        "    0\n    1\n    2\n  ...\n 1997\n 1998\n 1999\n[ CPUFloatType{2000} ]");
  // 1000 elements exactly: printed in full.
  const std::string full = printed(dp::arange(1000, {dp::Dtype::Int64}));
  CHECK(full.find("...") == std::string::npos);
  CHECK(full.find(" 500\n") != std::string::npos);
  // A 40 x 30 matrix: rows 0-2 and 37-39, columns 0-2 and 27-29.
  dp::Tensor m = dp::arange(1200, {dp::Dtype::Float32}).reshape({40, 30});
  const std::string expected =
      "    0     1     2   ...    27    28    29\n"
      "   30    31    32   ...    57    58    59\n"
      "   60    61    62   ...    87    88    89\n"
      "  ...\n"
      " 1110  1111  1112   ...  1137  1138  1139\n"
      " 1140  1141  1142   ...  1167  1168  1169\n"
      " 1170  1171  1172   ...  1197  1198  1199\n"
      "[ CPUFloatType{40,30} ]";
  CHECK(printed(m) == expected);
}

TEST_CASE("more than two dims print one block per matrix, 1-based like libtorch") {
  CHECK(printed(dp::ones({2, 2, 2})) ==
        "(1,.,.) = \n 1  1\n 1  1\n\n(2,.,.) = \n 1  1\n 1  1\n[ CPUFloatType{2,2,2} ]");
  // Summarised along a leading dim: blocks 1-3, "...", blocks 8-10.
  const std::string big = printed(dp::zeros({10, 11, 11}));
  CHECK(big.find("(3,.,.) = ") != std::string::npos);
  CHECK(big.find("(4,.,.) = ") == std::string::npos);
  CHECK(big.find("\n...\n") != std::string::npos);
  CHECK(big.find("(8,.,.) = ") != std::string::npos);
}

TEST_CASE("the type line names a device other than device 0; empty and undefined tensors print") {
  CHECK(printed(dp::ones({2}, dp::cpu(1))) == " 1\n 1\n[ CPUFloatType{2} on cpu:1 ]");
  CHECK(printed(dp::zeros({0, 3})) == "[ CPUFloatType{0,3} ]");
  CHECK(printed(dp::Tensor()) == "[ Tensor (undefined) ]");
  // str() stays the one-line summary error messages use.
  CHECK(dp::ones({2}).str() == "Tensor[2] float32 cpu:0");
}
