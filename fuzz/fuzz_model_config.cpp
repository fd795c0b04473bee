// libFuzzer harness: config.json text (ModelConfig::parse_json). Any input must parse or throw
// InputError; what parses must be written back by to_json, in the transformers 4 and 5 spellings,
// as text that parses to the same config (outside the try: an error there is a finding). The same
// text read as a generation_config.json (ModelConfig::read_generation_config) must be read or throw
// InputError; an error leaves the tokens it had (the load's fallback keeps config.json's), a read
// gives what a plain reading of "eos_token_id" gives: none for absent or null, else each id, in
// [0, 2^31).
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "metile/model.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const std::vector<std::int64_t> sentinel = {3, 5};
  metile::ModelConfig generation;
  generation.eos_token_ids = sentinel;
  try {
    generation.read_generation_config(text, "generation_config.json");
    const nlohmann::json json = nlohmann::json::parse(text);
    const nlohmann::json* eos = json.contains("eos_token_id") ? &json.at("eos_token_id") : nullptr;
    std::vector<std::int64_t> want;
    if (eos && eos->is_array()) {
      for (const nlohmann::json& id : *eos) want.push_back(id.get<std::int64_t>());
    } else if (eos && !eos->is_null()) {
      want.push_back(eos->get<std::int64_t>());
    }
    for (std::int64_t id : want) {
      if (id < 0 || id > 2147483647) std::abort();
    }
    if (generation.eos_token_ids != want) std::abort();
  } catch (const metile::InputError&) {
    if (generation.eos_token_ids != sentinel) std::abort();
  }
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
