// libFuzzer harness: config.json text (ModelConfig::parse_json). Any input must parse or throw
// InputError; what parses must be written back by to_json, in the transformers 4 and 5 spellings,
// as text that parses to the same config (outside the try: an error there is a finding). The same
// text read as a generation_config.json (ModelConfig::read_generation_config) must be read or
// throw InputError, and change nothing but the end-of-sequence tokens.
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "metile/model.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  metile::ModelConfig generation;
  generation.vocab_size = 7;
  try {
    generation.read_generation_config(text, "generation_config.json");
  } catch (const metile::InputError&) {
  }
  generation.eos_token_ids.clear();
  metile::ModelConfig untouched;
  untouched.vocab_size = 7;
  if (!(generation == untouched)) std::abort();
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
