// libFuzzer harness: config.json text (ModelConfig::parse_json). Any input must parse or throw
// InputError; what parses must be written back by to_json, in the transformers 4 and 5 spellings,
// as text that parses to the same config.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "metile/model.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const metile::ModelConfig config = metile::ModelConfig::parse_json(text, "config.json");
    for (int version : {4, 5}) {
      if (!(metile::ModelConfig::parse_json(config.to_json(version), "written") == config)) std::abort();
    }
  } catch (const metile::InputError&) {
  }
  return 0;
}
