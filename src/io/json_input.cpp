// JSON reading with limits; see json_input.h. The depth scan runs before the
// parse because nlohmann builds (and later destroys and dumps) values
// recursively: 100k nested brackets must never reach it.
#include "json_input.h"

#include <optional>
#include <unordered_set>
#include <string>
#include <vector>

namespace metile {
namespace {

using Json = nlohmann::json;

// Brackets inside strings do not nest; escapes inside strings hide a quote.
void check_depth(std::string_view text, std::string_view source) {
  int depth = 0;
  bool in_string = false;
  bool escaped = false;
  for (std::size_t position = 0; position < text.size(); ++position) {
    const char c = text[position];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaximumJsonDepth) {
        throw InputError(std::string(source) + ": invalid JSON: nested deeper than " +
                         std::to_string(kMaximumJsonDepth) + " levels at byte " + std::to_string(position));
      }
    } else if (c == ']' || c == '}') {
      --depth;  // unbalanced text is the parser's to report
    }
  }
}

// Whether a JSON number's text has a non-zero digit before its exponent ("1e-400" does, "0.0e5" not).
bool has_nonzero_mantissa(std::string_view text) {
  for (const char c : text) {
    if (c == 'e' || c == 'E') return false;
    if (c >= '1' && c <= '9') return true;
  }
  return false;
}

// The SAX events of one document, keeping only the keys of each open object, and the first number
// whose text is not 0 but whose double is (1e-400: the parse below reads it as 0, so a scale factor
// written 1e-400 multiplied by 0 where 1e-46 is refused as "0 in f32"; the DIMACS reader refuses it
// too). Overflow (1e400) is the parser's error already.
struct DocumentChecks {
  std::vector<std::unordered_set<std::string>> open_objects;
  std::optional<std::string> repeated;
  std::optional<std::string> underflowed;

  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(Json::number_integer_t) { return true; }
  bool number_unsigned(Json::number_unsigned_t) { return true; }
  bool number_float(Json::number_float_t value, const Json::string_t& text) {
    if (value != 0 || !has_nonzero_mantissa(text)) return true;
    underflowed = text;
    return false;  // stops the pass
  }
  bool string(Json::string_t&) { return true; }
  bool binary(Json::binary_t&) { return true; }
  bool start_object(std::size_t) {
    open_objects.emplace_back();
    return true;
  }
  bool key(Json::string_t& key) {
    if (open_objects.back().insert(key).second) return true;
    repeated = key;
    return false;  // stops the pass
  }
  bool end_object() {
    open_objects.pop_back();
    return true;
  }
  bool start_array(std::size_t) { return true; }
  bool end_array() { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) { return false; }
};

}  // namespace

Json parse_json_input(std::string_view text, std::string_view source) {
  // nlohmann's lexer takes a NUL byte for the end of the input, so "{...}" followed by a NUL and
  // anything at all parsed as the object alone. JSON holds no raw NUL anywhere (a string spells it
  // \u0000), so one is an error wherever it is.
  if (const std::size_t nul = text.find('\0'); nul != std::string_view::npos) {
    throw InputError(std::string(source) + ": invalid JSON: a NUL byte at byte " + std::to_string(nul) +
                     " (JSON has none; a string spells it \\u0000)");
  }
  check_depth(text, source);
  // A name given twice in one object is an error, not "the last one wins" (a safetensors header
  // listing a tensor twice, a node with two "op" fields): a SAX pass that builds nothing finds it
  // (nlohmann's DOM keeps the last, and its callback parser costs minutes on a 100k-node graph
  // under AddressSanitizer). A syntax error stops this pass; the parse below reports it.
  DocumentChecks checks;
  Json::sax_parse(text, &checks, Json::input_format_t::json, false);
  if (checks.repeated) {
    throw InputError(std::string(source) + ": invalid JSON: the key \"" + printable_bytes(*checks.repeated) +
                     "\" appears twice in one object");
  }
  if (checks.underflowed) {
    const std::string& number = *checks.underflowed;
    const std::string shown = number.size() <= 40 ? number : number.substr(0, 37) + "...";
    throw InputError(std::string(source) + ": invalid JSON: the number " + printable_bytes(shown) +
                     " is outside a double's range (0 or 4.9e-324 .. 1.8e308)");
  }
  try {
    return Json::parse(text);
  } catch (const Json::exception& error) {
    throw InputError(std::string(source) + ": invalid JSON: " + json_error_reason(error));
  }
}

std::string json_error_reason(const Json::exception& error) {
  // nlohmann's message starts with "[json.exception.parse_error.101] "; the rest is the useful part.
  std::string message = error.what();
  const std::size_t bracket = message.find("] ");
  if (message.starts_with("[json.exception") && bracket != std::string::npos) message.erase(0, bracket + 2);
  return printable_bytes(message);
}

std::string json_excerpt(const Json& value) {
  constexpr std::size_t kLength = 60;
  std::string text = dump_json(value);
  if (text.size() > kLength) text = text.substr(0, kLength - 3) + "...";
  return text;
}

bool is_utf8(std::string_view text) {
  try {
    (void)nlohmann::json(std::string(text)).dump();  // the default (strict) handler throws type_error 316
  } catch (const nlohmann::json::type_error&) {
    return false;
  }
  return true;
}

}  // namespace metile
