// metile errors: the split every front end relies on. An InputError is the
// user's mistake (bad graph, bad file, bad argument): the CLI exits 2 and Python
// raises ValueError. A WriteError is a file metile writes that the system would not
// take (a full disk, `ulimit -f`, an I/O error): the CLI exits 1, as for a failed write
// to standard output, and Python raises OSError. Any other exception is an internal
// failure: exit 1.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace metile {

// One byte as \xNN.
inline std::string byte_text(char c) {
  constexpr char kHex[] = "0123456789abcdef";
  const auto byte = static_cast<unsigned char>(c);
  return std::string("\\x") + kHex[byte >> 4] + kHex[byte & 15];
}

class InputError : public std::runtime_error {
 public:
  // what() is a C string: a NUL in the message (a tensor name, a dtype or a config string quoted
  // from a file, where JSON's \u0000 puts one) ended it there, and the reason after it was lost
  // ("model.safetensors: tensor 'b" and nothing more). The NUL is spelled \x00 instead; the other
  // control bytes are left to the front ends (the CLI spells them when it prints the line).
  explicit InputError(const std::string& message) : std::runtime_error(nul_spelled(message)) {}
  explicit InputError(const char* message) : InputError(std::string(message)) {}

 private:
  static std::string nul_spelled(const std::string& message) {
    if (message.find('\0') == std::string::npos) return message;
    std::string result;
    for (const char c : message) result += c == '\0' ? byte_text(c) : std::string(1, c);
    return result;
  }
};

// A write the system refused after the file was opened: nothing the user gave was wrong.
class WriteError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// How many bytes of `text` at `offset` make a control byte: 1 for a C0 control byte or DEL (a NUL
// would end a message, what() being a C string; an escape sequence would reach the terminal; a newline
// would forge a line of output), 2 for a C1 control, U+0080..U+009F, written 0xC2 0x80..0x9F (a
// terminal in UTF-8 mode may take U+009B as CSI, the start of an escape sequence), 0 otherwise.
inline std::size_t control_byte_length(std::string_view text, std::size_t offset) {
  const auto byte = static_cast<unsigned char>(text[offset]);
  if (byte < 0x20 || byte == 0x7f) return 1;
  if (byte != 0xc2 || offset + 1 == text.size()) return 0;
  const auto next = static_cast<unsigned char>(text[offset + 1]);
  return next >= 0x80 && next <= 0x9f ? 2 : 0;
}

// How many bytes of `text` at `offset` make a bidirectional formatting character (U+061C,
// U+200E..U+200F, U+202A..U+202E, U+2066..U+2069: they reorder what is printed after them, so a name
// could show as another name, "Trojan Source"): 2 or 3, 0 otherwise.
inline std::size_t bidirectional_character_length(std::string_view text, std::size_t offset) {
  if (offset + 1 >= text.size()) return 0;
  const auto byte = static_cast<unsigned char>(text[offset]);
  const auto next = static_cast<unsigned char>(text[offset + 1]);
  if (byte == 0xd8) return next == 0x9c ? 2 : 0;  // U+061C, the Arabic letter mark
  if (byte != 0xe2 || offset + 2 == text.size()) return 0;
  const auto last = static_cast<unsigned char>(text[offset + 2]);
  const bool marks_and_embeddings = next == 0x80 && ((last >= 0x8e && last <= 0x8f) || (last >= 0xaa && last <= 0xae));
  const bool isolates = next == 0x81 && last >= 0xa6 && last <= 0xa9;
  return marks_and_embeddings || isolates ? 3 : 0;
}

// How many bytes of `text` at `offset` make a control character: a control byte or a bidirectional
// formatting character (above); 0 otherwise.
inline std::size_t control_character_length(std::string_view text, std::size_t offset) {
  const std::size_t control = control_byte_length(text, offset);
  return control > 0 ? control : bidirectional_character_length(text, offset);
}

// `text` (bytes a user gave, quoted in a message) with every byte outside printable ASCII as
// \xNN: a NUL, an escape sequence or half a UTF-8 sequence neither cuts nor colours the one-line
// message, which stays valid UTF-8 for Python.
inline std::string printable_bytes(std::string_view text) {
  std::string result;
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    result += byte >= 0x20 && byte < 0x7f ? std::string(1, c) : byte_text(c);
  }
  return result;
}

// `text` with its control bytes as \xNN and every other byte as it is (UTF-8 reads as written): for
// messages that already quote valid text, a name or a path, which may hold a control character.
inline std::string control_bytes_spelled(std::string_view text) {
  std::string result;
  for (std::size_t offset = 0; offset < text.size();) {
    const std::size_t length = control_character_length(text, offset);
    if (length == 0) result += text[offset++];
    for (const std::size_t end = offset + length; offset < end; ++offset) result += byte_text(text[offset]);
  }
  return result;
}

// Names are printed a line each (run's summaries, plan's regions and rules, DOT labels): a newline or
// other control byte in one would forge or colour that output, a bidirectional formatting character
// reorder it. Throws InputError(prefix + "a name may not hold a control character (\xNN at offset N)")
// for the first one ("a bidirectional formatting character" for those); the prefix names the owner
// with its own control bytes spelled, so that no message carries the raw bytes.
inline void refuse_control_bytes_in_name(std::string_view name, const std::string& prefix) {
  for (std::size_t offset = 0; offset < name.size(); ++offset) {
    const std::size_t control = control_byte_length(name, offset);
    const std::size_t length = control > 0 ? control : bidirectional_character_length(name, offset);
    if (length > 0) {
      throw InputError(prefix + "a name may not hold a " +
                       (control > 0 ? "control character (" : "bidirectional formatting character (") +
                       control_bytes_spelled(name.substr(offset, length)) + " at offset " + std::to_string(offset) + ")");
    }
  }
}

}  // namespace metile
