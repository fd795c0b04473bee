// Private to src/flow: how messages and DIMACS files print a capacity or flow value. Integers
// in full; doubles as the shortest text that reads back as the same double (std::to_chars; in
// scientific notation beyond 2^53), so
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
  // Beyond 2^53 the shortest text can be all digits ("123456789012345680"), which the DIMACS reader
  // refuses in a real file (and cannot read as an int64 past 2^63): scientific keeps it a real.
  const auto end = std::abs(value) > 9007199254740992.0  // 2^53
                       ? std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::scientific).ptr
                       : std::to_chars(buffer, buffer + sizeof(buffer), value).ptr;
  return std::string(buffer, end);
}

}  // namespace metile
