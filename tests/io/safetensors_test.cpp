// The safetensors format: layout, round trips, every validation, atomic writes under
// SIGKILL.
#include "dp/io/safetensors.h"

#include <doctest/doctest.h>

#include <poll.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>

#include "dp/dp.h"
#include "io_test_util.h"

using io_test::contains;
using io_test::error_of;
using io_test::ScratchDir;

namespace {

// A file from a header text and data bytes; `length` overrides the length field.
std::vector<std::uint8_t> craft(const std::string& header, const std::vector<std::uint8_t>& data = {},
                                std::optional<std::uint64_t> length = std::nullopt) {
  std::uint64_t n = length.value_or(header.size());
  std::vector<std::uint8_t> out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>((n >> (8 * i)) & 0xff));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::vector<std::uint8_t> zeros_bytes(std::size_t n) { return std::vector<std::uint8_t>(n, 0); }

// Both entry points (memory and file) must reject `bytes` with a message containing `part`.
void expect_bad(const std::vector<std::uint8_t>& bytes, const std::string& part) {
  std::string m1 = error_of([&] { dp::io::parse_safetensors(bytes.data(), bytes.size(), "crafted"); });
  CHECK_MESSAGE(contains(m1, part), "parse_safetensors said: '", m1, "', expected '", part, "'");
  ScratchDir dir;
  std::string path = dir.file("bad.safetensors");
  io_test::write_bytes(path, bytes);
  std::string m2 = error_of([&] { dp::io::read_safetensors(path); });
  CHECK_MESSAGE(contains(m2, part), "read_safetensors said: '", m2, "', expected '", part, "'");
  CHECK(contains(m2, path));  // file errors name the file
}

bool bit_equal(const dp::nn::StateDict& a, const dp::nn::StateDict& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || a[i].second.shape() != b[i].second.shape() ||
        a[i].second.dtype() != b[i].second.dtype())
      return false;
    dp::Tensor x = a[i].second.to(dp::cpu(0)), y = b[i].second.to(dp::cpu(0));
    if (x.nbytes() > 0 && std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()) != 0) return false;
  }
  return true;
}

dp::nn::StateDict sample_tensors() {
  dp::Generator gen(3);
  return {{"conv.weight", dp::randn({2, 1, 3, 3}, gen)},
          {"steps", dp::from_vector(std::vector<std::int64_t>{-1, 0, 1LL << 40, 7}, {4})},
          {"scale", dp::scalar_tensor(0.25)},
          {"empty", dp::zeros({0, 3})},
          {"bn.running_var", dp::ones({5})}};
}

dp::io::Metadata without_checksums(dp::io::Metadata m) {
  std::erase_if(m, [](const auto& kv) { return kv.first.rfind(dp::io::kChecksumPrefix, 0) == 0; });
  return m;
}

std::vector<std::string> temporaries(const ScratchDir& dir) {
  std::vector<std::string> out;
  for (auto& e : std::filesystem::directory_iterator(dir.path())) {
    std::string n = e.path().filename().string();
    if (contains(n, ".tmp.")) out.push_back(n);
  }
  return out;
}

}  // namespace

TEST_CASE("safetensors layout: LE length, padded JSON header, contiguous data in order") {
  dp::nn::StateDict t = {{"a", dp::from_vector(std::vector<float>{1.0f, -2.0f}, {2})},
                         {"b", dp::from_vector(std::vector<std::int64_t>{5}, {1, 1})}};
  auto bytes = dp::io::serialize_safetensors(t, {{"epoch", "3"}});
  // The CRC-32s as Python computes them: zlib.crc32(struct.pack('<ff', 1, -2)), …
  std::string json = R"({"__metadata__":{"format":"pt","epoch":"3","dp.crc32.a":"c3872656",)"
                     R"("dp.crc32.b":"2dc2d10d"},)"
                     R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                     R"("b":{"dtype":"I64","shape":[1,1],"data_offsets":[8,16]}})";
  json.append((8 - json.size() % 8) % 8, ' ');
  std::vector<std::uint8_t> expected = craft(json);
  float fa[2] = {1.0f, -2.0f};
  std::int64_t ib = 5;
  expected.insert(expected.end(), reinterpret_cast<std::uint8_t*>(fa), reinterpret_cast<std::uint8_t*>(fa) + 8);
  expected.insert(expected.end(), reinterpret_cast<std::uint8_t*>(&ib), reinterpret_cast<std::uint8_t*>(&ib) + 8);
  CHECK(bytes == expected);
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  CHECK(n % 8 == 0);
}

TEST_CASE("safetensors round trip in memory and through a file, bit for bit") {
  ScratchDir dir;
  auto t = sample_tensors();
  dp::io::Metadata meta{{"note", "héllo \"quoted\""}, {"format", "pt"}};
  auto bytes = dp::io::serialize_safetensors(t, meta);
  auto mem = dp::io::parse_safetensors(bytes.data(), bytes.size());
  CHECK(bit_equal(mem.tensors, t));
  CHECK(without_checksums(mem.metadata) == meta);
  CHECK(mem.metadata.at("dp.crc32.empty") == "00000000");

  std::string path = dir.file("t.safetensors");
  dp::io::write_safetensors(path, t, meta);
  CHECK(io_test::read_bytes(path) == bytes);
  auto file = dp::io::read_safetensors(path);
  CHECK(bit_equal(file.tensors, t));
  CHECK(without_checksums(file.metadata) == meta);
  for (auto& [n, x] : file.tensors) CHECK(x.device() == dp::cpu(0));

  auto info = dp::io::read_safetensors_info(path);
  REQUIRE(info.entries.size() == t.size());
  CHECK(info.entries[0].name == "conv.weight");
  CHECK(info.entries[0].shape == dp::Shape{2, 1, 3, 3});
  CHECK(info.entries[1].dtype == dp::Dtype::Int64);
  CHECK(info.header_bytes % 8 == 0);
  CHECK(temporaries(dir).empty());
}

TEST_CASE("tensors on other devices are saved from their device") {
  dp::Tensor a = dp::randn({3, 4}, dp::default_generator(), dp::cpu(1));
  auto bytes = dp::io::serialize_safetensors({{"a", a}});
  auto f = dp::io::parse_safetensors(bytes.data(), bytes.size());
  CHECK(dp::equal(f.tensors[0].second, a.to(dp::cpu(0))));
}

TEST_CASE("a file without __metadata__ and with entries in any order loads") {
  std::string h = R"({"y":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
                  R"("x":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})";
  float v[2] = {3.0f, 4.0f};
  std::vector<std::uint8_t> data(reinterpret_cast<std::uint8_t*>(v), reinterpret_cast<std::uint8_t*>(v) + 8);
  auto bytes = craft(h + "   ", data);
  auto f = dp::io::parse_safetensors(bytes.data(), bytes.size());
  REQUIRE(f.tensors.size() == 2);
  CHECK(f.tensors[0].first == "x");  // file order: ascending offsets
  CHECK(f.tensors[0].second.item() == 3.0);
  CHECK(f.tensors[1].second.to_vector() == std::vector<float>{4.0f});
  CHECK(f.metadata.empty());
}

TEST_CASE("bad files: each validation says what is wrong") {
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  SUBCASE("shorter than 8 bytes") {
    for (std::size_t n : {0, 1, 7}) expect_bad(zeros_bytes(n), "shorter than the 8-byte header length");
  }
  SUBCASE("header length beyond the file") {
    expect_bad(craft("{" + ok_entry + "}", zeros_bytes(8), 1000), "header length field says 1000 bytes");
  }
  SUBCASE("absurd header length") {
    expect_bad(craft("{}", {}, std::uint64_t{1} << 40), "more than the 100000000-byte limit");
    expect_bad(craft("{}", {}, ~std::uint64_t{0}), "more than the 100000000-byte limit");
  }
  SUBCASE("invalid JSON") {
    expect_bad(craft(R"({"a": {"dtype": )"), "is not valid JSON");
    expect_bad(craft("{\"a\":1}\x01\x02"), "is not valid JSON");
    expect_bad(craft("{\"\xff\xfe\":{}}"), "is not valid JSON");  // not UTF-8
  }
  SUBCASE("not an object") {
    expect_bad(craft("[1,2,3]"), "must be a JSON object starting with '{'");
  }
  SUBCASE("entry fields") {
    expect_bad(craft(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", zeros_bytes(8)),
               "the entry of 'a' has no 'shape' field");
    expect_bad(craft(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", zeros_bytes(8)),
               "the entry of 'a' has no 'dtype' field");
    expect_bad(craft(R"({"a":{"dtype":"F32","shape":[2]}})", zeros_bytes(8)),
               "the entry of 'a' has no 'data_offsets' field");
    expect_bad(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"foo":1}})", zeros_bytes(8)),
               "unexpected field 'foo' in the entry of 'a'");
    expect_bad(craft(R"({"a":[1,2]})"), "the entry of 'a' must be an object");
    expect_bad(craft(R"({"a":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})", zeros_bytes(8)),
               "dtype of 'a' must be a string");
    expect_bad(craft(R"({"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", zeros_bytes(8)),
               "shape of 'a' must be an array");
    expect_bad(craft(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", zeros_bytes(8)),
               "shape of 'a' must hold non-negative integers, got -2");
    expect_bad(craft(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", zeros_bytes(8)),
               "shape of 'a' must hold non-negative integers");
    expect_bad(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", zeros_bytes(8)),
               "data_offsets of 'a' must be [begin, end]");
    expect_bad(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,"8"]}})", zeros_bytes(8)),
               "data_offsets of 'a' must hold non-negative integers");
  }
  SUBCASE("duplicate names") {
    expect_bad(craft("{" + ok_entry + "," + ok_entry + "}", zeros_bytes(8)), "names 'a' twice");
    expect_bad(craft(R"({"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", zeros_bytes(8)),
               "names 'dtype' twice inside one entry");
  }
  SUBCASE("dtypes") {
    expect_bad(craft(R"({"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", zeros_bytes(8)),
               "unknown dtype 'Q7' for 'a'");
    expect_bad(craft(R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", zeros_bytes(8)),
               "dtype F64 of 'a' is not supported by dp");
  }
  SUBCASE("shape and offsets disagree") {
    expect_bad(craft(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", zeros_bytes(20)),
               "'a' has shape [2, 3] F32 = 24 bytes, but data_offsets [0, 20] span 20 bytes");
    expect_bad(craft(R"({"a":{"dtype":"I64","shape":[2],"data_offsets":[0,8]}})", zeros_bytes(8)),
               "'a' has shape [2] I64 = 16 bytes");
    expect_bad(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", zeros_bytes(8)),
               "data_offsets [8, 0] of 'a' end before they begin");
    expect_bad(craft(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,8]}})",
                     zeros_bytes(8)),
               "overflows 64-bit sizes");
  }
  SUBCASE("out of range, overlapping, gaps, size mismatch") {
    expect_bad(craft(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", zeros_bytes(8)),
               "data_offsets [0, 16] of 'a' lie outside the data region of 8 bytes");
    expect_bad(craft(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                     R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                     zeros_bytes(24)),
               "data_offsets [8, 24] of 'b' overlap [0, 16] of 'a'");
    expect_bad(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                     R"("b":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}})",
                     zeros_bytes(24)),
               "bytes [8, 16] of the data region belong to no tensor (gap before 'b')");
    expect_bad(craft("{" + ok_entry + "}", zeros_bytes(12)),
               "data region size mismatch: the header describes 8 bytes of tensor data but the file holds 12");
  }
  SUBCASE("metadata") {
    expect_bad(craft(R"({"__metadata__":{"format":"pt","n":3}})"), "'n' holds 3");
    expect_bad(craft(R"({"__metadata__":[1]})"), "\"__metadata__\" must be an object of strings");
  }
}

TEST_CASE("an empty header {} with no data is a valid empty file") {
  auto bytes = craft("{}      ");
  auto f = dp::io::parse_safetensors(bytes.data(), bytes.size());
  CHECK(f.tensors.empty());
  auto b2 = dp::io::serialize_safetensors({});
  CHECK(dp::io::parse_safetensors(b2.data(), b2.size()).tensors.empty());
}

TEST_CASE("a truncated file fails cleanly at every cut point, a flipped byte never crashes") {
  auto t = sample_tensors();
  auto bytes = dp::io::serialize_safetensors(t);
  ScratchDir dir;
  std::string path = dir.file("cut.safetensors");
  for (std::size_t cut = 0; cut < bytes.size(); ++cut) {
    CAPTURE(cut);
    std::vector<std::uint8_t> part(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(cut));
    std::string m = error_of([&] { dp::io::parse_safetensors(part.data(), part.size()); });
    CHECK(!m.empty());
    if (cut % 7 == 0 || cut < 16 || cut + 16 > bytes.size()) {  // the file path too, on a sample of cuts
      io_test::write_bytes(path, part);
      CHECK(!error_of([&] { dp::io::read_safetensors(path); }).empty());
    }
  }
  // Every single-byte corruption: either still a valid file or a dp::Error.
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    for (std::uint8_t x : {std::uint8_t{0x01}, std::uint8_t{0x80}, std::uint8_t{0xff}}) {
      auto c = bytes;
      c[i] ^= x;
      error_of([&] { dp::io::parse_safetensors(c.data(), c.size()); });
    }
  }
}

TEST_CASE("write errors: bad names and a missing directory leave nothing behind") {
  ScratchDir dir;
  std::string path = dir.file("w.safetensors");
  dp::io::write_safetensors(path, sample_tensors());
  auto before = io_test::read_bytes(path);
  dp::Tensor a = dp::ones({2});
  CHECK(contains(error_of([&] { dp::io::write_safetensors(path, {{"a", a}, {"a", a}}); }), "appears twice"));
  CHECK(contains(error_of([&] { dp::io::write_safetensors(path, {{"__metadata__", a}}); }), "reserved"));
  CHECK(contains(error_of([&] { dp::io::write_safetensors(path, {{"u", dp::Tensor()}}); }), "undefined"));
  CHECK(contains(error_of([&] { dp::io::write_safetensors(dir.file("no/such/dir/x"), {{"a", a}}); }),
                 "cannot create"));
  CHECK(contains(error_of([&] { dp::io::read_safetensors(dir.file("missing")); }), "cannot open"));
  CHECK(io_test::read_bytes(path) == before);
  CHECK(temporaries(dir).empty());
}

namespace {

// Test hooks (run inside write_safetensors).
void throwing_hook(std::uint64_t written, std::uint64_t total) {
  if (written * 2 >= total) throw dp::Error("simulated I/O failure");
}

int g_pipe = -1;
void pausing_hook(std::uint64_t written, std::uint64_t total) {
  if (written * 2 < total) return;
  char c = 'x';
  if (::write(g_pipe, &c, 1) != 1) ::_exit(3);
  for (;;) ::pause();  // the parent SIGKILLs us here, mid-write
}

struct HookReset {
  ~HookReset() { dp::io::detail::set_write_hook(nullptr); }
};

}  // namespace

TEST_CASE("an error mid-write removes the temporary and keeps the old file") {
  ScratchDir dir;
  std::string path = dir.file("w.safetensors");
  dp::io::write_safetensors(path, sample_tensors());
  auto before = io_test::read_bytes(path);
  HookReset reset;
  dp::io::detail::set_write_hook(throwing_hook);
  CHECK(contains(error_of([&] { dp::io::write_safetensors(path, {{"big", dp::ones({1 << 22})}}); }),
                 "simulated I/O failure"));
  CHECK(io_test::read_bytes(path) == before);
  CHECK(temporaries(dir).empty());
}

TEST_CASE("SIGKILL of a writer paused mid-write keeps the previous checkpoint; strays are cleaned later") {
  ScratchDir dir;
  std::string path = dir.file("ckpt.safetensors");
  auto old = sample_tensors();
  dp::io::write_safetensors(path, old);
  auto old_bytes = io_test::read_bytes(path);
  dp::nn::StateDict big = {{"w", dp::full({10 << 20}, 2.0)}};  // 40 MB: several 8 MB chunks

  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(fds[0]);
    g_pipe = fds[1];
    dp::io::detail::set_write_hook(pausing_hook);
    try {
      dp::io::write_safetensors(path, big);
    } catch (...) {
      ::_exit(2);
    }
    ::_exit(0);  // not reached: the hook pauses
  }
  ::close(fds[1]);
  pollfd p{fds[0], POLLIN, 0};
  REQUIRE(::poll(&p, 1, 60'000) == 1);
  char c = 0;
  REQUIRE(::read(fds[0], &c, 1) == 1);
  ::close(fds[0]);
  // The child is mid-write now: its temporary holds part of the data.
  auto tmps = temporaries(dir);
  REQUIRE(tmps.size() == 1);
  auto tmp_size = std::filesystem::file_size(dir.path() / tmps[0]);
  CHECK(tmp_size > 0);
  CHECK(tmp_size < 40u << 20);
  REQUIRE(::kill(pid, SIGKILL) == 0);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGKILL);

  CHECK(io_test::read_bytes(path) == old_bytes);
  CHECK(bit_equal(dp::io::read_safetensors(path).tensors, old));
  CHECK(temporaries(dir) == tmps);  // the dead writer's temporary remains…

  // …until the next write of the target removes it (its writer is gone).
  dp::io::write_safetensors(path, old);
  CHECK(temporaries(dir).empty());
  CHECK(bit_equal(dp::io::read_safetensors(path).tensors, old));
}

TEST_CASE("a write removes its target's temporaries of dead writers, never a live writer's") {
  ScratchDir dir;
  std::string path = dir.file("ckpt.safetensors");
  // A pid that cannot be running: a child that has exited and been reaped.
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) ::_exit(0);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  auto make = [&](const std::string& name) {
    io_test::write_bytes(dir.file(name), std::vector<std::uint8_t>(4096, 7));
    return name;
  };
  const std::string dead = make(dp::detail::str_cat("ckpt.safetensors.tmp.", child, ".0"));
  const std::string dead2 = make(dp::detail::str_cat("ckpt.safetensors.tmp.", child, ".17"));
  const std::string live = make(dp::detail::str_cat("ckpt.safetensors.tmp.", ::getppid(), ".3"));
  const std::string mine = make(dp::detail::str_cat("ckpt.safetensors.tmp.", ::getpid(), ".999999"));
  // A dead pid whose file is locked: a live writer in another PID namespace.
  const std::string locked = make(dp::detail::str_cat("ckpt.safetensors.tmp.", child, ".5"));
  const int lock_fd = ::open(dir.file(locked).c_str(), O_RDONLY);
  REQUIRE(lock_fd >= 0);
  REQUIRE(::flock(lock_fd, LOCK_EX) == 0);
  // Not dp's names, or another target's: never touched.
  const std::string foreign = make("ckpt.safetensors.tmp.notapid.1");
  const std::string other = make(dp::detail::str_cat("other.safetensors.tmp.", child, ".0"));

  dp::io::write_safetensors(path, sample_tensors());
  auto left = temporaries(dir);
  std::sort(left.begin(), left.end());
  std::vector<std::string> want = {live, mine, locked, foreign, other};
  std::sort(want.begin(), want.end());
  CHECK(left == want);  // `dead` and `dead2` are gone
  CHECK(bit_equal(dp::io::read_safetensors(path).tensors, sample_tensors()));

  // Once the lock is released, the next write removes that one too.
  ::close(lock_fd);
  dp::io::write_safetensors(path, sample_tensors());
  left = temporaries(dir);
  std::sort(left.begin(), left.end());
  want = {live, mine, foreign, other};
  std::sort(want.begin(), want.end());
  CHECK(left == want);
}

TEST_CASE("SIGKILL of a real 200 MB write at an arbitrary moment keeps a whole checkpoint") {
  ScratchDir dir;
  std::string path = dir.file("ckpt.safetensors");
  auto old = sample_tensors();
  dp::io::write_safetensors(path, old);
  auto old_bytes = io_test::read_bytes(path);
  constexpr std::int64_t kFloats = 50'000'000;  // 200 MB
  dp::nn::StateDict big = {{"a", dp::full({kFloats / 2}, 1.5)}, {"b", dp::full({kFloats / 2}, -3.0)}};

  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    try {
      dp::io::write_safetensors(path, big);
    } catch (...) {
      ::_exit(2);
    }
    ::_exit(0);
  }
  // Kill as soon as the temporary holds at least 1 MB.
  bool partial_seen = false;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!partial_seen && std::chrono::steady_clock::now() < deadline) {
    for (const auto& t : temporaries(dir)) {
      std::error_code ec;
      auto s = std::filesystem::file_size(dir.path() / t, ec);
      if (!ec && s >= (1u << 20)) partial_seen = true;
    }
    int st = 0;
    if (!partial_seen && ::waitpid(pid, &st, WNOHANG) == pid) {
      pid = -1;  // finished before we could catch it
      break;
    }
    if (!partial_seen) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (pid > 0) {
    ::kill(pid, SIGKILL);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
  }
  // Either the old file (killed before the rename) or the complete new one; never a mix.
  auto now = io_test::read_bytes(path);
  if (now == old_bytes) {
    CHECK(partial_seen);
    CHECK(bit_equal(dp::io::read_safetensors(path).tensors, old));
  } else {
    MESSAGE("the writer finished before the kill: checking the new file is complete");
    CHECK(bit_equal(dp::io::read_safetensors(path).tensors, big));
  }
}

TEST_CASE("safetensors writes int32 tensors as I32 and reads them back bit for bit") {
  const std::vector<std::int32_t> labels{7, -1, 2147483647, -2147483647 - 1, 0};
  dp::nn::StateDict t = {{"y", dp::from_vector(labels, {5})}};
  auto bytes = dp::io::serialize_safetensors(t, {});
  std::string json = R"({"__metadata__":{"format":"pt","dp.crc32.y":"ae4c00f9"},)"
                     R"("y":{"dtype":"I32","shape":[5],"data_offsets":[0,20]}})";
  json.append((8 - json.size() % 8) % 8, ' ');
  std::vector<std::uint8_t> expected = craft(json);
  const auto* raw = reinterpret_cast<const std::uint8_t*>(labels.data());
  expected.insert(expected.end(), raw, raw + 20);
  CHECK(bytes == expected);
  auto back = dp::io::parse_safetensors(bytes.data(), bytes.size());
  REQUIRE(back.tensors.size() == 1);
  CHECK(back.tensors[0].second.dtype() == dp::Dtype::Int32);
  CHECK(back.tensors[0].second.to_vector_i32() == labels);
  // An I32 entry whose byte span does not match its shape names both.
  expect_bad(craft(R"({"a":{"dtype":"I32","shape":[3],"data_offsets":[0,8]}})", zeros_bytes(8)),
             "'a' has shape [3] I32 = 12 bytes");
}

namespace {

// A plain bitwise CRC-32 (reflected polynomial 0xEDB88320, as zlib and Python's
// zlib.crc32): the reference the library's table-driven, pieced sums must equal.
std::uint32_t reference_crc32(const std::uint8_t* p, std::size_t n) {
  std::uint32_t c = 0xffffffffu;
  for (std::size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
  }
  return ~c;
}

std::string hex8(std::uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

}  // namespace

TEST_CASE("every tensor's CRC-32 is in the metadata; large tensors' sums (pieced, chunked) are the plain CRC") {
  ScratchDir dir;
  dp::Generator gen(8);
  // 12 MB + 4 bytes: several 8 MB write chunks and 1 MiB pieces, with a short tail.
  dp::nn::StateDict t = {{"big", dp::randn({3'000'001}, gen)}, {"small", dp::randn({3, 5}, gen)},
                         {"none", dp::zeros({0})}};
  std::string path = dir.file("sums.safetensors");
  dp::io::write_safetensors(path, t, {{"dp.crc32.big", "deadbeef"}});  // dp's key: replaced
  auto bytes = dp::io::serialize_safetensors(t);
  CHECK(io_test::read_bytes(path) == bytes);  // the file path and the memory path agree
  auto info = dp::io::read_safetensors_info(path);
  REQUIRE(info.entries.size() == 3);
  for (std::size_t i = 0; i < t.size(); ++i) {
    CAPTURE(t[i].first);
    const auto& e = info.entries[i];
    CHECK(e.has_crc32);
    const std::uint32_t want = reference_crc32(static_cast<const std::uint8_t*>(t[i].second.raw_data()),
                                               t[i].second.nbytes());
    CHECK(e.crc32 == want);
    CHECK(info.metadata.at("dp.crc32." + t[i].first) == hex8(want));
  }
  CHECK(bit_equal(dp::io::read_safetensors(path).tensors, t));
}

TEST_CASE("a flipped data bit fails the checksum of its tensor, naming the tensor and the file") {
  ScratchDir dir;
  auto t = sample_tensors();
  std::string path = dir.file("flip.safetensors");
  dp::io::write_safetensors(path, t);
  const auto good = io_test::read_bytes(path);
  const auto info = dp::io::read_safetensors_info(path);
  for (const auto& e : info.entries) {
    if (e.end == e.begin) continue;  // "empty": no byte to flip
    for (std::uint64_t at : {e.begin, (e.begin + e.end) / 2, e.end - 1}) {
      for (int bit : {0, 7}) {
        CAPTURE(e.name);
        CAPTURE(at);
        auto bad = good;
        bad[8 + info.header_bytes + at] ^= static_cast<std::uint8_t>(1u << bit);
        io_test::write_bytes(path, bad);
        std::string m = error_of([&] { dp::io::read_safetensors(path); });
        CHECK_MESSAGE(contains(m, path + ": tensor '" + e.name + "' fails its checksum (stored " + hex8(e.crc32) +
                                      ", computed "),
                      m);
        CHECK(contains(m, "the file is corrupt"));
        m = error_of([&] { dp::io::parse_safetensors(bad.data(), bad.size(), "mem"); });
        CHECK(contains(m, "mem: tensor '" + e.name + "' fails its checksum"));
      }
    }
  }
  // A malformed sum is refused; a tensor without one loads unverified.
  CHECK(bit_equal(dp::io::parse_safetensors(good.data(), good.size()).tensors, t));
  std::string h = R"({"__metadata__":{"dp.crc32.x":"12345"},"x":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})";
  expect_bad(craft(h + std::string((8 - h.size() % 8) % 8, ' '), zeros_bytes(4)),
             "metadata 'dp.crc32.x' should be 8 hex digits (a CRC-32), got \"12345\"");
}

TEST_CASE("a file without checksums (as Python's safetensors writes) loads unverified") {
  ScratchDir dir;
  std::string h = R"({"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  h.append((8 - h.size() % 8) % 8, ' ');
  float v[2] = {1.5f, -3.0f};
  std::vector<std::uint8_t> data(reinterpret_cast<std::uint8_t*>(v), reinterpret_cast<std::uint8_t*>(v) + 8);
  std::string path = dir.file("python.safetensors");
  io_test::write_bytes(path, craft(h, data));
  auto f = dp::io::read_safetensors(path);
  REQUIRE(f.tensors.size() == 1);
  CHECK(f.tensors[0].second.to_vector() == std::vector<float>{1.5f, -3.0f});
  CHECK(!dp::io::read_safetensors_info(path).entries[0].has_crc32);
  // Without a sum nothing can tell a flipped bit: the value simply differs.
  auto flipped = craft(h, data);
  flipped.back() ^= 0x01;
  io_test::write_bytes(path, flipped);
  CHECK(dp::io::read_safetensors(path).tensors[0].second.to_vector() != std::vector<float>{1.5f, -3.0f});
  io_test::write_bytes(path, craft(h, data));
  // Written again by dp, it gains its sum.
  dp::io::write_safetensors(path, f.tensors, f.metadata);
  CHECK(dp::io::read_safetensors_info(path).entries[0].has_crc32);
}
