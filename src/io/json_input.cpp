// JSON reading with limits; see json_input.h. The depth scan runs before the
// parse because nlohmann builds (and later destroys and dumps) values
// recursively: 100k nested brackets must never reach it.
#include "json_input.h"

#include <set>
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

}  // namespace

Json parse_json_input(std::string_view text, std::string_view source) {
  check_depth(text, source);
  // The keys of each open object: a name given twice is an error, not "the last one wins" (a
  // safetensors header listing a tensor twice, a node with two "op" fields).
  std::vector<std::set<std::string>> open_objects;
  const auto refuse_repeated_keys = [&](int, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == Json::parse_event_t::object_end) {
      open_objects.pop_back();
    } else if (event == Json::parse_event_t::key && !open_objects.empty()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!open_objects.back().insert(key).second) {
        throw InputError(std::string(source) + ": invalid JSON: the key \"" + printable_bytes(key) +
                         "\" appears twice in one object");
      }
    }
    return true;
  };
  try {
    return Json::parse(text, refuse_repeated_keys);
  } catch (const Json::exception& error) {
    // nlohmann's message starts with "[json.exception.parse_error.101] "; the rest is the useful part.
    std::string message = error.what();
    const std::size_t bracket = message.find("] ");
    if (message.starts_with("[json.exception") && bracket != std::string::npos) message.erase(0, bracket + 2);
    throw InputError(std::string(source) + ": invalid JSON: " + printable_bytes(message));
  }
}

std::string json_excerpt(const Json& value) {
  constexpr std::size_t kLength = 60;
  std::string text = value.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (text.size() > kLength) text = text.substr(0, kLength - 3) + "...";
  return text;
}

}  // namespace metile
