// JSON as metile reads it from files (graphs, safetensors headers, targets):
// nesting limited to kMaximumJsonDepth before nlohmann sees the text, every parse
// failure (syntax, a number like 1e400 out of double's range) an InputError, and
// short excerpts of values for messages, so no error path dumps a huge value.
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "metile/io.h"

namespace metile {

// Throws InputError "SOURCE: invalid JSON: ..." (a syntax error, a number out of range: past a double's
// largest, or not 0 and below its smallest subnormal; a key given twice in one object) or "SOURCE: JSON
// nested deeper than ...".
nlohmann::json parse_json_input(std::string_view text, std::string_view source);

// What an nlohmann exception says, without its "[json.exception.type_error.302] " prefix and with
// control bytes spelled out: for messages about JSON read some other way (a certificate attribute).
std::string json_error_reason(const nlohmann::json::exception& error);

// value.dump(indent) (json or ordered_json) with bytes that are not UTF-8 replaced by U+FFFD, where
// nlohmann's default handler throws type_error 316: names set from C++ need not be UTF-8 (GraphBuilder
// refuses control bytes only), and every writer of JSON (graphs, plans, targets, safetensors headers,
// excerpts in messages) must stay total. The one place that says how metile dumps JSON.
template <typename BasicJson>
std::string dump_json(const BasicJson& value, int indent = -1) {
  return value.dump(indent, ' ', false, BasicJson::error_handler_t::replace);
}

// Whether `text` is UTF-8, as a JSON string must be: what nlohmann's strict dump accepts. For names
// that must come back from a JSON file as they went in (dump_json would write U+FFFD for a bad byte).
bool is_utf8(std::string_view text);

// dump_json(value), cut to about 60 characters with "..." when longer.
std::string json_excerpt(const nlohmann::json& value);

}  // namespace metile
