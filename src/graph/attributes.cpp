// Op attributes: a small typed map. Getters name the attribute and the type
// they wanted so a JSON typo ("eps": "1e-5") reads as one clear error.
#include <string>

#include "metile/graph.h"

namespace metile {
namespace {

std::string type_name(const AttributeValue& value) {
  switch (value.index()) {
    case 0: return "an integer";
    case 1: return "a number";
    case 2: return "a string";
    default: return "an integer list";
  }
}

const AttributeValue& find_attribute(const std::map<std::string, AttributeValue, std::less<>>& entries,
                                     std::string_view name) {
  auto found = entries.find(name);
  if (found == entries.end()) throw InputError("missing attribute '" + std::string(name) + "'");
  return found->second;
}

[[noreturn]] void wrong_type(std::string_view name, std::string_view wanted, const AttributeValue& value) {
  throw InputError("attribute '" + std::string(name) + "' must be " + std::string(wanted) + ", got " +
                   type_name(value));
}

}  // namespace

bool Attributes::has(std::string_view name) const { return entries_.find(name) != entries_.end(); }

void Attributes::set(std::string name, AttributeValue value) { entries_.insert_or_assign(std::move(name), std::move(value)); }

std::int64_t Attributes::get_int(std::string_view name) const {
  const AttributeValue& value = find_attribute(entries_, name);
  if (const auto* integer = std::get_if<std::int64_t>(&value)) return *integer;
  wrong_type(name, "an integer", value);
}

double Attributes::get_double(std::string_view name) const {
  const AttributeValue& value = find_attribute(entries_, name);
  if (const auto* number = std::get_if<double>(&value)) return *number;
  if (const auto* integer = std::get_if<std::int64_t>(&value)) return static_cast<double>(*integer);
  wrong_type(name, "a number", value);
}

const std::string& Attributes::get_string(std::string_view name) const {
  const AttributeValue& value = find_attribute(entries_, name);
  if (const auto* text = std::get_if<std::string>(&value)) return *text;
  wrong_type(name, "a string", value);
}

const std::vector<std::int64_t>& Attributes::get_ints(std::string_view name) const {
  const AttributeValue& value = find_attribute(entries_, name);
  if (const auto* integers = std::get_if<std::vector<std::int64_t>>(&value)) return *integers;
  wrong_type(name, "an integer list", value);
}

}  // namespace metile
