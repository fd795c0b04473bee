// Bulk f32 access to HostTensor data for the CPU reference. HostTensor::at and
// store go through double one element at a time, which dominated the run time
// of graphs with large weights; these read and write whole spans with the
// exact conversions of graph.h. Reading is exact for every floating dtype;
// writing rounds each f32 value once to the tensor's dtype, which equals
// HostTensor::store of the same value.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <vector>

#include "metile/graph.h"

namespace metile::cpu {

inline void read_floats(const HostTensor& tensor, std::int64_t first, std::span<float> out) {
  const DType dtype = tensor.spec().dtype;
  if (first < 0 || first + static_cast<std::int64_t>(out.size()) > tensor.element_count()) {
    throw std::out_of_range("read_floats: span outside " + tensor.spec().to_string());
  }
  const std::byte* data = tensor.bytes().data() + first * static_cast<std::int64_t>(dtype_size(dtype));
  switch (dtype) {
    case DType::f32:
      std::memcpy(out.data(), data, out.size() * sizeof(float));
      return;
    case DType::bf16:
      // bf16_bits_to_f32 written inline (the top half of an f32): this loop feeds every
      // bf16 contraction, and a call per element cost more than the arithmetic.
      for (std::size_t index = 0; index < out.size(); ++index) {
        std::uint16_t bits;
        std::memcpy(&bits, data + index * 2, 2);
        const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
        std::memcpy(&out[index], &wide, 4);
      }
      return;
    case DType::f16:
      for (std::size_t index = 0; index < out.size(); ++index) {
        std::uint16_t bits;
        std::memcpy(&bits, data + index * 2, 2);
        out[index] = f16_bits_to_f32(bits);
      }
      return;
    default:
      for (std::size_t index = 0; index < out.size(); ++index) {
        out[index] = static_cast<float>(tensor.at(first + static_cast<std::int64_t>(index)));
      }
  }
}

inline std::vector<float> load_floats(const HostTensor& tensor) {
  std::vector<float> values(static_cast<std::size_t>(tensor.element_count()));
  read_floats(tensor, 0, values);
  return values;
}

inline void write_floats(HostTensor& tensor, std::int64_t first, std::span<const float> values) {
  const DType dtype = tensor.spec().dtype;
  if (first < 0 || first + static_cast<std::int64_t>(values.size()) > tensor.element_count()) {
    throw std::out_of_range("write_floats: span outside " + tensor.spec().to_string());
  }
  std::byte* data = tensor.bytes().data() + first * static_cast<std::int64_t>(dtype_size(dtype));
  switch (dtype) {
    case DType::f32:
      std::memcpy(data, values.data(), values.size() * sizeof(float));
      return;
    case DType::f16:
    case DType::bf16:
      for (std::size_t index = 0; index < values.size(); ++index) {
        const std::uint16_t bits =
            dtype == DType::f16 ? f32_to_f16_bits(values[index]) : f32_to_bf16_bits(values[index]);
        std::memcpy(data + index * 2, &bits, 2);
      }
      return;
    default:
      for (std::size_t index = 0; index < values.size(); ++index) {
        tensor.store(first + static_cast<std::int64_t>(index), values[index]);
      }
  }
}

}  // namespace metile::cpu
