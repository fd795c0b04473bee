// Shared helpers of the CPU runtime tests: seeded random tensors and
// tolerance checks against long double oracles.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "metile/graph.h"
#include "metile_test_support.h"

namespace metile::testing {

// The seed of this test process, printed once (METILE_TEST_SEED replays it); random_tensor adds
// it to the seed a test names, so every run draws fresh inputs while a test's tensors stay
// distinct from each other.
inline std::uint64_t process_seed() {
  static const std::uint64_t seed = test_seed("cpu_runtime random tensors");
  return seed;
}

// Uniform values in [low, high), rounded to the dtype; drawn from the raw
// engine output so they are the same with every standard library.
inline HostTensor random_tensor(TensorSpec spec, std::uint64_t seed, double low = -1.0, double high = 1.0) {
  std::mt19937_64 generator(seed + process_seed());
  std::vector<double> values(static_cast<std::size_t>(spec.element_count()));
  for (double& value : values)
    value = low + (high - low) * (static_cast<double>(generator() >> 11) * 0x1.0p-53);
  return HostTensor::from_values(std::move(spec), values);
}

// One unit in the last place of `value` in dtype (f16: 2^-10 relative, bf16: 2^-7, f32: 2^-23), and
// no finer than the dtype's subnormal spacing (f16: 2^-24, bf16: 2^-133, f32: 2^-149): a value near
// zero (an f16 output of 2.7e-6 is subnormal) is rounded to that grid, not to its relative ulp. Without
// this floor the random-row tests failed about once in 60 fresh seeds.
inline long double ulp_of(long double value, DType dtype) {
  const int mantissa_bits = dtype == DType::f16 ? 10 : dtype == DType::bf16 ? 7 : 23;
  const int smallest_exponent = dtype == DType::f16 ? -14 : -126;  // of the smallest normal number
  const long double magnitude = std::max(std::fabs(value), 1e-30L);
  const int exponent = std::max(std::ilogb(static_cast<double>(magnitude)), smallest_exponent);
  return std::ldexp(1.0L, exponent - mantissa_bits);
}

// |actual - expected| <= ulps * ulp(expected) + absolute
inline ::testing::AssertionResult close_in_ulps(double actual, long double expected, DType dtype, double ulps,
                                                double absolute = 0) {
  const long double error = std::fabs(static_cast<long double>(actual) - expected);
  if (error <= ulps * ulp_of(expected, dtype) + absolute) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "actual " << actual << " expected " << static_cast<double>(expected) << " error "
         << static_cast<double>(error) << " > " << ulps << " ulps of " << dtype_name(dtype);
}

}  // namespace metile::testing
