// libFuzzer harness: safetensors files (read_safetensors reads a path, so each input
// is written to a scratch file first). Any input must load or throw InputError; what
// loads must survive write_safetensors and a second read unchanged.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "metile/graph.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::filesystem::path scratch =
      std::filesystem::temp_directory_path() / ("metile_fuzz_" + std::to_string(::getpid()) + ".safetensors");
  std::ofstream(scratch, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data),
                                                                    static_cast<std::streamsize>(size));
  try {
    const metile::TensorMap tensors = metile::read_safetensors(scratch);
    metile::write_safetensors(scratch, tensors);
    if (metile::read_safetensors(scratch) != tensors) std::abort();
  } catch (const metile::InputError&) {
  }
  return 0;
}
