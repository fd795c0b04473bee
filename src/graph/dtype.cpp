// dtype helpers and the exact float conversions every backend relies on.
// The f16/bf16 conversions are pure integer bit manipulation (no F16C, no
// compiler half type) so results are identical on every host and under UBSan;
// tests check them against an independent nearest-value reference.
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "metile/graph.h"

namespace metile {

static_assert(std::numeric_limits<float>::is_iec559, "metile assumes IEEE-754 binary32 floats");

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f32: return "f32";
    case DType::i8: return "i8";
    case DType::u8: return "u8";
    case DType::i32: return "i32";
    case DType::u32: return "u32";
  }
  return "?";
}

DType parse_dtype(std::string_view name) {
  for (DType dtype : {DType::f16, DType::bf16, DType::f32, DType::i8, DType::u8, DType::i32, DType::u32}) {
    if (dtype_name(dtype) == name) return dtype;
  }
  throw InputError("unknown dtype '" + printable_bytes(name) + "' (expected f16, bf16, f32, i8, u8, i32 or u32)");
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f16:
    case DType::bf16: return 2;
    case DType::f32:
    case DType::i32:
    case DType::u32: return 4;
    case DType::i8:
    case DType::u8: return 1;
  }
  return 0;
}

bool is_floating(DType dtype) { return dtype == DType::f16 || dtype == DType::bf16 || dtype == DType::f32; }

std::uint16_t f32_to_f16_bits(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = (bits >> 16) & 0x8000u;
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) {
    if (magnitude == 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
    // NaN: keep the top payload bits and force the quiet bit so the payload never becomes inf.
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
  }
  const int exponent = static_cast<int>(magnitude >> 23) - 127;
  if (exponent >= 16) return static_cast<std::uint16_t>(sign | 0x7c00u);  // at or beyond 2^16: overflow
  if (exponent >= -14) {
    // Normal half: drop 13 mantissa bits, round to nearest even. A carry out of
    // the mantissa correctly bumps the exponent (and 65520 and up become inf).
    const std::uint32_t mantissa = magnitude & 0x7fffffu;
    std::uint32_t half = (static_cast<std::uint32_t>(exponent + 15) << 10) | (mantissa >> 13);
    const std::uint32_t remainder = mantissa & 0x1fffu;
    if (remainder > 0x1000u || (remainder == 0x1000u && (half & 1u))) ++half;
    return static_cast<std::uint16_t>(sign | half);
  }
  if (exponent < -25) return static_cast<std::uint16_t>(sign);  // below half the smallest subnormal
  // Subnormal half: the value in units of 2^-24 is significand * 2^(exponent + 1).
  const std::uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u;
  const int shift = -exponent - 1;  // 14 .. 24
  std::uint32_t half = significand >> shift;
  const std::uint32_t remainder = significand & ((1u << shift) - 1u);
  const std::uint32_t halfway = 1u << (shift - 1);
  if (remainder > halfway || (remainder == halfway && (half & 1u))) ++half;  // may carry into the smallest normal
  return static_cast<std::uint16_t>(sign | half);
}

float f16_bits_to_f32(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1fu;
  const std::uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24 is exact in f32.
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return std::bit_cast<float>(std::bit_cast<std::uint32_t>(magnitude) | sign);
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

std::uint16_t f32_to_bf16_bits(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);  // NaN: quiet, keep sign and top payload
  }
  // Round to nearest even on the dropped 16 bits; a carry walks into the
  // exponent, and the largest finite values round up to inf as they should.
  const std::uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

float bf16_bits_to_f32(std::uint16_t bits) { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }

namespace {

template <typename Integer>
float round_to_integer(float value) {
  if (std::isnan(value)) return 0.0f;
  const double nearest = std::nearbyint(static_cast<double>(value));  // default mode: ties to even
  const double lowest = static_cast<double>(std::numeric_limits<Integer>::lowest());
  const double highest = static_cast<double>(std::numeric_limits<Integer>::max());
  return static_cast<float>(std::fmin(std::fmax(nearest, lowest), highest));
}

}  // namespace

float round_to_dtype(float value, DType dtype) {
  switch (dtype) {
    case DType::f32: return value;
    case DType::f16: return f16_bits_to_f32(f32_to_f16_bits(value));
    case DType::bf16: return bf16_bits_to_f32(f32_to_bf16_bits(value));
    case DType::i8: return round_to_integer<std::int8_t>(value);
    case DType::u8: return round_to_integer<std::uint8_t>(value);
    case DType::i32: return round_to_integer<std::int32_t>(value);
    case DType::u32: return round_to_integer<std::uint32_t>(value);
  }
  return value;
}

}  // namespace metile
