// The record of measured convolution layouts shared by the processes of a machine
// (Note [CPU convolution: measured choice]): a choice another process appended after
// this one read the file is adopted, not measured and recorded a second time, also
// when the file was replaced or cut short meanwhile. Its own executable: the record is
// process-wide and its file is named by DP_CONV_LAYOUT_CACHE when the process starts.
#include <doctest/doctest.h>

#include <sys/file.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "dp/core/device.h"

namespace {

using namespace dp::backend;
using i64 = std::int64_t;

cpu::CpuBackend& be() { return cpu::cpu_backend_impl(); }

Conv2dShape shape(i64 N, i64 C, i64 H, i64 K) {
  Conv2dShape s{N, C, H, H, K, 3, 3, 1, 1, 1, 1, 0, 0};
  s.P = H;
  s.Q = H;
  return s;
}

/// The shape's part of a record key (see choice_key in src/backend/cpu/cpu_conv.cpp).
std::string shape_text(const Conv2dShape& s) {
  std::ostringstream k;
  k << "|N" << s.N << ",C" << s.C << ",H" << s.H << ",W" << s.W << ",K" << s.K << ",R3,S3,st1x1,pad1x1|";
  return k.str();
}

void forward(const Conv2dShape& s) {
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  auto fill = [&](i64 n) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (float& x : v) x = dist(gen);
    return v;
  };
  auto x = fill(s.N * s.C * s.H * s.W), w = fill(s.K * s.C * 9), b = fill(s.K);
  std::vector<float> y(static_cast<std::size_t>(s.N * s.K * s.P * s.Q));
  be().conv2d_forward(dp::cpu(0), s, x.data(), w.data(), b.data(), y.data());
}

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

int count_with(const std::string& path, const std::string& key) {
  int n = 0;
  for (const std::string& line : lines_of(path)) n += line.rfind(key + ' ', 0) == 0;
  return n;
}

/// Appends `text` under the file's lock, as another process records a choice.
void append_locked(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  REQUIRE(fd >= 0);
  REQUIRE(::flock(fd, LOCK_EX) == 0);
  REQUIRE(::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  ::flock(fd, LOCK_UN);
  ::close(fd);
}

}  // namespace

TEST_CASE("conv2d layout record: another process's later choice is adopted, in a replaced or shortened file too") {
  const char* env = std::getenv("DP_CONV_LAYOUT_CACHE");
  INFO("run with DP_CONV_LAYOUT_CACHE=<scratch file> (meson test sets it)");
  REQUIRE((env != nullptr && std::string(env) != "off" && *env != '\0'));
  const std::string path = env;
  std::filesystem::remove(path);
  be().set_conv_layout(cpu::ConvLayout::Auto);

  // This process measures and records a first shape: one line, its forward's.
  const Conv2dShape first = shape(2, 3, 6, 4);
  forward(first);
  const std::vector<std::string> recorded = lines_of(path);
  REQUIRE(recorded.size() == 1);
  const std::string first_key = recorded[0].substr(0, recorded[0].find(' '));
  const std::size_t at = first_key.find(shape_text(first));
  REQUIRE(at != std::string::npos);
  // The key of another shape's forward, as any process on this machine spells it.
  auto key_of = [&](const Conv2dShape& s) {
    return first_key.substr(0, at) + shape_text(s) + first_key.substr(at + shape_text(first).size());
  };

  {
    INFO("appended after this process read the file");
    const Conv2dShape a = shape(2, 5, 6, 4), b = shape(2, 6, 6, 4);
    append_locked(path, key_of(a) + " plain plain_ms=1 blocked_ms=2\n" + key_of(b) + " blocked plain_ms=2 blocked_ms=1\n");
    forward(a);
    forward(b);
    CHECK(be().chosen_conv_layout(dp::cpu(0), a, cpu::ConvPass::Forward, true) == cpu::ConvLayout::Plain);
    CHECK(be().chosen_conv_layout(dp::cpu(0), b, cpu::ConvPass::Forward, true) == cpu::ConvLayout::Blocked);
    CHECK(count_with(path, key_of(a)) == 1);  // adopted, not recorded a second time
    CHECK(count_with(path, key_of(b)) == 1);
    // This process's own next record is read past, not taken for another's.
    const Conv2dShape c = shape(3, 3, 6, 4);
    forward(c);
    CHECK(count_with(path, key_of(c)) == 1);
    CHECK(lines_of(path).size() == 4);
  }
  {
    INFO("in a file that replaced the one read, longer than what was read of it");
    const Conv2dShape a = shape(2, 7, 6, 4);
    const std::string scratch = path + ".new";
    {
      std::ofstream out(scratch);
      out << key_of(a) << " plain plain_ms=1 blocked_ms=2\n";
      for (int i = 0; i < 50; ++i) out << "another-machine|" << i << " blocked plain_ms=2 blocked_ms=1\n";
    }
    std::filesystem::rename(scratch, path);
    forward(a);
    CHECK(be().chosen_conv_layout(dp::cpu(0), a, cpu::ConvPass::Forward, true) == cpu::ConvLayout::Plain);
    CHECK(count_with(path, key_of(a)) == 1);
  }
  {
    INFO("in a file cut short and written again");
    const Conv2dShape a = shape(2, 8, 6, 4);
    std::filesystem::resize_file(path, 0);
    append_locked(path, key_of(a) + " blocked plain_ms=2 blocked_ms=1\n");
    forward(a);
    CHECK(be().chosen_conv_layout(dp::cpu(0), a, cpu::ConvPass::Forward, true) == cpu::ConvLayout::Blocked);
    CHECK(count_with(path, key_of(a)) == 1);
  }
}
