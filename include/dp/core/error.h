// dp/core/error.h — dp's exception types and the check macros.
//
// Every public entry point reports bad input by throwing dp::Error with what was
// expected, what came, and how to fix it. A failure that callers must tell apart has
// its own type derived from dp::Error (dp::CollectiveAborted), so it travels as a type,
// never as a string parsed later. This header knows nothing about tensors, devices or
// backends.
//
//   DP_CHECK(x.dim() == 4, "conv2d: expected a 4-d input (N, C, H, W), got ", x.dim(), " dims");
//   DP_ASSERT(offset <= size);             // internal invariant, on in release builds too
//   try { ... } catch (const dp::Error& e) { std::cerr << e.what(); }
#pragma once

#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace dp {

/// The exception thrown for every user-facing failure in dp.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

/// Thrown by a collective of a communicator that was aborted (Communicator::abort): to
/// every rank blocked in a collective when abort() is called, and to every later call
/// until reset(). what() names the collective, the rank and the reason given to
/// abort(); reason() is that reason alone. A rank that gets it did not fail itself: it
/// was released because another failed, whose own error is the root cause to report.
class CollectiveAborted : public Error {
 public:
  /// `msg` becomes what(); `reason` is the reason given to abort().
  CollectiveAborted(const std::string& msg, const std::string& reason)
      : Error(msg), reason_(std::make_shared<const std::string>(reason)) {}
  /// The reason given to abort().
  const std::string& reason() const noexcept { return *reason_; }

 private:
  std::shared_ptr<const std::string> reason_;  // shared: copying an exception never throws
};

namespace detail {

/// Concatenates the streamable arguments into one string.
template <typename... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

[[noreturn]] void throw_error(const char* file, int line, const std::string& msg);
[[noreturn]] void assert_fail(const char* file, int line, const char* cond,
                              const std::string& msg);

/// Logs a message on stderr (used where throwing is not allowed, e.g. destructors).
void log_warning(const std::string& msg);

}  // namespace detail
}  // namespace dp

/// Checks user input; throws dp::Error with the message (streamed arguments) otherwise.
#define DP_CHECK(cond, ...)                                                          \
  do {                                                                               \
    if (!(cond)) [[unlikely]]                                                        \
      ::dp::detail::throw_error(__FILE__, __LINE__, ::dp::detail::str_cat(__VA_ARGS__)); \
  } while (0)

/// Throws dp::Error unconditionally.
#define DP_FAIL(...) ::dp::detail::throw_error(__FILE__, __LINE__, ::dp::detail::str_cat(__VA_ARGS__))

/// Checks an internal invariant; on in release builds too.
#define DP_ASSERT(cond, ...)                                                         \
  do {                                                                               \
    if (!(cond)) [[unlikely]]                                                        \
      ::dp::detail::assert_fail(__FILE__, __LINE__, #cond,                           \
                                ::dp::detail::str_cat("" __VA_OPT__(, ) __VA_ARGS__)); \
  } while (0)
