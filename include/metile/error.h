// metile errors: the split every front end relies on. An InputError is the
// user's mistake (bad graph, bad file, bad argument): the CLI exits 2 and Python
// raises ValueError. Any other exception is an internal failure: exit 1.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace metile {

class InputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// `text` (bytes a user gave, quoted in a message) with every byte outside printable ASCII as
// \xNN: a NUL, an escape sequence or half a UTF-8 sequence neither cuts nor colours the one-line
// message, which stays valid UTF-8 for Python.
inline std::string printable_bytes(std::string_view text) {
  constexpr char kHex[] = "0123456789abcdef";
  std::string result;
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f) {
      result += c;
    } else {
      result += "\\x";
      result += kHex[byte >> 4];
      result += kHex[byte & 15];
    }
  }
  return result;
}

}  // namespace metile
