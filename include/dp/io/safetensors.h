// dp/io/safetensors.h — the safetensors file format: read, validate, write atomically.
//
// A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
// header {"name": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
// "__metadata__": {"format": "pt", ...}} (offsets relative to the first byte after the
// header; the header is padded with spaces to a multiple of 8), then the raw
// little-endian tensor bytes, back to back. dp reads and writes F32, I64 and I32 tensors.
// Reading validates every field and says exactly what is wrong; writing goes through a
// temporary file that is fsync'ed and renamed (see Note [Atomic checkpoint writes]).
// Every file dp writes carries a CRC-32 of each tensor's bytes in its metadata
// ("dp.crc32.<name>": 8 hex digits, zlib's CRC-32, which Python's zlib.crc32 computes
// too), verified on every read that has it; files without them (PyTorch's) still
// load (Note [Tensor checksums]).
// This header knows nothing of modules' training, optimizers or DataParallel: it maps
// names to tensors (checkpoint.h builds module and training checkpoints on top).
//
//   dp::io::write_safetensors("w.safetensors", net->state_dict(), {{"epoch", "3"}});
//   dp::io::SafetensorsFile f = dp::io::read_safetensors("w.safetensors");
//   for (auto& [name, t] : f.tensors) std::cout << name << " " << t.str() << "\n";
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dp/nn/module.h"
#include "dp/tensor/tensor.h"

namespace dp::io {

/// The string-to-string "__metadata__" of a safetensors header.
using Metadata = std::map<std::string, std::string>;

/// Metadata keys "dp.crc32.<tensor name>" hold each tensor's CRC-32 (8 lowercase hex
/// digits). They are dp's: the writer computes them and replaces any given.
constexpr const char* kChecksumPrefix = "dp.crc32.";

/// The largest header accepted: the reference implementation's limit (100 MB). A
/// larger length field means a corrupt or foreign file, not a big model.
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

/// The contents of a safetensors file.
struct SafetensorsFile {
  /// Tensors in file order (ascending data offset), host tensors on cpu(0).
  nn::StateDict tensors;
  /// The header's "__metadata__" (empty when the file has none).
  Metadata metadata;
};

/// Parses a whole safetensors file held in memory. `name` labels errors (a path or
/// "<memory>"). Validates the length field, the JSON, every entry's fields, dtype,
/// shape and offsets (size = numel · element size, in range, no overlap, no gap) and
/// that the data region is exactly covered, and every tensor's checksum when the
/// metadata holds one; throws dp::Error naming the problem and the tensor ("tensor
/// 'fc1.weight' fails its checksum (stored …, computed …): the file is corrupt").
/// Never reads outside [data, data + size).
SafetensorsFile parse_safetensors(const std::uint8_t* data, std::size_t size,
                                  const std::string& name = "<memory>");

/// Reads and validates the safetensors file at `path` (as parse_safetensors, but
/// reading each tensor straight into its host tensor and verifying its checksum).
/// Throws dp::Error on I/O errors, on every format error and on a checksum mismatch.
SafetensorsFile read_safetensors(const std::string& path);

/// A validated header: names, dtypes, shapes, offsets and metadata, no tensor data.
struct SafetensorsInfo {
  /// One tensor's entry in the header.
  struct Entry {
    std::string name;
    Dtype dtype = Dtype::Float32;
    Shape shape;
    std::uint64_t begin = 0, end = 0;  ///< byte offsets into the data region
    bool has_crc32 = false;            ///< the metadata holds the tensor's checksum
    std::uint32_t crc32 = 0;           ///< that checksum (CRC-32 of the bytes)
  };
  std::vector<Entry> entries;      ///< ascending data offset
  Metadata metadata;               ///< the header's "__metadata__"
  std::uint64_t header_bytes = 0;  ///< N, the JSON header's length (padding included)
};
/// Reads and validates only the header of the file at `path` (the data region's size
/// is checked against the offsets, its bytes are not read, so checksums are parsed
/// but not verified).
SafetensorsInfo read_safetensors_info(const std::string& path);

/// The bytes of a safetensors file holding `tensors` (any device; in the given order)
/// and `metadata` ("format": "pt" is added when absent, and the tensors' checksums). Throws dp::Error for an
/// undefined tensor, a duplicate or reserved ("__metadata__") name.
std::vector<std::uint8_t> serialize_safetensors(const nn::StateDict& tensors,
                                                const Metadata& metadata = {});

/// Writes `tensors`, `metadata` and the tensors' checksums (computed as the bytes are
/// written, then filled into the header) to `path` atomically: a temporary file in the
/// same directory is written in full, flushed and fsync'ed, renamed over `path`, and the
/// directory is fsync'ed. A crash at any point leaves either the previous file or the
/// new one, never a mix (a stray "<file>.tmp.<pid>.<n>" may remain after a crash: the
/// next write of the same target, before writing, removes those whose process no
/// longer exists and whose lock no writer holds; never a live writer's).
/// Throws dp::Error (naming the path and errno text) on I/O errors; the target is then
/// untouched and the temporary removed.
void write_safetensors(const std::string& path, const nn::StateDict& tensors,
                       const Metadata& metadata = {});

namespace detail {
/// Test hook: called by write_safetensors after each chunk written to the temporary
/// file with the bytes written so far and the file's total size. Null: none.
using WriteHook = void (*)(std::uint64_t written, std::uint64_t total);
void set_write_hook(WriteHook hook);
}  // namespace detail

}  // namespace dp::io
