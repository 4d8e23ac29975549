// checkpoint_io_bench — what a checkpoint's checksums cost: dp's write_safetensors and
// read_safetensors (a CRC-32 per tensor, Note [Tensor checksums]) against the same
// bytes written and read plainly (write, fsync, rename; one pread), alternating in one
// run, on a file of --mb megabytes (float32 tensors of 4 MB).
//
//   checkpoint_io_bench [--mb 100] [--rounds 7] [--dir /tmp]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dp/io/safetensors.h"

namespace {

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

bool plain_write(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  const std::string tmp = path + ".plain";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  bool ok = ::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()) && ::fsync(fd) == 0;
  ok = ::close(fd) == 0 && ok;
  return ok && ::rename(tmp.c_str(), path.c_str()) == 0;
}

bool plain_read(const std::string& path, std::vector<std::uint8_t>& into) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::pread(fd, into.data(), into.size(), 0) == static_cast<ssize_t>(into.size());
  ::close(fd);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  int mb = 100, rounds = 7;
  std::string dir = "/tmp";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--mb") mb = std::atoi(argv[i + 1]);
    else if (a == "--rounds") rounds = std::atoi(argv[i + 1]);
    else if (a == "--dir") dir = argv[i + 1];
  }
  if (mb < 4 || rounds < 1) {
    std::fprintf(stderr, "usage: checkpoint_io_bench [--mb N>=4] [--rounds N>=1] [--dir D]\n");
    return 2;
  }
  dp::Generator gen(1);
  dp::nn::StateDict sd;
  for (int i = 0; i < mb / 4; ++i) sd.emplace_back("layer" + std::to_string(i) + ".weight", dp::randn({1024, 1024}, gen));
  const std::string path = dir + "/checkpoint_io_bench." + std::to_string(::getpid()) + ".safetensors";
  const std::string plain = path + ".raw";

  // Validate: dp's file reads back bit for bit; the plain copy holds the same bytes.
  dp::io::write_safetensors(path, sd);
  const dp::io::SafetensorsFile back = dp::io::read_safetensors(path);
  for (std::size_t i = 0; i < sd.size(); ++i) {
    if (std::memcmp(back.tensors[i].second.raw_data(), sd[i].second.raw_data(), sd[i].second.nbytes()) != 0) {
      std::fprintf(stderr, "validation failed: tensor %zu differs\n", i);
      return 1;
    }
  }
  const std::vector<std::uint8_t> bytes = dp::io::serialize_safetensors(sd);
  std::vector<std::uint8_t> buf(bytes.size());
  if (!plain_write(plain, bytes) || !plain_read(plain, buf) || buf != bytes) {
    std::fprintf(stderr, "validation failed: the plain write/read of %s\n", plain.c_str());
    return 1;
  }

  std::vector<double> dw, pw, dr, pr;  // dp / plain, write / read; warm-up round dropped
  for (int r = 0; r <= rounds; ++r) {
    auto t = std::chrono::steady_clock::now();
    dp::io::write_safetensors(path, sd);
    const double a = ms_since(t);
    t = std::chrono::steady_clock::now();
    plain_write(plain, bytes);
    const double b = ms_since(t);
    t = std::chrono::steady_clock::now();
    (void)dp::io::read_safetensors(path);
    const double c = ms_since(t);
    t = std::chrono::steady_clock::now();
    plain_read(plain, buf);
    const double d = ms_since(t);
    if (r == 0) continue;
    dw.push_back(a), pw.push_back(b), dr.push_back(c), pr.push_back(d);
  }
  ::unlink(path.c_str());
  ::unlink(plain.c_str());
  const double gb = static_cast<double>(bytes.size()) / 1e9;
  std::printf("%.1f MB, medians of %d rounds (page cache; fsync on writes)\n", gb * 1e3, rounds);
  std::printf("%-6s %12s %12s %12s\n", "", "dp (ms)", "plain (ms)", "extra (ms)");
  std::printf("%-6s %12.1f %12.1f %12.1f\n", "write", median(dw), median(pw), median(dw) - median(pw));
  std::printf("%-6s %12.1f %12.1f %12.1f\n", "read", median(dr), median(pr), median(dr) - median(pr));
  return 0;
}
