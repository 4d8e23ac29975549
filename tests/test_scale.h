// tests/test_scale.h — problem sizes that fit the build's speed.
//
// Under AddressSanitizer or ThreadSanitizer every memory access costs 5–20x, so tests
// whose largest buffers exist only to take the big-buffer code paths use kLargeCount
// instead of a fixed million: in a sanitized build it is ten times smaller, and still
// above every size threshold of the code under test (e.g. the local communicator's
// kSmallCount = 16384 and the CPU backend's kSerialGrain = 32768), so the same paths
// run. The macros are GCC's; clang's __has_feature spellings are checked too.
#pragma once

#include <cstdint>

namespace dp_test {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

/// An odd element count well above every size threshold: 1000003, or 100003 when
/// sanitized.
inline constexpr std::int64_t kLargeCount = kSanitized ? 100003 : 1000003;

}  // namespace dp_test
