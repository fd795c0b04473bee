// Helpers shared by the files of src/model (not part of the public header).
#pragma once

#include <cstdint>
#include <string>

#include "metile/model.h"

namespace metile {

// "model.layers.N." : the Hugging Face name prefix of decoder layer N.
std::string layer_prefix(std::int64_t layer);
// A mapped tensor in another float dtype (exact widening, round-to-nearest-even narrowing).
HostTensor convert_tensor(const MappedSafetensors::TensorView& view, DType dtype);

}  // namespace metile
