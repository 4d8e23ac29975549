// libFuzzer target: dp::io::parse_safetensors on arbitrary bytes (built by
// scripts/fuzz.sh).
//
// Contract under test (include/dp/io/safetensors.h): any input either parses or throws
// dp::Error; never reads outside the input, never allocates from an unchecked length.
// A parsed file must survive serialize_safetensors -> parse_safetensors unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "dp/core/error.h"
#include "dp/io/safetensors.h"
#include "dp/tensor/ops.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  dp::io::SafetensorsFile f;
  try {
    f = dp::io::parse_safetensors(data, size, "<fuzz>");
  } catch (const dp::Error&) {
    return 0;
  }
  const std::vector<std::uint8_t> again = dp::io::serialize_safetensors(f.tensors, f.metadata);
  const dp::io::SafetensorsFile g = dp::io::parse_safetensors(again.data(), again.size(), "<fuzz round trip>");
  if (g.tensors.size() != f.tensors.size()) std::abort();
  for (std::size_t i = 0; i < f.tensors.size(); ++i) {
    const auto& [na, ta] = f.tensors[i];
    const auto& [nb, tb] = g.tensors[i];
    if (na != nb || ta.dtype() != tb.dtype() || ta.shape() != tb.shape()) std::abort();
    if (!dp::equal(ta, tb) && ta.dtype() == dp::Dtype::Int64) std::abort();  // F32: NaN != NaN
  }
  for (const auto& [k, v] : f.metadata) {
    auto it = g.metadata.find(k);
    if (it == g.metadata.end() || it->second != v) std::abort();
  }
  return 0;
}
