// libFuzzer harness: a checkpoint's shard index (model.safetensors.index.json, read by
// DecoderModel::load). Once per process a tiny synthetic checkpoint in five shards is written to a
// scratch directory and loaded through its own index; each input then takes the index's place. Any
// input must load or throw InputError; what loads must hold the very weights the original index gave
// (the loader checks that every listed tensor is in its shard, that no tensor is in two shards and
// that every tensor the config needs is listed, so no index can load other numbers).
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "metile/model.h"

namespace {

struct Checkpoint {
  std::filesystem::path directory;
  metile::TensorMap weights;  // loaded through the index synthesize_model wrote

  Checkpoint() {
    directory = std::filesystem::temp_directory_path() / ("metile_fuzz_shards_" + std::to_string(::getpid()));
    std::filesystem::remove_all(directory);
    metile::SynthOptions options;  // tiny: 2 layers, hidden 64, vocabulary 256, ~210 KB of bf16
    options.max_shard_mb = 0.05;   // five shards
    metile::synthesize_model(directory, options);
    weights = metile::DecoderModel::load(directory, load_options()).weights();
  }
  ~Checkpoint() { std::filesystem::remove_all(directory); }

  static metile::LoadOptions load_options() {
    metile::LoadOptions options;
    options.warn = [](const std::string&) {};  // an index may list tensors the model does not use
    return options;
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const Checkpoint checkpoint;
  std::ofstream(checkpoint.directory / "model.safetensors.index.json", std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  try {
    const metile::DecoderModel model = metile::DecoderModel::load(checkpoint.directory, Checkpoint::load_options());
    if (model.weights() != checkpoint.weights) std::abort();
  } catch (const metile::InputError&) {
  }
  return 0;
}
