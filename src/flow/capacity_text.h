// Private to src/flow: how messages and DIMACS files print a capacity or flow value. Integers
// in full; doubles as the shortest text that reads back as the same double (std::to_chars), so
// two doubles that differ only in their last bits never read alike in an error that says they
// differ (dispatch's cross-check, verify's certificates) and a written file reads back exactly.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>

namespace metile {

inline std::string capacity_text(std::int64_t value) { return std::to_string(value); }

inline std::string capacity_text(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char buffer[64];
  const auto end = std::to_chars(buffer, buffer + sizeof(buffer), value).ptr;
  return std::string(buffer, end);
}

}  // namespace metile
