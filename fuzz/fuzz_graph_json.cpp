// libFuzzer harness: graph JSON files (parse_graph_json). Any input must parse or
// throw InputError; a graph that parses must survive a write/parse round trip unchanged.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "metile/graph.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const metile::ComputeGraph graph = metile::parse_graph_json(text, "fuzz.json");
    if (metile::parse_graph_json(metile::write_graph_json(graph), "written.json") != graph) std::abort();
  } catch (const metile::InputError&) {
  }
  return 0;
}
