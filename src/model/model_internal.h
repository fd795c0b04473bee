// Helpers shared by the files of src/model (not part of the public header).
#pragma once

#include <cstdint>
#include <string>

#include "metile/model.h"

namespace metile {

// "model.layers.N." : the Hugging Face name prefix of decoder layer N.
std::string layer_prefix(std::int64_t layer);
// The bytes of a session's K and V caches: every layer's two [KV heads, capacity, head_dim]
// tensors in `dtype` (in double: the checks that compare it with the machine's memory run before
// any product is known to fit an int64).
double kv_cache_bytes(const ModelConfig& config, std::int64_t capacity, DType dtype);
// A mapped tensor in another float dtype (exact widening, round-to-nearest-even narrowing).
HostTensor convert_tensor(const MappedSafetensors::TensorView& view, DType dtype);

}  // namespace metile
