// Attributes from a literal list, for code in the graph module that records nodes itself
// (GraphBuilder's op methods, the op table's sample graphs).
#pragma once

#include <initializer_list>
#include <utility>

#include "metile/graph.h"

namespace metile::graph_detail {

inline Attributes attributes_of(std::initializer_list<std::pair<const char*, AttributeValue>> entries) {
  Attributes attributes;
  for (const auto& [name, value] : entries) attributes.set(name, value);
  return attributes;
}

}  // namespace metile::graph_detail
