// The safetensors format: a validating parser over a header, and an atomic writer.
#include "dp/io/safetensors.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <iterator>
#include <optional>
#include <set>
#include <nlohmann/json.hpp>
#include <tbb/parallel_for.h>
#include <zlib.h>

#include "dp/core/error.h"

namespace dp::io {

// The data region is copied byte for byte into tensors: the host must store F32 and
// I64 little-endian, as the format does.
static_assert(std::endian::native == std::endian::little,
              "dp's safetensors code assumes a little-endian host");

namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr const char* kMetadataKey = "__metadata__";

std::atomic<detail::WriteHook> g_write_hook{nullptr};

std::string errno_text(int err) { return std::strerror(err); }

// ---- checksums ------------------------------------------------------------------------

// Note [Tensor checksums]
// Each tensor's bytes get a CRC-32 (zlib's: the ISO-HDLC polynomial of gzip and PNG)
// in the metadata as "dp.crc32.<name>" = 8 lowercase hex digits. Why CRC-32 and not a
// 64-bit hash: it catches what a checkpoint meets — flipped bits and torn or zeroed
// blocks — with guarantees (every error burst of up to 32 bits, every 1- and 2-bit
// error in a tensor under 2^31 bits long), and random damage beyond that slips through
// with probability 2^-32, negligible for accidents (it is no defence against
// tampering, which no unkeyed checksum is); and anyone can check it without dp
// (Python: zlib.crc32(array.tobytes())). zlib's table-driven CRC runs at about 4 GB/s
// per core; large tensors are cut into 1 MiB pieces summed on every core and joined
// with crc32_combine (the same value as one pass). The writer cannot know the sums
// before the bytes pass, and the header comes first: it writes the header with
// zeros, computes the sums as the data streams out, then writes the header again in
// place — the same length, since every sum is 8 digits (Note [Atomic checkpoint
// writes] still holds: the temporary is complete before it is renamed). Readers
// verify every tensor that has a sum and name the first that fails; a file without
// sums (Python's safetensors writes none) loads unverified. Verifying costs one CRC
// pass over the bytes read (docs/RELIABILITY.md gives the measured figure).
constexpr std::size_t kCrcPiece = std::size_t{1} << 20;  // pieces worth a task each

std::uint32_t crc32_of(const std::uint8_t* p, std::size_t n) {
  if (n < 4 * kCrcPiece) return static_cast<std::uint32_t>(::crc32_z(0, p, n));
  const std::size_t pieces = (n + kCrcPiece - 1) / kCrcPiece;
  std::vector<uLong> sums(pieces);
  tbb::parallel_for(std::size_t{0}, pieces, [&](std::size_t i) {
    const std::size_t len = std::min(kCrcPiece, n - i * kCrcPiece);
    sums[i] = ::crc32_z(0, p + i * kCrcPiece, len);
  });
  uLong crc = sums[0];
  for (std::size_t i = 1; i < pieces; ++i) {
    const std::size_t len = std::min(kCrcPiece, n - i * kCrcPiece);
    crc = ::crc32_combine(crc, sums[i], static_cast<z_off_t>(len));
  }
  return static_cast<std::uint32_t>(crc);
}

// The CRC-32 of a followed by b, from their sums and b's length.
std::uint32_t crc32_append(std::uint32_t a, std::uint32_t b, std::size_t b_len) {
  return static_cast<std::uint32_t>(::crc32_combine(a, b, static_cast<z_off_t>(b_len)));
}

std::string crc_hex(std::uint32_t crc) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", crc);
  return buf;
}

bool is_checksum_key(const std::string& key) {
  return key.compare(0, std::strlen(kChecksumPrefix), kChecksumPrefix) == 0;
}

void verify_checksum(const SafetensorsInfo::Entry& e, const std::uint8_t* bytes, const std::string& name) {
  if (!e.has_crc32) return;
  const std::uint32_t got = crc32_of(bytes, e.end - e.begin);
  DP_CHECK(got == e.crc32, name, ": tensor '", e.name, "' fails its checksum (stored ", crc_hex(e.crc32),
           ", computed ", crc_hex(got), "): the file is corrupt; restore it from a copy, or load an earlier "
           "checkpoint");
}

// ---- dtypes ---------------------------------------------------------------------------

// dp's dtypes and their names in the format: the one place a new dtype is added.
struct FormatDtype {
  Dtype dtype;
  const char* name;
};
constexpr FormatDtype kFormatDtypes[] = {
    {Dtype::Float32, "F32"},
    {Dtype::Int64, "I64"},
    {Dtype::Int32, "I32"},
    {Dtype::BFloat16, "BF16"},
    {Dtype::Float16, "F16"},
};

const char* st_dtype(Dtype d) {
  for (const FormatDtype& f : kFormatDtypes)
    if (f.dtype == d) return f.name;
  DP_FAIL("safetensors: no format name for dtype ", dtype_name(d));
}

std::optional<Dtype> dp_dtype(const std::string& s) {
  for (const FormatDtype& f : kFormatDtypes)
    if (s == f.name) return f.dtype;
  return std::nullopt;
}

// "F32, I64 and I32": the format names dp reads, for messages.
std::string dp_dtype_list() {
  std::string out;
  const std::size_t n = std::size(kFormatDtypes);
  for (std::size_t i = 0; i < n; ++i) out += std::string(i == 0 ? "" : i + 1 == n ? " and " : ", ") + kFormatDtypes[i].name;
  return out;
}

// Every dtype the format defines; the ones dp cannot hold get a "not supported" error
// rather than "unknown".
bool is_safetensors_dtype(const std::string& s) {
  static const std::set<std::string> known = {"BOOL", "U8",  "I8",  "F8_E5M2", "F8_E4M3", "F8_E8M0",
                                              "F4",   "F6_E2M3", "F6_E3M2", "I16", "U16", "F16",
                                              "BF16", "I32", "U32", "F32", "F64", "I64", "U64", "C64"};
  return known.count(s) > 0;
}

std::string u64_list(std::uint64_t a, std::uint64_t b) { return dp::detail::str_cat("[", a, ", ", b, "]"); }

std::string json_str(const json& j) {
  std::string s = j.dump(-1, ' ', false, json::error_handler_t::replace);
  constexpr std::size_t kMax = 80;  // enough to recognise a value in an error message
  if (s.size() > kMax) s = s.substr(0, kMax) + "…";
  return s;
}

// Rejects duplicate keys at any depth (nlohmann keeps the last silently; a duplicate
// tensor name is a corrupt or hostile file).
struct DuplicateKeyCheck {
  std::vector<std::set<std::string>> stack;
  std::string duplicate;
  int duplicate_depth = 0;
  bool operator()(int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start: stack.emplace_back(); break;
      case json::parse_event_t::object_end:
        if (!stack.empty()) stack.pop_back();
        break;
      case json::parse_event_t::key:
        if (!stack.empty() && !stack.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
          duplicate = parsed.get<std::string>();
          duplicate_depth = depth;
        }
        break;
      default: break;
    }
    return true;
  }
};

std::uint64_t read_u64_le(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Checks the length field against the file size; returns N.
std::uint64_t check_length(const std::uint8_t* first8, std::uint64_t file_size, const std::string& name) {
  const std::uint64_t n = read_u64_le(first8);
  DP_CHECK(n <= kMaxHeaderBytes, name, ": header length field says ", n, " bytes, more than the ",
           kMaxHeaderBytes, "-byte limit: a corrupt file or not a safetensors file");
  DP_CHECK(n <= file_size - 8, name, ": header length field says ", n, " bytes but the file holds only ",
           file_size - 8, " after the 8-byte length: the file is truncated or not a safetensors file");
  DP_CHECK(n >= 2, name, ": header length field says ", n,
           " bytes, too short for a JSON object: a corrupt file or not a safetensors file");
  return n;
}

std::uint64_t as_u64(const json& v, const std::string& what, const std::string& name, const std::string& tensor) {
  DP_CHECK(v.is_number_unsigned(), name, ": ", what, " of '", tensor, "' must hold non-negative integers, got ",
           json_str(v));
  return v.get<std::uint64_t>();
}

// Parses and validates the JSON header against a data region of `data_size` bytes.
SafetensorsInfo parse_header(const char* text, std::uint64_t n, std::uint64_t data_size, const std::string& name) {
  SafetensorsInfo info;
  info.header_bytes = n;
  DP_CHECK(text[0] == '{', name, ": the header must be a JSON object starting with '{', got byte 0x", std::hex,
           static_cast<int>(static_cast<unsigned char>(text[0])), std::dec,
           ": a corrupt file or not a safetensors file");
  DuplicateKeyCheck dup;
  json header;
  try {
    header = json::parse(text, text + n, std::ref(dup));
  } catch (const json::exception& e) {
    DP_FAIL(name, ": the header (", n, " bytes) is not valid JSON: ", e.what());
  }
  DP_CHECK(dup.duplicate.empty(), name, ": the header names '", dup.duplicate, "' twice",
           dup.duplicate_depth > 1 ? " inside one entry" : "", ": a corrupt file");
  DP_CHECK(header.is_object(), name, ": the header must be a JSON object, got ", json_str(header));

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == kMetadataKey) {
      DP_CHECK(v.is_object(), name, ": \"__metadata__\" must be an object of strings, got ", json_str(v));
      for (auto m = v.begin(); m != v.end(); ++m) {
        DP_CHECK(m.value().is_string(), name, ": \"__metadata__\" must map strings to strings; '", m.key(),
                 "' holds ", json_str(m.value()));
        info.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    DP_CHECK(v.is_object(), name, ": the entry of '", key, "' must be an object with dtype, shape and "
             "data_offsets, got ", json_str(v));
    for (auto f = v.begin(); f != v.end(); ++f) {
      DP_CHECK(f.key() == "dtype" || f.key() == "shape" || f.key() == "data_offsets", name,
               ": unexpected field '", f.key(), "' in the entry of '", key,
               "' (expected exactly dtype, shape, data_offsets)");
    }
    for (const char* field : {"dtype", "shape", "data_offsets"}) {
      DP_CHECK(v.contains(field), name, ": the entry of '", key, "' has no '", field,
               "' field (expected dtype, shape, data_offsets)");
    }
    SafetensorsInfo::Entry e;
    e.name = key;
    // dtype
    const json& dt = v["dtype"];
    DP_CHECK(dt.is_string(), name, ": dtype of '", key, "' must be a string, got ", json_str(dt));
    const std::string ds = dt.get<std::string>();
    if (std::optional<Dtype> d = dp_dtype(ds)) {
      e.dtype = *d;
    } else if (is_safetensors_dtype(ds)) {
      DP_FAIL(name, ": dtype ", ds, " of '", key, "' is not supported by dp (only ", dp_dtype_list(),
              "); convert the tensor (e.g. to float32) before saving");
    } else {
      DP_FAIL(name, ": unknown dtype '", ds, "' for '", key, "' (dp reads ", dp_dtype_list(), ")");
    }
    // shape
    const json& sh = v["shape"];
    DP_CHECK(sh.is_array(), name, ": shape of '", key, "' must be an array, got ", json_str(sh));
    const std::uint64_t esize = element_size(e.dtype);
    std::uint64_t bytes = esize;  // product so far, in bytes; checked against overflow
    bool overflow = false;
    for (const json& d : sh) {
      const std::uint64_t dim = as_u64(d, "shape", name, key);
      DP_CHECK(dim <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()), name,
               ": shape of '", key, "' has an absurd dimension ", dim);
      e.shape.push_back(static_cast<std::int64_t>(dim));
      if (dim != 0 && bytes > std::numeric_limits<std::uint64_t>::max() / dim) overflow = true;
      bytes *= dim;
    }
    // data_offsets
    const json& off = v["data_offsets"];
    DP_CHECK(off.is_array() && off.size() == 2, name, ": data_offsets of '", key,
             "' must be [begin, end], got ", json_str(off));
    e.begin = as_u64(off[0], "data_offsets", name, key);
    e.end = as_u64(off[1], "data_offsets", name, key);
    DP_CHECK(e.begin <= e.end, name, ": data_offsets ", u64_list(e.begin, e.end), " of '", key,
             "' end before they begin");
    // A zero dimension makes the tensor empty whatever the other dims say.
    const bool empty = std::find(e.shape.begin(), e.shape.end(), 0) != e.shape.end();
    DP_CHECK(empty || !overflow, name, ": shape ", shape_str(e.shape), " of '", key, "' overflows 64-bit sizes");
    if (empty) bytes = 0;
    DP_CHECK(e.end - e.begin == bytes, name, ": '", key, "' has shape ", shape_str(e.shape), " ", ds,
             " = ", bytes, " bytes, but data_offsets ", u64_list(e.begin, e.end), " span ",
             e.end - e.begin, " bytes");
    DP_CHECK(e.end <= data_size, name, ": data_offsets ", u64_list(e.begin, e.end), " of '", key,
             "' lie outside the data region of ", data_size, " bytes (is the file truncated?)");
    info.entries.push_back(std::move(e));
  }

  // Note [Tensor checksums]: a sum must be well-formed; a tensor without one is
  // simply not verified.
  for (auto& e : info.entries) {
    auto it = info.metadata.find(kChecksumPrefix + e.name);
    if (it == info.metadata.end()) continue;
    const std::string& v = it->second;
    const bool hex = v.size() == 8 && std::all_of(v.begin(), v.end(), [](char c) {
      return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
    });
    DP_CHECK(hex, name, ": metadata '", it->first, "' should be 8 hex digits (a CRC-32), got \"", v,
             "\": a corrupt file");
    e.has_crc32 = true;
    e.crc32 = static_cast<std::uint32_t>(std::stoul(v, nullptr, 16));
  }

  // The entries must tile the data region exactly, like the reference implementation
  // requires: no overlap (two tensors sharing bytes), no gap, nothing after the end.
  std::sort(info.entries.begin(), info.entries.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t pos = 0;
  const SafetensorsInfo::Entry* prev = nullptr;
  for (const auto& e : info.entries) {
    DP_CHECK(e.begin >= pos, name, ": data_offsets ", u64_list(e.begin, e.end), " of '", e.name,
             "' overlap ", prev ? u64_list(prev->begin, prev->end) : "", " of '", prev ? prev->name : "",
             "': a corrupt file");
    DP_CHECK(e.begin == pos, name, ": bytes ", u64_list(pos, e.begin), " of the data region belong to no tensor",
             " (gap before '", e.name, "'): a corrupt file");
    pos = e.end;
    prev = &e;
  }
  DP_CHECK(pos == data_size, name, ": data region size mismatch: the header describes ", pos,
           " bytes of tensor data but the file holds ", data_size, " after the header",
           pos < data_size ? " (trailing bytes: a corrupt file or a writer bug)" : "");
  return info;
}

Tensor host_tensor(const SafetensorsInfo::Entry& e) {
  return empty(e.shape, TensorOptions{e.dtype, Device{}});
}

// ---- files ----------------------------------------------------------------------------

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }

 private:
  int fd_;
};

// Reads exactly n bytes at `offset`; throws on errors and on a short file.
void pread_all(int fd, void* buf, std::uint64_t n, std::uint64_t offset, const std::string& path) {
  auto* p = static_cast<std::uint8_t*>(buf);
  while (n > 0) {
    constexpr std::uint64_t kChunk = std::uint64_t{1} << 30;  // stay below pread's SSIZE_MAX limits
    ssize_t got = ::pread(fd, p, std::min(n, kChunk), static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    DP_CHECK(got >= 0, path, ": read failed: ", errno_text(errno));
    DP_CHECK(got > 0, path, ": the file ended early (truncated while reading?)");
    p += got;
    n -= static_cast<std::uint64_t>(got);
    offset += static_cast<std::uint64_t>(got);
  }
}

struct OpenedFile {
  int fd;
  std::uint64_t size;
  SafetensorsInfo info;
};

OpenedFile open_and_parse_header(const std::string& path, std::unique_ptr<Fd>& holder) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DP_CHECK(fd >= 0, "cannot open checkpoint '", path, "': ", errno_text(errno));
  holder = std::make_unique<Fd>(fd);
  struct stat st {};
  DP_CHECK(::fstat(fd, &st) == 0, path, ": stat failed: ", errno_text(errno));
  DP_CHECK(S_ISREG(st.st_mode), path, ": not a regular file");
  const auto size = static_cast<std::uint64_t>(st.st_size);
  DP_CHECK(size >= 8, path, ": the file is ", size,
           " bytes, shorter than the 8-byte header length: truncated or not a safetensors file");
  std::uint8_t first8[8];
  pread_all(fd, first8, 8, 0, path);
  const std::uint64_t n = check_length(first8, size, path);
  std::string text(n, '\0');
  pread_all(fd, text.data(), n, 8, path);
  return {fd, size, parse_header(text.data(), n, size - 8 - n, path)};
}

}  // namespace

// ---- reading --------------------------------------------------------------------------

SafetensorsFile parse_safetensors(const std::uint8_t* data, std::size_t size, const std::string& name) {
  DP_CHECK(data != nullptr || size == 0, name, ": null data");
  DP_CHECK(size >= 8, name, ": the file is ", size,
           " bytes, shorter than the 8-byte header length: truncated or not a safetensors file");
  const std::uint64_t n = check_length(data, size, name);
  SafetensorsInfo info = parse_header(reinterpret_cast<const char*>(data + 8), n, size - 8 - n, name);
  const std::uint8_t* region = data + 8 + n;
  SafetensorsFile out;
  out.metadata = std::move(info.metadata);
  for (const auto& e : info.entries) verify_checksum(e, region + e.begin, name);  // before any copy
  for (const auto& e : info.entries) {
    Tensor t = host_tensor(e);
    if (e.end > e.begin) std::memcpy(t.raw_data(), region + e.begin, e.end - e.begin);
    out.tensors.emplace_back(e.name, std::move(t));
  }
  return out;
}

SafetensorsInfo read_safetensors_info(const std::string& path) {
  std::unique_ptr<Fd> fd;
  return open_and_parse_header(path, fd).info;
}

SafetensorsFile read_safetensors(const std::string& path) {
  std::unique_ptr<Fd> fd;
  OpenedFile f = open_and_parse_header(path, fd);
  const std::uint64_t base = 8 + f.info.header_bytes;
  SafetensorsFile out;
  out.metadata = std::move(f.info.metadata);
  for (const auto& e : f.info.entries) {
    Tensor t = host_tensor(e);
    pread_all(f.fd, t.raw_data(), e.end - e.begin, base + e.begin, path);
    verify_checksum(e, static_cast<const std::uint8_t*>(t.raw_data()), path);
    out.tensors.emplace_back(e.name, std::move(t));
  }
  return out;
}

// ---- writing --------------------------------------------------------------------------

namespace {

// The header (length field included) for tensors laid out back to back in order,
// with crcs[i] as tensor i's checksum (Note [Tensor checksums]). The header's length
// does not depend on the sums' values.
std::string make_header(const nn::StateDict& tensors, const Metadata& metadata, const std::vector<std::uint32_t>& crcs) {
  DP_ASSERT(crcs.size() == tensors.size());
  ordered_json h = ordered_json::object();
  ordered_json meta = ordered_json::object();
  meta["format"] = "pt";  // what PyTorch's safetensors.torch writes; readers may check it
  for (const auto& [k, v] : metadata)
    if (!is_checksum_key(k)) meta[k] = v;  // dp's own: recomputed below
  for (std::size_t i = 0; i < tensors.size(); ++i) meta[kChecksumPrefix + tensors[i].first] = crc_hex(crcs[i]);
  h[kMetadataKey] = std::move(meta);
  std::set<std::string> seen;
  std::uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    DP_CHECK(name != kMetadataKey, "save: '", kMetadataKey, "' is reserved and cannot name a tensor");
    DP_CHECK(seen.insert(name).second, "save: the tensor name '", name, "' appears twice");
    DP_CHECK(t.defined(), "save: the tensor '", name, "' is undefined");
    ordered_json e = ordered_json::object();
    e["dtype"] = st_dtype(t.dtype());
    e["shape"] = t.shape();
    e["data_offsets"] = {offset, offset + t.nbytes()};
    offset += t.nbytes();
    h[name] = std::move(e);
  }
  std::string text;
  try {
    text = h.dump();
  } catch (const nlohmann::json::exception& e) {
    DP_FAIL("save: cannot encode the header (are names and metadata valid UTF-8?): ", e.what());
  }
  // Pad with spaces so that the data region starts 8-byte aligned, as the reference
  // implementation does (readers may map tensors in place).
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  std::uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text;
}

// Feeds `sink(i, ptr, bytes)` every tensor's data in order (i: the tensor's index),
// copying one non-CPU tensor at a time to the host.
template <typename Sink>
void stream_tensors(const nn::StateDict& tensors, Sink&& sink) {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i].second;
    if (t.numel() == 0) continue;
    Tensor host = t.device().is_cpu() ? t : t.detach().to(Device{});
    sink(i, static_cast<const std::uint8_t*>(host.raw_data()), host.nbytes());
  }
}

void write_all(int fd, const std::uint8_t* p, std::uint64_t n, const std::string& tmp) {
  while (n > 0) {
    constexpr std::uint64_t kMax = std::uint64_t{1} << 30;  // below write's SSIZE_MAX limits
    ssize_t w = ::write(fd, p, std::min(n, kMax));
    if (w < 0 && errno == EINTR) continue;
    DP_CHECK(w > 0, "save: writing '", tmp, "' failed: ", errno_text(w < 0 ? errno : EIO),
             " (disk full? the previous checkpoint is untouched)");
    p += w;
    n -= static_cast<std::uint64_t>(w);
  }
}

void pwrite_all(int fd, const std::uint8_t* p, std::uint64_t n, std::uint64_t offset, const std::string& tmp) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    DP_CHECK(w > 0, "save: writing '", tmp, "' failed: ", errno_text(w < 0 ? errno : EIO),
             " (disk full? the previous checkpoint is untouched)");
    p += w;
    n -= static_cast<std::uint64_t>(w);
    offset += static_cast<std::uint64_t>(w);
  }
}

std::string dir_of(const std::string& path) {
  auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string base_of(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DP_CHECK(fd >= 0, "save: cannot open directory '", dir, "' to fsync it: ", errno_text(errno));
  Fd holder(fd);
  // Some file systems cannot fsync a directory (EINVAL): the rename is then as durable
  // as that file system makes it, nothing more can be done.
  DP_CHECK(::fsync(fd) == 0 || errno == EINVAL, "save: fsync of directory '", dir, "' failed: ",
           errno_text(errno));
}

// Note [Atomic checkpoint writes]
// A checkpoint is written to "<file>.tmp.<pid>.<n>" in the target's directory (rename
// is only atomic within one file system), written in full with write(2) (no user-space
// buffer, so nothing to fflush), fsync'ed, closed, renamed over the target, and the
// directory is fsync'ed so the rename itself survives a power loss. A process killed
// at any point leaves the target either old or new. What it can leave is the
// temporary, as large as the checkpoint (twenty kill -9s once left 848 MB). So the
// next write of the same target, before it writes anything, removes every temporary
// of that target whose writer is gone:
//  - its pid no longer exists here (kill(pid, 0) fails with ESRCH); a live pid keeps
//    its file, even one reused by an unrelated process (harmless: it waits for the
//    next write after that process ends);
//  - and nobody holds the file's lock: a writer holds flock(LOCK_EX) on its temporary
//    from creation to rename, and the kernel drops the lock when the writer dies.
//    The lock protects a live writer whose pid means nothing here: one in another PID
//    namespace (a container) sharing the directory.
// A writer takes its lock just after creating the file; a cleaner that removed it in
// between (possible only across PID namespaces) is seen by the writer (the file has
// no link any more) and the writer starts over with a new name.

void remove_stale_temporaries(const std::string& dir, const std::string& base) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  const std::string prefix = base + ".tmp.";
  while (dirent* ent = ::readdir(d)) {
    std::string fname = ent->d_name;
    if (fname.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string rest = fname.substr(prefix.size());  // "<pid>.<n>"
    const auto dot = rest.find('.');
    if (dot == std::string::npos || dot == 0) continue;
    const std::string pid_text = rest.substr(0, dot), n_text = rest.substr(dot + 1);
    const auto digits = [](const std::string& t) {
      return !t.empty() && t.size() <= 19 && std::all_of(t.begin(), t.end(), [](char c) { return c >= '0' && c <= '9'; });
    };
    if (!digits(pid_text) || !digits(n_text)) continue;  // not a name dp makes: not ours
    const long long pid_value = std::stoll(pid_text);
    if (pid_value <= 0 || pid_value > std::numeric_limits<pid_t>::max()) continue;
    const auto pid = static_cast<pid_t>(pid_value);
    if (pid == ::getpid()) continue;  // another thread of this process may be writing it
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to judge)
    const std::string full = dir + "/" + fname;
    const int fd = ::open(full.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) continue;
    Fd holder(fd);
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) continue;  // a live writer holds it
    if (::unlink(full.c_str()) != 0 && errno != ENOENT) {
      dp::detail::log_warning(dp::detail::str_cat("save: could not remove the temporary '", full,
                                                  "' of a writer that is gone: ", errno_text(errno)));
    }
  }
  ::closedir(d);
}

std::atomic<std::uint64_t> g_temp_counter{0};

}  // namespace

std::vector<std::uint8_t> serialize_safetensors(const nn::StateDict& tensors, const Metadata& metadata) {
  std::vector<std::uint32_t> crcs(tensors.size(), 0);
  const std::string placeholder = make_header(tensors, metadata, crcs);  // validates first
  std::vector<std::uint8_t> out(placeholder.begin(), placeholder.end());
  std::uint64_t total = placeholder.size();
  for (const auto& [n, t] : tensors) total += t.nbytes();
  out.reserve(total);
  stream_tensors(tensors, [&](std::size_t i, const std::uint8_t* p, std::size_t n) {
    crcs[i] = crc32_of(p, n);
    out.insert(out.end(), p, p + n);
  });
  const std::string header = make_header(tensors, metadata, crcs);
  DP_ASSERT(header.size() == placeholder.size());
  std::copy(header.begin(), header.end(), out.begin());
  return out;
}

void write_safetensors(const std::string& path, const nn::StateDict& tensors, const Metadata& metadata) {
  DP_CHECK(!path.empty(), "save: empty path");
  DP_CHECK(path.back() != '/', "save: '", path, "' names a directory; give a file name");
  std::vector<std::uint32_t> crcs(tensors.size(), 0);
  // Validates before any file is made; the sums are filled in after the data.
  const std::string placeholder = make_header(tensors, metadata, crcs);
  std::uint64_t total = placeholder.size();
  for (const auto& [n, t] : tensors) total += t.nbytes();

  const std::string dir = dir_of(path);
  // Before anything is written: the space dead writers hold may be what this write needs.
  remove_stale_temporaries(dir, base_of(path));
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; fd < 0; ++attempt) {
    tmp = dp::detail::str_cat(path, ".tmp.", ::getpid(), ".", g_temp_counter.fetch_add(1));
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    DP_CHECK(fd >= 0 || (errno == EEXIST && attempt < 100), "save: cannot create '", tmp, "': ",
             errno_text(errno), " (does the directory '", dir, "' exist and is it writable?)");
    if (fd < 0) continue;
    // Note [Atomic checkpoint writes]: the lock says a writer is alive (best effort: a
    // file system without flock leaves the pid rule alone to protect the file); a file
    // removed before the lock was taken is given up for a new one.
    struct stat st {};
    if (::flock(fd, LOCK_EX) == 0 && ::fstat(fd, &st) == 0 && st.st_nlink == 0) {
      ::close(fd);
      fd = -1;
      DP_CHECK(attempt < 100, "save: the temporary '", tmp, "' keeps disappearing as it is created");
    }
  }
  Fd holder(fd);
  // The lock lives as long as any descriptor of the file: this one holds it past the
  // close below, until the temporary is renamed (or removed on an error).
  Fd lock_holder(::dup(fd));
  try {
    const detail::WriteHook hook = g_write_hook.load();
    std::uint64_t written = 0;
    auto put = [&](const std::uint8_t* p, std::size_t n, std::uint32_t* crc) {
      // Chunks keep the hook's view fine-grained (the kernel sees large writes anyway)
      // and each chunk's sum is taken while it is in cache.
      constexpr std::size_t kChunk = std::size_t{8} << 20;
      while (n > 0) {
        const std::size_t c = std::min(n, kChunk);
        if (crc) *crc = crc32_append(*crc, crc32_of(p, c), c);
        write_all(fd, p, c, tmp);
        p += c;
        n -= c;
        written += c;
        if (hook) hook(written, total);
      }
    };
    put(reinterpret_cast<const std::uint8_t*>(placeholder.data()), placeholder.size(), nullptr);
    stream_tensors(tensors, [&](std::size_t i, const std::uint8_t* p, std::size_t n) { put(p, n, &crcs[i]); });
    // Note [Tensor checksums]: the header again, now with the sums, over the first one.
    const std::string header = make_header(tensors, metadata, crcs);
    DP_ASSERT(header.size() == placeholder.size());
    pwrite_all(fd, reinterpret_cast<const std::uint8_t*>(header.data()), header.size(), 0, tmp);
    DP_CHECK(::fsync(fd) == 0, "save: fsync of '", tmp, "' failed: ", errno_text(errno));
    DP_CHECK(::close(holder.release()) == 0, "save: closing '", tmp, "' failed: ", errno_text(errno));
    DP_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "save: renaming '", tmp, "' to '", path,
             "' failed: ", errno_text(errno));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_dir(dir);
}

namespace detail {
void set_write_hook(WriteHook hook) { g_write_hook.store(hook); }
}  // namespace detail

}  // namespace dp::io
