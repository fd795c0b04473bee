// libFuzzer harness: a checkpoint's shard index (model.safetensors.index.json, read by
// DecoderModel::load). Once per process a tiny synthetic checkpoint in five shards is written to a
// fresh directory (mkdtemp), with a sixth file the synthesizer did not write: decoy.safetensors,
// holding lm_head.weight (the fifth shard's one tensor) with every value negated, and a tensor the
// model has no use for. Each input takes the index's place. Any input must load or throw
// InputError; what loads is checked against an independent reading: every weight the model holds
// must be the tensor of that name in the file the index names for it (read_safetensors of that
// file), so an index that sends lm_head.weight to the decoy must load the decoy's values, and one
// that lists both files for it is refused (a tensor in two listed shards). Every 1000 inputs the
// original index must still load the synthesized weights, so a directory that vanished under the
// run (a /tmp cleaner) stops it rather than turning every input into an InputError.
#include <stdlib.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "metile/model.h"

namespace {

using Json = nlohmann::json;

metile::LoadOptions quiet() {
  metile::LoadOptions options;
  options.warn = {};  // an index may list tensors the model does not use
  return options;
}

struct Checkpoint {
  std::filesystem::path directory;
  std::string index;          // the index synthesize_model wrote
  metile::TensorMap weights;  // loaded through it

  Checkpoint() {
    std::string pattern = (std::filesystem::temp_directory_path() / "metile_fuzz_shards_XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) std::abort();
    directory = std::filesystem::path(pattern) / "model";
    metile::SynthOptions options;  // tiny: 2 layers, hidden 64, vocabulary 256, ~210 KB of bf16
    options.max_shard_mb = 0.05;   // five shards
    metile::synthesize_model(directory, options);
    std::ostringstream text;
    text << std::ifstream(directory / "model.safetensors.index.json").rdbuf();
    index = text.str();
    weights = metile::DecoderModel::load(directory, quiet()).weights();
    metile::TensorMap decoy;
    metile::HostTensor negated = weights.at("lm_head.weight");
    auto* bits = reinterpret_cast<std::uint16_t*>(negated.bytes().data());  // bf16: flip each sign bit
    for (std::int64_t element = 0; element < negated.element_count(); ++element) bits[element] ^= 0x8000;
    decoy.emplace("lm_head.weight", std::move(negated));
    decoy.emplace("model.unused.weight", weights.at("model.norm.weight"));
    metile::write_safetensors(directory / "decoy.safetensors", decoy);
  }
  ~Checkpoint() { std::filesystem::remove_all(directory.parent_path()); }

  void write_index(const std::uint8_t* data, std::size_t size) const {
    std::ofstream(directory / "model.safetensors.index.json", std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const Checkpoint checkpoint;
  static std::uint64_t inputs = 0;
  if (inputs++ % 1000 == 0) {
    checkpoint.write_index(reinterpret_cast<const std::uint8_t*>(checkpoint.index.data()), checkpoint.index.size());
    if (metile::DecoderModel::load(checkpoint.directory, quiet()).weights() != checkpoint.weights) std::abort();
  }
  checkpoint.write_index(data, size);
  metile::TensorMap loaded;
  try {
    loaded = metile::DecoderModel::load(checkpoint.directory, quiet()).weights();
  } catch (const metile::InputError&) {
    return 0;
  }
  // It loaded, so the input is a JSON object whose weight_map names a file for every weight.
  const Json weight_map = Json::parse(std::string(reinterpret_cast<const char*>(data), size))["weight_map"];
  if (loaded.size() != checkpoint.weights.size()) std::abort();
  for (const auto& [name, tensor] : loaded) {
    const std::string file = weight_map.at(name).get<std::string>();
    if (metile::read_safetensors(checkpoint.directory / file).at(name) != tensor) std::abort();
  }
  return 0;
}
