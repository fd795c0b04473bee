// Seeded random inputs for any graph (`metile run` without --inputs, tests,
// numeric gates). What a tensor should hold depends on what reads it: rope
// positions must be valid steps, quantization scales small and positive, so
// each input's role is read from its consumers. The generator is SplitMix64
// (graph.h), so the same seed gives the same bits on every standard library
// (std::uniform_*_distribution is implementation-defined).
#include <algorithm>
#include <cmath>
#include <span>
#include <string_view>

#include <fmt/core.h>

#include "metile/cpu_runtime.h"
#include "metile/io.h"
#include "tensor_access.h"

namespace metile {
namespace {

// The roles of floating-point inputs; integer inputs take their range from every reader (index_limit).
enum class InputRole {
  plain,
  contraction_weight,  // matmul's right operand
  attention_keys,      // flash_attention's k, scaled like the right operand of q @ k^T
  packed_weights,
  quantization_scales,
  quantization_biases,
};

struct InputUse {
  InputRole role = InputRole::plain;
  const Node* consumer = nullptr;  // the node that gave the role
};

InputUse use_of(const ComputeGraph& graph, ValueId input) {
  for (NodeId consumer : graph.consumers(input)) {
    const Node& node = graph.node(consumer);
    for (std::size_t slot = 0; slot < node.inputs.size(); ++slot) {
      if (node.inputs[slot] != input) continue;
      if (node.op == "matmul" && slot == 1) return {InputRole::contraction_weight, &node};
      if (node.op == "flash_attention" && slot == 1) return {InputRole::attention_keys, &node};
      if (node.op == "quantized_matmul" && slot == 1) return {InputRole::packed_weights, &node};
      if (node.op == "quantized_matmul" && slot == 2) return {InputRole::quantization_scales, &node};
      if (node.op == "quantized_matmul" && slot == 3) return {InputRole::quantization_biases, &node};
    }
  }
  return {};
}

// Floating-point inputs, drawn as f32 values (elements first .. first + size)
// and rounded once to the dtype.
void draw_floats(SplitMix64& generator, const ComputeGraph& graph, const Value& value, const InputUse& use,
                 const TensorMap& drawn, std::int64_t first, std::span<float> values) {
  switch (use.role) {
    case InputRole::quantization_scales:
      for (float& element : values) element = generator.uniform(0.005f, 0.02f);
      return;
    case InputRole::quantization_biases: {
      // Centre each group's weights on zero, as a real quantizer's min-based
      // bias does: bias = scale * (u - 1/2 - (2^bits - 1)/2), so
      // w = scale * q + bias spans about [-8, 8) scales at 4 bits.
      const auto scales = drawn.find(graph.value(use.consumer->inputs[2]).name);
      if (scales != drawn.end() && graph.value(use.consumer->inputs[2]).producer < 0) {
        const auto half_range =
            static_cast<float>((1 << use.consumer->attributes.get_int("bits")) - 1) / 2.0f;
        for (std::size_t index = 0; index < values.size(); ++index) {
          const auto scale = static_cast<float>(scales->second.at(first + static_cast<std::int64_t>(index)));
          values[index] = scale * (generator.unit() - 0.5f - half_range);
        }
        return;
      }
      for (float& element : values) element = generator.uniform(-0.05f, 0.05f);
      return;
    }
    case InputRole::attention_keys:
    case InputRole::contraction_weight: {
      // Uniform in [-1, 1) / sqrt(K), the usual initialisation, so that
      // products keep the magnitude of their inputs through deep graphs.
      const bool transpose_right =
          use.role == InputRole::attention_keys || use.consumer->attributes.get_int("transpose_right") != 0;
      const std::vector<std::int64_t>& shape = value.spec.shape;
      const std::int64_t depth = transpose_right ? shape.back() : shape[shape.size() - 2];
      const float factor = 1.0f / std::sqrt(static_cast<float>(depth));
      for (float& element : values) element = generator.uniform(-1.0f, 1.0f) * factor;
      return;
    }
    default:
      for (float& element : values) element = generator.uniform(-1.0f, 1.0f);
      return;
  }
}

// How many values an index input may take, [0, limit), as one consumer reads it at `slot`; 0 where it
// reads no index there.
std::int64_t index_limit(const ComputeGraph& graph, const Node& node, std::size_t slot, const Value& value) {
  const auto spec = [&](std::size_t input) -> const TensorSpec& { return graph.value(node.inputs[input]).spec; };
  // Rope's positions: any step works; [0, S) keeps them near the tokens' own.
  if (node.op == "rope" && slot == 1) return value.spec.shape.front();
  // A cache write's positions are rows of the cache [H, T, D] too.
  if (node.op == "kv_cache_write" && slot == 2) return std::min(value.spec.shape.front(), spec(0).shape[1]);
  if ((node.op == "embedding" || node.op == "quantized_embedding") && slot == 0) return spec(1).shape.front();
  // T: the last axis of the masked scores x [..., R, T], or the key axis of flash_attention's k [..., T, D].
  if (node.op == "position_mask" && slot == 1) return std::max<std::int64_t>(spec(0).shape.back(), 1);
  if (node.op == "flash_attention" && slot == 3) return std::max<std::int64_t>(spec(1).shape[spec(1).rank() - 2], 1);
  return 0;
}

// Layout ops that move an integer tensor's values without changing them: an index reaches its reader
// through them (ids reshaped before an embedding are still token ids).
bool passes_values_on(const Node& node) { return node.op == "reshape" || node.op == "transpose" || node.op == "cast"; }

// The range of an index input: every reader's, not the first one's (positions that feed rope and a
// cache write of fewer rows than tokens, or ids that index two tables, must be valid for each reader),
// also where it reaches the reader through reshapes, transposes and casts (drawn over the dtype there,
// ids reshaped before an embedding were refused by it); 0 where nothing reads it as an index.
std::int64_t input_index_limit(const ComputeGraph& graph, ValueId input) {
  std::int64_t limit = 0;
  std::vector<ValueId> pending = {input};  // a worklist, not recursion: a chain of reshapes may be long
  std::vector<bool> seen(graph.values().size(), false);
  while (!pending.empty()) {
    const ValueId id = pending.back();
    pending.pop_back();
    if (seen[static_cast<std::size_t>(id)]) continue;
    seen[static_cast<std::size_t>(id)] = true;
    for (NodeId consumer : graph.consumers(id)) {
      const Node& node = graph.node(consumer);
      if (passes_values_on(node)) {
        pending.insert(pending.end(), node.outputs.begin(), node.outputs.end());
        continue;
      }
      for (std::size_t slot = 0; slot < node.inputs.size(); ++slot) {
        if (node.inputs[slot] != id) continue;
        const std::int64_t reader = index_limit(graph, node, slot, graph.value(id));
        if (reader > 0) limit = limit == 0 ? reader : std::min(limit, reader);
      }
    }
  }
  return limit;
}

// One element of an integer input: in [0, limit) where it is an index (input_index_limit), else over the dtype.
std::int64_t draw_integer(SplitMix64& generator, const Value& value, std::int64_t limit) {
  if (limit > 0) return generator.integer(0, limit - 1);
  switch (value.spec.dtype) {
    case DType::i8:
      return generator.integer(-128, 127);
    case DType::u8:
      return generator.integer(0, 255);
    case DType::i32:
      return generator.integer(-1000, 1000);
    default:
      return static_cast<std::uint32_t>(generator.next());  // u32, packed weights included
  }
}

}  // namespace

TensorMap random_inputs(const ComputeGraph& graph, std::uint64_t seed) {
  // The inputs must fit the machine before any is allocated (Python reached std::bad_alloc, raised
  // as "MemoryError std::bad_alloc", for a [2^24, 2^24] input that run() refuses by name).
  const std::uint64_t available = physical_memory_bytes();
  std::uint64_t bytes = 0;  // stops at the first excess, so it cannot wrap
  for (ValueId id : graph.inputs()) {
    bytes += static_cast<std::uint64_t>(graph.value(id).spec.bytes());
    if (bytes > available) {
      throw InputError(fmt::format("random inputs: the graph's inputs need more than this machine's {} bytes of memory "
                                   "(input '{}' brings them to {} bytes)",
                                   available, graph.value(id).name, bytes));
    }
  }
  TensorMap inputs;
  // Biases are drawn last: they are centred using the scales beside them.
  std::vector<ValueId> order;
  for (ValueId id : graph.inputs()) {
    if (use_of(graph, id).role != InputRole::quantization_biases) order.push_back(id);
  }
  for (ValueId id : graph.inputs()) {
    if (use_of(graph, id).role == InputRole::quantization_biases) order.push_back(id);
  }
  for (ValueId id : order) {
    const Value& value = graph.value(id);
    SplitMix64 generator(seed ^ fnv1a_64(value.name));
    generator.next();  // decorrelate seeds that differ in few bits
    const InputUse use = use_of(graph, id);
    HostTensor tensor(value.spec);
    if (is_floating(value.spec.dtype)) {
      std::vector<float> chunk(
          std::min<std::size_t>(65536, static_cast<std::size_t>(tensor.element_count())));
      for (std::int64_t first = 0; first < tensor.element_count();
           first += static_cast<std::int64_t>(chunk.size())) {
        const std::span<float> part(
            chunk.data(), static_cast<std::size_t>(std::min<std::int64_t>(
                              static_cast<std::int64_t>(chunk.size()), tensor.element_count() - first)));
        draw_floats(generator, graph, value, use, inputs, first, part);
        cpu::write_floats(tensor, first, part);
      }
    } else {
      const std::int64_t limit = input_index_limit(graph, id);
      for (std::int64_t index = 0; index < tensor.element_count(); ++index) {
        tensor.store(index, static_cast<double>(draw_integer(generator, value, limit)));
      }
    }
    inputs.insert_or_assign(value.name, std::move(tensor));
  }
  return inputs;
}

}  // namespace metile
