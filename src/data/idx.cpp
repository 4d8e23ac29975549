#include "dp/data/idx.h"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "dp/core/error.h"

namespace dp::data {
namespace {

std::string hex_byte(std::uint8_t b) {
  static const char* kDigits = "0123456789abcdef";
  return std::string("0x") + kDigits[b >> 4] + kDigits[b & 15];
}

std::string dims_str(const std::vector<std::int64_t>& dims) {
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
  os << ']';
  return os.str();
}

bool known_dtype(std::uint8_t code) {
  switch (code) {
    case 0x08: case 0x09: case 0x0B: case 0x0C: case 0x0D: case 0x0E: return true;
    default: return false;
  }
}

// IDX stores every multi-byte element big-endian; reverse each element in place on a
// little-endian host.
void swap_elements(std::uint8_t* bytes, std::size_t count, std::size_t elem) {
  if constexpr (std::endian::native == std::endian::little) {
    if (elem == 1) return;
    for (std::size_t i = 0; i < count; ++i) std::reverse(bytes + i * elem, bytes + (i + 1) * elem);
  }
}

// How to point the loader at the data. An explicit directory always wins over
// DP_DATA_DIR, so the variable is suggested only when `dir` is the default one (which
// is where DP_DATA_DIR takes effect); otherwise it would be advice that changes nothing.
std::string directory_hint(const std::filesystem::path& dir) {
  if (dir == default_fashion_mnist_dir())
    return "install dataset-fashion-mnist, or set DP_DATA_DIR to the directory holding the files";
  return "pass the directory that holds them (an explicit directory is used as given; "
         "DP_DATA_DIR only changes default_fashion_mnist_dir())";
}

// Picks "<dir>/<base>.gz" when present, else "<dir>/<base>"; errors when neither exists.
std::filesystem::path find_file(const std::filesystem::path& dir, const std::string& base) {
  std::error_code ec;
  DP_CHECK(std::filesystem::is_directory(dir, ec), "MnistDataset: data directory '",
           dir.string(), "' does not exist; expected a directory holding ", base, "[.gz] (",
           directory_hint(dir), ")");
  const std::filesystem::path gz = dir / (base + ".gz");
  if (std::filesystem::exists(gz, ec)) return gz;
  const std::filesystem::path plain = dir / base;
  DP_CHECK(std::filesystem::exists(plain, ec), "MnistDataset: expected ", gz.string(), " or ",
           plain.string(), ", found neither (a wrong directory? ", directory_hint(dir), ")");
  return plain;
}

}  // namespace

std::size_t idx_element_size(IdxDtype dtype) {
  switch (dtype) {
    case IdxDtype::UInt8: case IdxDtype::Int8: return 1;
    case IdxDtype::Int16: return 2;
    case IdxDtype::Int32: case IdxDtype::Float32: return 4;
    case IdxDtype::Float64: return 8;
  }
  DP_FAIL("idx_element_size: unknown IDX dtype code ", hex_byte(static_cast<std::uint8_t>(dtype)));
}

const char* idx_dtype_name(IdxDtype dtype) {
  switch (dtype) {
    case IdxDtype::UInt8: return "uint8";
    case IdxDtype::Int8: return "int8";
    case IdxDtype::Int16: return "int16";
    case IdxDtype::Int32: return "int32";
    case IdxDtype::Float32: return "float32";
    case IdxDtype::Float64: return "float64";
  }
  return "unknown";
}

std::int64_t IdxArray::numel() const {
  // A zero dim makes the product 0 whatever precedes it: parse_idx accepts
  // [0xf8ffffff, 0xffffffff, 0] (no elements), whose running product would overflow
  // (undefined behaviour; found by fuzz/idx_fuzz). Other sizes are checked.
  for (std::int64_t d : dims)
    if (d == 0) return 0;
  std::int64_t n = 1;
  for (std::int64_t d : dims)
    DP_CHECK(d > 0 && !__builtin_mul_overflow(n, d, &n), "IdxArray: dims ", dims_str(dims),
             " are negative or their product overflows int64");
  return n;
}

IdxArray parse_idx(const std::uint8_t* data, std::size_t size, const std::string& name) {
  DP_CHECK(data != nullptr || size == 0, "parse_idx('", name, "'): null data with size ", size);
  DP_CHECK(size >= 4, "IDX file '", name, "' is truncated: expected a 4-byte magic number, got ",
           size, " bytes");
  DP_CHECK(data[0] == 0 && data[1] == 0 && known_dtype(data[2]) && data[3] >= 1,
           "IDX file '", name, "' has a bad magic number: expected 0x00 0x00 <dtype 0x08|0x09|0x0b|"
           "0x0c|0x0d|0x0e> <ndims >= 1>, got ", hex_byte(data[0]), ' ', hex_byte(data[1]), ' ',
           hex_byte(data[2]), ' ', hex_byte(data[3]), " (not an IDX file, or still compressed?)");

  IdxArray out;
  out.dtype = static_cast<IdxDtype>(data[2]);
  const std::size_t ndims = data[3];
  const std::size_t header = 4 + 4 * ndims;
  DP_CHECK(size >= header, "IDX file '", name, "' is truncated: expected a ", header,
           "-byte header for ", ndims, " dims, got ", size, " bytes");

  const std::size_t elem = idx_element_size(out.dtype);
  std::uint64_t numel = 1;
  bool overflow = false;
  out.dims.resize(ndims);
  for (std::size_t d = 0; d < ndims; ++d) {
    const std::uint8_t* p = data + 4 + 4 * d;
    const std::uint32_t v = (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) |
                            (std::uint32_t{p[2]} << 8) | std::uint32_t{p[3]};
    out.dims[d] = v;
    overflow = overflow || __builtin_mul_overflow(numel, std::uint64_t{v}, &numel);
  }
  std::uint64_t data_bytes = 0;
  overflow = overflow || __builtin_mul_overflow(numel, std::uint64_t{elem}, &data_bytes);
  // Element counts must fit an int64 tensor size as well.
  overflow = overflow || numel > static_cast<std::uint64_t>(INT64_MAX);
  DP_CHECK(!overflow, "IDX file '", name, "' has dims ", dims_str(out.dims), " of ",
           idx_dtype_name(out.dtype), " whose byte size overflows 64 bits; expected dims whose "
           "product matches the ", size - header, " data bytes in the file");
  const std::uint64_t got = size - header;
  DP_CHECK(got == data_bytes, "IDX file '", name, "' ",
           got < data_bytes ? "is truncated" : "has trailing bytes", ": dims ", dims_str(out.dims),
           " of ", idx_dtype_name(out.dtype), " expected ", data_bytes, " data bytes after the ",
           header, "-byte header, got ", got);

  out.bytes.assign(data + header, data + size);
  swap_elements(out.bytes.data(), static_cast<std::size_t>(numel), elem);
  return out;
}

IdxArray read_idx(const std::filesystem::path& path) {
  const std::vector<std::uint8_t> bytes = read_file_bytes(path);
  return parse_idx(bytes.data(), bytes.size(), path.string());
}

std::vector<std::uint8_t> encode_idx(const IdxArray& array) {
  DP_CHECK(!array.dims.empty() && array.dims.size() <= 255,
           "encode_idx: expected 1 to 255 dims, got ", array.dims.size());
  const std::size_t elem = idx_element_size(array.dtype);
  DP_CHECK(array.bytes.size() == static_cast<std::size_t>(array.numel()) * elem,
           "encode_idx: dims ", dims_str(array.dims), " of ", idx_dtype_name(array.dtype),
           " expect ", array.numel() * static_cast<std::int64_t>(elem), " bytes, got ",
           array.bytes.size());
  std::vector<std::uint8_t> out = {0, 0, static_cast<std::uint8_t>(array.dtype),
                                   static_cast<std::uint8_t>(array.dims.size())};
  for (std::int64_t d : array.dims) {
    DP_CHECK(d >= 0 && d <= 0xffffffffLL, "encode_idx: dim ", d, " does not fit a uint32");
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<std::uint8_t>(d >> shift));
  }
  const std::size_t header = out.size();
  out.insert(out.end(), array.bytes.begin(), array.bytes.end());
  swap_elements(out.data() + header, static_cast<std::size_t>(array.numel()), elem);
  return out;
}

std::filesystem::path default_fashion_mnist_dir() {
  const char* env = std::getenv("DP_DATA_DIR");
  if (env != nullptr && *env != '\0') return env;
  return "/usr/share/datasets/fashion-mnist";
}

MnistDataset::MnistDataset(const std::filesystem::path& dir, Split split) {
  const std::string prefix = split == Split::Train ? "train" : "t10k";
  const std::filesystem::path images = find_file(dir, prefix + "-images-idx3-ubyte");
  const std::filesystem::path labels = find_file(dir, prefix + "-labels-idx1-ubyte");
  init(read_idx(images), read_idx(labels), images.string(), labels.string());
}

MnistDataset::MnistDataset(IdxArray images, IdxArray labels, const std::string& name) {
  init(std::move(images), std::move(labels), name + " (images)", name + " (labels)");
}

void MnistDataset::init(IdxArray images, IdxArray labels, const std::string& images_name,
                        const std::string& labels_name) {
  DP_CHECK(images.dtype == IdxDtype::UInt8 && images.dims.size() == 3, "MnistDataset: '",
           images_name, "': expected uint8 images with 3 dims (N, H, W), got ",
           idx_dtype_name(images.dtype), " with dims ", dims_str(images.dims),
           " (images and labels swapped?)");
  DP_CHECK(labels.dtype == IdxDtype::UInt8 && labels.dims.size() == 1, "MnistDataset: '",
           labels_name, "': expected uint8 labels with 1 dim (N), got ",
           idx_dtype_name(labels.dtype), " with dims ", dims_str(labels.dims),
           " (images and labels swapped?)");
  DP_CHECK(images.dims[0] == labels.dims[0], "MnistDataset: image and label counts differ: '",
           images_name, "' holds ", images.dims[0], " images, '", labels_name, "' holds ",
           labels.dims[0], " labels; expected the same count (files from different splits?)");
  DP_CHECK(images.dims[1] > 0 && images.dims[2] > 0, "MnistDataset: '", images_name,
           "': expected images of at least 1x1 pixels, got dims ", dims_str(images.dims));
  for (std::size_t i = 0; i < labels.bytes.size(); ++i) {
    DP_CHECK(labels.bytes[i] < kNumClasses, "MnistDataset: '", labels_name, "': label ",
             int{labels.bytes[i]}, " of example ", i, " is out of range; expected a class in [0, ",
             kNumClasses, ")");
  }
  count_ = images.dims[0];
  height_ = images.dims[1];
  width_ = images.dims[2];
  pixels_ = std::move(images.bytes);
  labels_ = std::move(labels.bytes);
}

std::int64_t MnistDataset::label(std::int64_t i) const {
  DP_CHECK(i >= 0 && i < count_, "MnistDataset::label: index ", i, " out of range [0, ", count_, ")");
  return labels_[static_cast<std::size_t>(i)];
}

Batch MnistDataset::get_batch(std::span<const std::int64_t> indices) const {
  check_indices(indices, "MnistDataset::get_batch");
  Batch batch = allocate_batch(static_cast<std::int64_t>(indices.size()));
  float* x = batch.data.data<float>();
  std::int64_t* y = batch.target.data<std::int64_t>();
  const std::size_t pixels = static_cast<std::size_t>(height_ * width_);
  for (std::size_t b = 0; b < indices.size(); ++b) {
    const std::size_t i = static_cast<std::size_t>(indices[b]);
    const std::uint8_t* src = pixels_.data() + i * pixels;
    float* dst = x + b * pixels;
    // Divide (not multiply by 1/255) so values match torchvision's ToTensor exactly.
    for (std::size_t j = 0; j < pixels; ++j) dst[j] = static_cast<float>(src[j]) / 255.0f;
    y[b] = labels_[i];
  }
  return batch;
}

}  // namespace dp::data
