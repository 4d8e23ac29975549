#include "dp/core/error.h"

#include <cstdio>
#include <cstring>
#include <iostream>
#include <mutex>

namespace dp::detail {
namespace {

// Only the file's base name: full build paths add noise to every message.
const char* base_name(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

}  // namespace

void throw_error(const char* file, int line, const std::string& msg) {
  throw Error(str_cat(msg, " [", base_name(file), ":", line, "]"));
}

void assert_fail(const char* file, int line, const char* cond, const std::string& msg) {
  throw Error(str_cat("internal error: assertion `", cond, "` failed",
                      msg.empty() ? "" : ": ", msg, " [", base_name(file), ":", line,
                      "] — please report this"));
}

void log_warning(const std::string& msg) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  std::cerr << "dp: " << msg << '\n';
}

}  // namespace dp::detail
