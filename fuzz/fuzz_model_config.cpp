// libFuzzer harness: config.json text (ModelConfig::parse_json). Any input must parse or throw
// InputError; what parses must be written back by to_json, in the transformers 4 and 5 spellings,
// as text that parses to the same config (outside the try: an error there is a finding).
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "metile/model.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::optional<metile::ModelConfig> config;
  try {
    config = metile::ModelConfig::parse_json(text, "config.json");
  } catch (const metile::InputError&) {
    return 0;
  }
  for (int version : {4, 5}) {
    if (!(metile::ModelConfig::parse_json(config->to_json(version), "written") == *config)) std::abort();
  }
  return 0;
}
