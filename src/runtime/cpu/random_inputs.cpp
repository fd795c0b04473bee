// Seeded random inputs for any graph (`metile run` without --inputs, tests,
// numeric gates). What a tensor should hold depends on what reads it: rope
// positions must be valid steps, quantization scales small and positive, so
// each input's role is read from its consumers. The generator is SplitMix64,
// written out here so the same seed gives the same bits on every standard
// library (std::uniform_*_distribution is implementation-defined).
#include <string_view>

#include "metile/cpu_runtime.h"

namespace metile {
namespace {

class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform(double low, double high) {  // [low, high)
    return low + (high - low) * (static_cast<double>(next() >> 11) * 0x1.0p-53);
  }
  std::int64_t integer(std::int64_t low, std::int64_t high) {  // [low, high], small ranges
    return low + static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(high - low + 1));
  }

 private:
  std::uint64_t state_;
};

std::uint64_t fnv1a(std::string_view text) {
  std::uint64_t hash = 0xcbf29ce484222325ull;
  for (char character : text) {
    hash ^= static_cast<unsigned char>(character);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

enum class InputRole { plain, rope_positions, packed_weights, quantization_scales, quantization_biases };

InputRole role_of(const ComputeGraph& graph, ValueId input) {
  for (NodeId consumer : graph.consumers(input)) {
    const Node& node = graph.node(consumer);
    for (std::size_t slot = 0; slot < node.inputs.size(); ++slot) {
      if (node.inputs[slot] != input) continue;
      if (node.op == "rope" && slot == 1) return InputRole::rope_positions;
      if (node.op == "quantized_matmul" && slot == 1) return InputRole::packed_weights;
      if (node.op == "quantized_matmul" && slot == 2) return InputRole::quantization_scales;
      if (node.op == "quantized_matmul" && slot == 3) return InputRole::quantization_biases;
    }
  }
  return InputRole::plain;
}

double draw(SplitMix64& generator, InputRole role, const TensorSpec& spec) {
  switch (role) {
    case InputRole::rope_positions: return static_cast<double>(generator.integer(0, spec.shape.front() - 1));
    case InputRole::packed_weights: return static_cast<double>(static_cast<std::uint32_t>(generator.next()));
    case InputRole::quantization_scales: return generator.uniform(0.005, 0.02);
    case InputRole::quantization_biases: return generator.uniform(-0.05, 0.05);
    case InputRole::plain: break;
  }
  switch (spec.dtype) {
    case DType::f16:
    case DType::bf16:
    case DType::f32: return generator.uniform(-1.0, 1.0);
    case DType::i8: return static_cast<double>(generator.integer(-128, 127));
    case DType::u8: return static_cast<double>(generator.integer(0, 255));
    case DType::i32: return static_cast<double>(generator.integer(-1000, 1000));
    case DType::u32: return static_cast<double>(static_cast<std::uint32_t>(generator.next()));
  }
  return 0;
}

}  // namespace

TensorMap random_inputs(const ComputeGraph& graph, std::uint64_t seed) {
  TensorMap inputs;
  for (ValueId id : graph.inputs()) {
    const Value& value = graph.value(id);
    SplitMix64 generator(seed ^ fnv1a(value.name));
    generator.next();  // decorrelate seeds that differ in few bits
    const InputRole role = role_of(graph, id);
    HostTensor tensor(value.spec);
    for (std::int64_t index = 0; index < tensor.element_count(); ++index) {
      tensor.store(index, draw(generator, role, value.spec));
    }
    inputs.insert_or_assign(value.name, std::move(tensor));
  }
  return inputs;
}

}  // namespace metile
