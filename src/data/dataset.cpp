#include "dp/data/dataset.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "dp/core/error.h"

namespace dp::data {

const char* split_name(Split split) { return split == Split::Train ? "train" : "test"; }

Batch Dataset::allocate_batch(std::int64_t count) const {
  Shape shape = example_shape();
  shape.insert(shape.begin(), count);
  Shape target = target_shape();
  target.insert(target.begin(), count);
  Batch batch;
  batch.data = empty(shape, TensorOptions{example_dtype(), cpu(0)});
  batch.target = empty(target, TensorOptions{Dtype::Int64, cpu(0)});
  return batch;
}

void Dataset::check_indices(std::span<const std::int64_t> indices, const char* who) const {
  const std::int64_t n = size();
  for (std::size_t i = 0; i < indices.size(); ++i) {
    DP_CHECK(indices[i] >= 0 && indices[i] < n, who, ": index ", indices[i], " (position ", i,
             " of the batch) is out of range for a dataset of ", n,
             " examples; expected an index in [0, ", n, ")");
  }
}

namespace {

// Closes the gzFile on every path out of read_file_bytes.
struct GzCloser {
  gzFile file;
  ~GzCloser() {
    if (file != nullptr) gzclose(file);
  }
};

}  // namespace

std::vector<std::uint8_t> read_file_bytes(const std::filesystem::path& path,
                                          std::uint64_t max_bytes) {
  std::error_code ec;
  DP_CHECK(std::filesystem::exists(path, ec), "cannot read '", path.string(),
           "': no such file; check the path (or the data directory setting)");
  DP_CHECK(std::filesystem::is_regular_file(path, ec), "cannot read '", path.string(),
           "': expected a regular file, got a directory or special file");

  // gzopen reads gzip and plain files alike (it passes plain data through).
  GzCloser gz{gzopen(path.c_str(), "rb")};
  DP_CHECK(gz.file != nullptr, "cannot open '", path.string(), "': ", std::strerror(errno));
  // 256 KiB input buffer: far fewer read syscalls than zlib's 8 KiB default.
  gzbuffer(gz.file, 1u << 18);

  std::vector<std::uint8_t> bytes;
  const std::uint64_t file_size = std::filesystem::file_size(path, ec);
  if (!ec) bytes.reserve(static_cast<std::size_t>(std::min<std::uint64_t>(file_size, max_bytes)));

  constexpr unsigned kChunk = 1u << 20;  // 1 MiB per gzread: well inside its int result
  for (;;) {
    const std::size_t old = bytes.size();
    bytes.resize(old + kChunk);
    const int got = gzread(gz.file, bytes.data() + old, kChunk);
    if (got < 0) {
      int errnum = 0;
      const char* msg = gzerror(gz.file, &errnum);
      DP_FAIL("cannot read '", path.string(), "': ",
              errnum == Z_ERRNO ? std::strerror(errno) : msg,
              " (a corrupt gzip stream? re-download the file)");
    }
    bytes.resize(old + static_cast<std::size_t>(got));
    DP_CHECK(bytes.size() <= max_bytes, "cannot read '", path.string(), "': expected at most ",
             max_bytes, " bytes of data, got more (a wrong file or a gzip bomb?)");
    if (got == 0) break;
  }
  // A gzip stream that ends early reads as a short file plus Z_BUF_ERROR.
  int errnum = 0;
  const char* msg = gzerror(gz.file, &errnum);
  DP_CHECK(errnum == Z_OK, "cannot read '", path.string(), "': ", msg,
           errnum == Z_BUF_ERROR ? " (the gzip stream is truncated; re-download the file)"
                                 : " (a corrupt gzip stream? re-download the file)");
  const int closed = gzclose(gz.file);
  gz.file = nullptr;
  DP_CHECK(closed == Z_OK, "cannot read '", path.string(), "': gzclose failed (code ", closed,
           "; the gzip stream is truncated or corrupt)");
  return bytes;
}

}  // namespace dp::data
