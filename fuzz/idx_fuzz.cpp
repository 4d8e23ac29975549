// libFuzzer target: dp::data::parse_idx on arbitrary bytes (built by scripts/fuzz.sh).
//
// Contract under test (include/dp/data/idx.h): any input either parses or throws
// dp::Error; no other exception, crash, out-of-bounds read, hang or huge allocation.
// A parsed array must be self-consistent and survive encode_idx -> parse_idx unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "dp/core/error.h"
#include "dp/data/idx.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  dp::data::IdxArray a;
  try {
    a = dp::data::parse_idx(data, size, "<fuzz>");
  } catch (const dp::Error&) {
    return 0;  // the expected outcome for malformed input
  }
  // Anything other than dp::Error escapes and libFuzzer reports it as a crash.
  const std::size_t elem = dp::data::idx_element_size(a.dtype);
  if (a.bytes.size() != static_cast<std::size_t>(a.numel()) * elem) std::abort();
  const std::vector<std::uint8_t> again = dp::data::encode_idx(a);
  const dp::data::IdxArray b = dp::data::parse_idx(again.data(), again.size(), "<fuzz round trip>");
  if (b.dtype != a.dtype || b.dims != a.dims || b.bytes != a.bytes) std::abort();
  return 0;
}
