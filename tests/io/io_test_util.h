// Helpers shared by the io tests: a scratch directory, file bytes, error capture.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "dp/core/error.h"

namespace io_test {

/// A fresh directory under $TMPDIR, removed with its contents at scope end.
class ScratchDir {
 public:
  ScratchDir() {
    std::string templ = (std::filesystem::temp_directory_path() / "dp_io_test.XXXXXX").string();
    char* made = ::mkdtemp(templ.data());
    REQUIRE(made != nullptr);
    path_ = made;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline std::vector<std::uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_bytes(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

/// The dp::Error message fn throws; "" when it returns normally. Any other exception
/// type fails the test.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const dp::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("expected dp::Error, got another exception: " << e.what());
  }
  return "";
}

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace io_test
