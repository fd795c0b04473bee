// safetensors files: an 8-byte little-endian header length, a JSON header
// {"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
// then the raw little-endian data. Used by `metile run --inputs/--output`, the model
// checkpoint loader (mapped, read in place) and the tests; every malformed file is an
// InputError naming the file and the tensor.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <system_error>
#include <cerrno>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>


#include "json_input.h"
#include "metile/graph.h"
#include "metile/io.h"

namespace metile {
namespace {

using Json = nlohmann::json;

constexpr std::string_view kReadableDtypes = "metile reads F16, BF16, F32, I8, U8, I32 and U32";

// A tensor of a dtype of the format that metile does not read, asked for (MappedSafetensors::find) or
// read with every tensor of its file (read_safetensors).
[[noreturn]] void refuse_unreadable(const std::filesystem::path& path, std::string_view name, std::string_view dtype) {
  throw InputError(path.string() + ": tensor '" + std::string(name) + "': dtype '" + std::string(dtype) +
                   "' is not one metile reads (" + std::string(kReadableDtypes) + ")");
}

std::string_view safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
    case DType::f32: return "F32";
    case DType::i8: return "I8";
    case DType::u8: return "U8";
    case DType::i32: return "I32";
    case DType::u32: return "U32";
  }
  return "?";
}

std::optional<DType> parse_safetensors_dtype(std::string_view name) {
  for (DType dtype : {DType::f16, DType::bf16, DType::f32, DType::i8, DType::u8, DType::i32, DType::u32}) {
    if (safetensors_dtype_name(dtype) == name) return dtype;
  }
  return std::nullopt;
}

// The format's other dtypes, by element size in bits: metile reads none of them, but a file may hold
// them beside the tensors it reads (an I64 buffer, a BOOL mask, F64 statistics, FP4 or FP6 weights of
// another runtime), so such an entry is checked like any other and refused only when asked for
// (MappedSafetensors::find). The sub-byte ones fill whole bytes (the format refuses a tensor whose
// bits do not end on a byte).
std::optional<std::uint64_t> unreadable_dtype_bits(std::string_view name) {
  static constexpr std::pair<std::string_view, std::uint64_t> bits[] = {
      {"BOOL", 8},    {"F4", 4},      {"F6_E2M3", 6}, {"F6_E3M2", 6}, {"F8_E4M3", 8}, {"F8_E5M2", 8}, {"F8_E8M0", 8},
      {"I16", 16},    {"U16", 16},    {"F64", 64},    {"I64", 64},    {"U64", 64},    {"C64", 64}};
  for (const auto& [dtype, size] : bits) {
    if (dtype == name) return size;
  }
  return std::nullopt;
}

struct TensorEntry {
  std::string name;
  TensorSpec spec;
  std::string unreadable_dtype;  // set for a dtype of the format metile does not read
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

TensorEntry parse_entry(const std::string& file, const std::string& name, const Json& description,
                        std::uint64_t data_bytes) {
  const std::string where = file + ": tensor '" + name + "': ";
  if (!description.is_object()) throw InputError(where + "header entry is not an object");
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!description.contains(key)) throw InputError(where + "header entry has no '" + key + "'");
  }
  TensorEntry entry;
  entry.name = name;
  const Json& dtype = description["dtype"];
  if (!dtype.is_string()) throw InputError(where + "dtype is not a string");
  const std::optional<DType> parsed = parse_safetensors_dtype(dtype.get<std::string>());
  const std::optional<std::uint64_t> unreadable_bits = parsed ? std::nullopt : unreadable_dtype_bits(dtype.get<std::string>());
  if (!parsed && !unreadable_bits) {
    throw InputError(where + "unknown dtype '" + dtype.get<std::string>() + "' (" + std::string(kReadableDtypes) + ")");
  }
  if (parsed) {
    entry.spec.dtype = *parsed;
  } else {
    entry.unreadable_dtype = dtype.get<std::string>();
    entry.spec.dtype = DType::u8;  // a byte view: only its size is checked below
  }
  const Json& shape = description["shape"];
  if (!shape.is_array()) throw InputError(where + "shape is not an array");
  std::uint64_t element_count = 1;
  for (const Json& dim : shape) {
    if (!dim.is_number_unsigned()) throw InputError(where + "shape " + json_excerpt(shape) + " has a non-integer or negative dimension");
    const std::uint64_t extent = dim.get<std::uint64_t>();
    if (extent > static_cast<std::uint64_t>(kMaximumElements) ||
        (extent > 0 && element_count > static_cast<std::uint64_t>(kMaximumElements) / extent)) {
      throw InputError(where + "shape " + json_excerpt(shape) + " has more than 2^48 elements");
    }
    element_count *= extent;
    entry.spec.shape.push_back(static_cast<std::int64_t>(extent));
  }
  if (entry.spec.shape.size() > static_cast<std::size_t>(kMaximumRank)) {
    throw InputError(where + "rank " + std::to_string(entry.spec.shape.size()) + " is above the limit of " +
                     std::to_string(kMaximumRank));
  }
  const Json& offsets = description["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    throw InputError(where + "data_offsets must be two non-negative integers");
  }
  entry.begin = offsets[0].get<std::uint64_t>();
  entry.end = offsets[1].get<std::uint64_t>();
  if (entry.begin > entry.end) {
    throw InputError(where + "data_offsets [" + std::to_string(entry.begin) + ", " + std::to_string(entry.end) +
                     "] end before they begin");
  }
  if (entry.end > data_bytes) {
    throw InputError(where + "data_offsets end at byte " + std::to_string(entry.end) + " but the file holds only " +
                     std::to_string(data_bytes) + " data bytes");
  }
  // An unreadable dtype's entry holds a byte view's spec: its shape, spelled with the file's dtype.
  const auto spec_text = [&] {
    return unreadable_bits ? entry.unreadable_dtype + entry.spec.to_string().substr(dtype_name(entry.spec.dtype).size())
                           : entry.spec.to_string();
  };
  const std::uint64_t bits = element_count * (unreadable_bits ? *unreadable_bits : 8 * dtype_size(entry.spec.dtype));
  if (bits % 8 != 0) throw InputError(where + spec_text() + " has " + std::to_string(bits) + " bits, not whole bytes");
  const std::uint64_t expected = bits / 8;
  if (entry.end - entry.begin != expected) {
    throw InputError(where + spec_text() + " needs " + std::to_string(expected) + " bytes but data_offsets span " +
                     std::to_string(entry.end - entry.begin));
  }
  return entry;
}

}  // namespace

MappedSafetensors::MappedSafetensors(const std::filesystem::path& path) : path_(path) {
  const std::string file = path.string();
  const std::uint64_t file_bytes = regular_file_size(path, "safetensors");
  const int descriptor = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (descriptor < 0) throw InputError(file + ": cannot open the file: " + std::strerror(errno));
  if (file_bytes < 8) {
    ::close(descriptor);
    throw InputError(file + ": too short for a safetensors file (" + std::to_string(file_bytes) +
                     " bytes, the header length alone takes 8)");
  }
  void* mapping = ::mmap(nullptr, static_cast<std::size_t>(file_bytes), PROT_READ, MAP_PRIVATE, descriptor, 0);
  ::close(descriptor);  // the mapping keeps the file alive
  if (mapping == MAP_FAILED) throw InputError(file + ": cannot map the file: " + std::strerror(errno));
  mapping_ = static_cast<const std::byte*>(mapping);
  mapped_bytes_ = static_cast<std::size_t>(file_bytes);
  try {
    parse_header(file_bytes);
  } catch (...) {
    ::munmap(const_cast<std::byte*>(mapping_), mapped_bytes_);
    throw;
  }
}

void MappedSafetensors::parse_header(std::uint64_t file_bytes) {
  const std::string file = path_.string();
  std::uint64_t header_bytes = 0;
  for (int index = 7; index >= 0; --index) header_bytes = (header_bytes << 8) | std::to_integer<std::uint64_t>(mapping_[index]);
  if (header_bytes > file_bytes - 8) {
    throw InputError(file + ": header length " + std::to_string(header_bytes) + " runs past the end of the file (" +
                     std::to_string(file_bytes) + " bytes)");
  }
  if (header_bytes > kMaximumSafetensorsHeaderBytes) {
    throw InputError(file + ": header length " + std::to_string(header_bytes) + " is above the limit of " +
                     std::to_string(kMaximumSafetensorsHeaderBytes) + " bytes");
  }
  const std::string_view header(reinterpret_cast<const char*>(mapping_ + 8), static_cast<std::size_t>(header_bytes));
  // The format's rule, which the reference reader (the safetensors package) enforces: the header
  // begins with '{' (no byte order mark, no leading space). Its end may be padded: writers pad with
  // spaces, and the package's JSON parser, as this one, takes any JSON whitespace there (a NUL is
  // refused by parse_json_input).
  if (!header.empty() && header.front() != '{') {
    char first[8];
    std::snprintf(first, sizeof first, "0x%02X", static_cast<unsigned char>(header.front()));
    throw InputError(file + ": header must begin with '{', not byte " + first +
                     (header.starts_with("\xEF\xBB\xBF") ? " (a UTF-8 byte order mark)" : ""));
  }
  const Json parsed = parse_json_input(header, file + ": header");  // an object: it begins with '{'
  if (const auto metadata = parsed.find("__metadata__"); metadata != parsed.end()) {
    bool strings = metadata->is_object();
    if (strings) {
      for (const auto& [key, value] : metadata->items()) strings = strings && value.is_string();
    }
    if (!strings) {
      throw InputError(file + ": __metadata__ must map names to strings (the format's rule), not " + json_excerpt(*metadata));
    }
  }

  const std::uint64_t data_bytes = file_bytes - 8 - header_bytes;
  std::vector<TensorEntry> entries;
  for (const auto& [name, description] : parsed.items()) {
    if (name == "__metadata__") continue;  // a string map, checked above; nothing of ours lives there
    entries.push_back(parse_entry(file, name, description, data_bytes));
  }
  std::vector<const TensorEntry*> by_offset;
  for (const TensorEntry& entry : entries) by_offset.push_back(&entry);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorEntry* left, const TensorEntry* right) {
    return left->begin != right->begin ? left->begin < right->begin : left->end < right->end;
  });
  // The package's rule (its reader refuses anything else): the tensors' data, in offset order, covers
  // the data area exactly, each tensor beginning where the one before ended: no overlap, no unused
  // bytes between two tensors, before the first or after the last (a file with a terabyte of
  // trailing zeros loaded before).
  std::uint64_t covered = 0;
  for (std::size_t index = 0; index < by_offset.size(); ++index) {
    const TensorEntry& entry = *by_offset[index];
    if (entry.begin < covered) {
      throw InputError(file + ": tensor '" + entry.name + "': data overlaps tensor '" + by_offset[index - 1]->name + "'");
    }
    if (entry.begin > covered) {
      throw InputError(file + ": tensor '" + entry.name + "': data begins at byte " + std::to_string(entry.begin) +
                       " of the data area, " + std::to_string(entry.begin - covered) + " unused bytes after " +
                       (index == 0 ? std::string("its start") : "tensor '" + by_offset[index - 1]->name + "'") +
                       " (the format has no gaps)");
    }
    covered = entry.end;
  }
  if (covered != data_bytes) {
    throw InputError(file + ": " + std::to_string(data_bytes - covered) + " bytes after the last tensor's data (the data area holds " +
                     std::to_string(data_bytes) + " bytes, its tensors " + std::to_string(covered) + ")");
  }
  const std::byte* data = mapping_ + 8 + header_bytes;
  for (const TensorEntry& entry : entries) {
    if (!entry.unreadable_dtype.empty()) {
      unreadable_.emplace(entry.name, entry.unreadable_dtype);
      continue;
    }
    tensors_.emplace(entry.name, TensorView{entry.spec, {data + entry.begin, static_cast<std::size_t>(entry.end - entry.begin)}});
  }
}

MappedSafetensors::~MappedSafetensors() {
  if (mapping_) ::munmap(const_cast<std::byte*>(mapping_), mapped_bytes_);
}

const MappedSafetensors::TensorView* MappedSafetensors::find(std::string_view name) const {
  const auto found = tensors_.find(name);
  if (found != tensors_.end()) return &found->second;
  if (const auto unreadable = unreadable_.find(name); unreadable != unreadable_.end()) {
    refuse_unreadable(path_, name, unreadable->second);
  }
  return nullptr;
}

bool MappedSafetensors::contains(std::string_view name) const {
  return tensors_.find(name) != tensors_.end() || unreadable_.find(name) != unreadable_.end();
}

std::vector<std::string> MappedSafetensors::names() const {
  std::vector<std::string> names;
  for (const auto& [name, view] : tensors_) names.push_back(name);
  for (const auto& [name, dtype] : unreadable_) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

HostTensor MappedSafetensors::TensorView::copy() const { return HostTensor::from_bytes(spec, bytes); }

TensorMap read_safetensors(const std::filesystem::path& path) {
  const MappedSafetensors file(path);
  // Every tensor of the file is read here (run --inputs): one metile cannot read is refused.
  if (!file.unreadable().empty()) refuse_unreadable(path, file.unreadable().begin()->first, file.unreadable().begin()->second);
  TensorMap tensors;
  for (const auto& [name, view] : file.tensors()) tensors.emplace(name, view.copy());
  return tensors;
}

void check_safetensors_tensor_name(const std::filesystem::path& path, const std::string& name) {
  const std::string file = path.string();
  if (name == "__metadata__") throw InputError(file + ": a tensor cannot be named '__metadata__'");
  // The header is JSON, whose strings are UTF-8: dump_json would write U+FFFD for a bad byte, so the
  // tensor would read back under another name, and two such names as one key the reader refuses.
  if (!is_utf8(name)) throw InputError(file + ": tensor '" + printable_bytes(name) + "': a safetensors name must be UTF-8");
}

void write_safetensors(const std::filesystem::path& path, const TensorMap& tensors) {
  const std::string file = path.string();
  Json header = Json::object();
  std::uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    check_safetensors_tensor_name(path, name);
    const std::uint64_t bytes = tensor.bytes().size();
    header[name] = {{"dtype", safetensors_dtype_name(tensor.spec().dtype)},
                    {"shape", tensor.spec().shape},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string header_text = dump_json(header);
  // Pad with spaces so the data starts 8-byte aligned, as the format recommends.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  // What the reader refuses is never written (MappedSafetensors::parse_header's limit).
  if (header_text.size() > kMaximumSafetensorsHeaderBytes) {
    throw InputError(file + ": header of " + std::to_string(header_text.size()) + " bytes is above the limit of " +
                     std::to_string(kMaximumSafetensorsHeaderBytes) + " bytes");
  }

  write_output_file(path, [&](std::ostream& stream) {
    unsigned char length_bytes[8];
    std::uint64_t length = header_text.size();
    for (unsigned char& byte : length_bytes) {
      byte = static_cast<unsigned char>(length & 0xffu);
      length >>= 8;
    }
    stream.write(reinterpret_cast<const char*>(length_bytes), 8);
    stream.write(header_text.data(), static_cast<std::streamsize>(header_text.size()));
    for (const auto& [name, tensor] : tensors) {
      stream.write(reinterpret_cast<const char*>(tensor.bytes().data()),
                   static_cast<std::streamsize>(tensor.bytes().size()));
    }
  });
}

}  // namespace metile
