// TensorSpec and HostTensor: tensor data on the host in its dtype's exact bit
// layout. Element access goes through double, which holds every value of every
// dtype exactly; store() rounds a double straight to the dtype (never through a
// second rounding, see round_double_to_float_odd).
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "metile/graph.h"

namespace metile {

static_assert(std::endian::native == std::endian::little, "HostTensor stores little-endian data");

// Checked: a spec built outside GraphBuilder (Python, a test, a file) may hold any
// numbers, and a wrapped count would size an allocation.
std::int64_t TensorSpec::element_count() const {
  std::int64_t count = 1;
  for (std::int64_t dim : shape) {
    if (dim < 0) throw InputError("tensor " + to_string() + " has a negative dimension");
    if (__builtin_mul_overflow(count, dim, &count)) {
      throw InputError("tensor " + to_string() + ": element count overflows a 64-bit integer");
    }
  }
  return count;
}

std::int64_t TensorSpec::bytes() const {
  std::int64_t bytes = 0;
  if (__builtin_mul_overflow(element_count(), static_cast<std::int64_t>(dtype_size(dtype)), &bytes)) {
    throw InputError("tensor " + to_string() + ": byte count overflows a 64-bit integer");
  }
  return bytes;
}

std::string TensorSpec::to_string() const {
  std::string text(dtype_name(dtype));
  text += '[';
  for (std::size_t axis = 0; axis < shape.size(); ++axis) {
    if (axis > 0) text += ", ";
    text += std::to_string(shape[axis]);
  }
  text += ']';
  return text;
}

namespace {

// Rounds a double to float with "round to odd": truncate, then set the last
// bit if anything was dropped. Rounding that float again to a format with at
// least two fewer significand bits (f16: 11, bf16: 8, f32 has 24) gives the
// same result as rounding the double directly, so f16/bf16 stores are exact.
float round_double_to_float_odd(double value) {
  if (std::isnan(value)) return static_cast<float>(value);
  float rounded = static_cast<float>(value);
  if (std::fabs(static_cast<double>(rounded)) > std::fabs(value)) rounded = std::nextafter(rounded, 0.0f);
  if (static_cast<double>(rounded) != value) {
    rounded = std::bit_cast<float>(std::bit_cast<std::uint32_t>(rounded) | 1u);
  }
  return rounded;
}

template <typename Integer>
Integer round_to_integer(double value) {
  if (std::isnan(value)) return 0;
  const double nearest = std::nearbyint(value);  // ties to even in the default rounding mode
  if (nearest <= static_cast<double>(std::numeric_limits<Integer>::lowest())) {
    return std::numeric_limits<Integer>::lowest();
  }
  if (nearest >= static_cast<double>(std::numeric_limits<Integer>::max())) return std::numeric_limits<Integer>::max();
  return static_cast<Integer>(nearest);
}

template <typename T>
T load(const std::byte* address) {
  T value;
  std::memcpy(&value, address, sizeof(T));
  return value;
}

template <typename T>
void save(std::byte* address, T value) {
  std::memcpy(address, &value, sizeof(T));
}

// Every tensor's shape, before its bytes are allocated: InputError for a negative dimension.
void check_dimensions(const TensorSpec& spec) {
  for (std::int64_t dim : spec.shape) {
    if (dim < 0) throw InputError("tensor " + spec.to_string() + " has a negative dimension");
  }
}

}  // namespace

HostTensor::HostTensor(TensorSpec spec) : spec_(std::move(spec)) {
  check_dimensions(spec_);
  data_.assign(static_cast<std::size_t>(spec_.bytes()), std::byte{0});
}

HostTensor HostTensor::from_bytes(TensorSpec spec, std::span<const std::byte> bytes) {
  HostTensor tensor;
  tensor.spec_ = std::move(spec);
  check_dimensions(tensor.spec_);
  if (static_cast<std::int64_t>(bytes.size()) != tensor.spec_.bytes()) {
    throw InputError("tensor " + tensor.spec_.to_string() + " takes " + std::to_string(tensor.spec_.bytes()) +
                     " bytes, not " + std::to_string(bytes.size()));
  }
  tensor.data_.assign(bytes.begin(), bytes.end());
  return tensor;
}

HostTensor HostTensor::from_values(TensorSpec spec, std::span<const double> values) {
  HostTensor tensor(std::move(spec));
  if (static_cast<std::int64_t>(values.size()) != tensor.element_count()) {
    throw InputError("tensor " + tensor.spec().to_string() + " needs " + std::to_string(tensor.element_count()) +
                     " values, got " + std::to_string(values.size()));
  }
  for (std::size_t index = 0; index < values.size(); ++index) {
    tensor.store(static_cast<std::int64_t>(index), values[index]);
  }
  return tensor;
}

double HostTensor::at(std::int64_t index) const {
  if (index < 0 || index >= element_count()) {
    throw std::out_of_range("HostTensor::at: index " + std::to_string(index) + " outside " + spec_.to_string());
  }
  const std::byte* address = data_.data() + index * static_cast<std::int64_t>(dtype_size(spec_.dtype));
  switch (spec_.dtype) {
    case DType::f16: return f16_bits_to_f32(load<std::uint16_t>(address));
    case DType::bf16: return bf16_bits_to_f32(load<std::uint16_t>(address));
    case DType::f32: return load<float>(address);
    case DType::i8: return load<std::int8_t>(address);
    case DType::u8: return load<std::uint8_t>(address);
    case DType::i32: return load<std::int32_t>(address);
    case DType::u32: return load<std::uint32_t>(address);
  }
  return 0.0;
}

double round_double_to_dtype(double value, DType dtype) {
  switch (dtype) {
    case DType::f16: return f16_bits_to_f32(f32_to_f16_bits(round_double_to_float_odd(value)));
    case DType::bf16: return bf16_bits_to_f32(f32_to_bf16_bits(round_double_to_float_odd(value)));
    case DType::f32: return static_cast<float>(value);
    case DType::i8: return round_to_integer<std::int8_t>(value);
    case DType::u8: return round_to_integer<std::uint8_t>(value);
    case DType::i32: return round_to_integer<std::int32_t>(value);
    case DType::u32: return round_to_integer<std::uint32_t>(value);
  }
  return value;
}

void HostTensor::store(std::int64_t index, double value) {
  if (index < 0 || index >= element_count()) {
    throw std::out_of_range("HostTensor::store: index " + std::to_string(index) + " outside " + spec_.to_string());
  }
  std::byte* address = data_.data() + index * static_cast<std::int64_t>(dtype_size(spec_.dtype));
  switch (spec_.dtype) {
    // round_double_to_dtype's value is exact in the dtype, so the conversions below drop nothing.
    case DType::f16: save(address, f32_to_f16_bits(static_cast<float>(round_double_to_dtype(value, DType::f16)))); return;
    case DType::bf16: save(address, f32_to_bf16_bits(static_cast<float>(round_double_to_dtype(value, DType::bf16)))); return;
    case DType::f32: save(address, static_cast<float>(round_double_to_dtype(value, DType::f32))); return;
    case DType::i8: save(address, static_cast<std::int8_t>(round_double_to_dtype(value, DType::i8))); return;
    case DType::u8: save(address, static_cast<std::uint8_t>(round_double_to_dtype(value, DType::u8))); return;
    case DType::i32: save(address, static_cast<std::int32_t>(round_double_to_dtype(value, DType::i32))); return;
    case DType::u32: save(address, static_cast<std::uint32_t>(round_double_to_dtype(value, DType::u32))); return;
  }
}

std::vector<double> HostTensor::to_values() const {
  std::vector<double> values(static_cast<std::size_t>(element_count()));
  for (std::size_t index = 0; index < values.size(); ++index) values[index] = at(static_cast<std::int64_t>(index));
  return values;
}

std::uint64_t fnv1a_64(std::span<const std::byte> bytes, std::uint64_t seed) {
  std::uint64_t hash = 0xcbf29ce484222325ull ^ seed;
  for (std::byte byte : bytes) {
    hash ^= static_cast<std::uint64_t>(byte);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

std::uint64_t fnv1a_64(std::string_view text, std::uint64_t seed) {
  return fnv1a_64(std::as_bytes(std::span<const char>(text.data(), text.size())), seed);
}

}  // namespace metile
