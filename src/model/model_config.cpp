// config.json of a Hugging Face decoder checkpoint, in both spellings:
//   transformers 4: "rope_theta" and "rope_scaling" {"rope_type"|"type", ...} at the top
//                   level, "torch_dtype";
//   transformers 5: "rope_parameters" {"rope_type", "rope_theta", ...}, "dtype".
// MLX-community checkpoints add "quantization": {"group_size", "bits"}.
// Every malformed or unsupported field is an InputError "SOURCE: field 'F': why".
#include <cmath>
#include <limits>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "json_input.h"
#include "metile/graph.h"
#include "metile/model.h"

namespace metile {
namespace {

using Json = nlohmann::json;

struct FieldReader {
  const Json& object;
  std::string source;
  std::string prefix;  // "rope_parameters." for nested fields

  [[noreturn]] void fail(std::string_view field, const std::string& why) const {
    throw InputError(fmt::format("{}: field '{}{}': {}", source, prefix, field, why));
  }
  bool present(std::string_view field) const {
    const auto found = object.find(field);
    return found != object.end() && !found->is_null();
  }
  // A positive integer no larger than `limit`, so that narrowing it cannot wrap (2^32 + 4 bits is not
  // 4). A JSON integer past int64 (2^63 and up, which nlohmann keeps unsigned) is past every limit:
  // read as an int64 it wrapped negative, and the message called 2^63 not positive.
  std::int64_t positive_int_at_most(std::string_view field, std::int64_t limit) const {
    if (!present(field)) fail(field, "missing");
    const Json& value = object.at(field);
    const bool past_int64 = value.is_number_unsigned() &&
                            value.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
    if (!value.is_number_integer() || (!past_int64 && value.get<std::int64_t>() <= 0)) {
      fail(field, "must be a positive integer, got " + json_excerpt(value));
    }
    if (past_int64 || value.get<std::int64_t>() > limit) fail(field, fmt::format("must be at most {}, got {}", limit, json_excerpt(value)));
    return value.get<std::int64_t>();
  }
  std::int64_t positive_int(std::string_view field) const {
    return positive_int_at_most(field, std::numeric_limits<std::int64_t>::max());
  }
  // A count written as a number, 8192 or 8192.0: positive, whole and below 2^53 (a double holds it exactly).
  std::int64_t positive_whole_number(std::string_view field) const {
    const double value = positive_number(field);
    if (value != std::floor(value)) fail(field, "must be a positive whole number, got " + json_excerpt(object.at(field)));
    if (value >= 9007199254740992.0) fail(field, "must be below 2^53, got " + json_excerpt(object.at(field)));
    return static_cast<std::int64_t>(value);
  }
  std::int64_t positive_int_or(std::string_view field, std::int64_t fallback) const {
    return present(field) ? positive_int(field) : fallback;
  }
  // A model dimension (sizes, counts of layers and heads): 1..kLargestModelDimension, so that the
  // product of any two (a weight's width, heads x head_dim) fits an int64 with room to spare.
  std::int64_t dimension(std::string_view field) const { return positive_int_at_most(field, kLargestModelDimension); }
  std::int64_t dimension_or(std::string_view field, std::int64_t fallback) const {
    return present(field) ? dimension(field) : fallback;
  }
  double positive_number(std::string_view field) const {
    if (!present(field)) fail(field, "missing");
    const Json& value = object.at(field);
    if (!value.is_number() || !std::isfinite(value.get<double>()) || value.get<double>() <= 0) {
      fail(field, "must be a positive number, got " + json_excerpt(value));
    }
    return value.get<double>();
  }
  double positive_number_or(std::string_view field, double fallback) const {
    return present(field) ? positive_number(field) : fallback;
  }
  bool boolean_or(std::string_view field, bool fallback) const {
    if (!present(field)) return fallback;
    if (!object.at(field).is_boolean()) fail(field, "must be true or false, got " + json_excerpt(object.at(field)));
    return object.at(field).get<bool>();
  }
  std::string string(std::string_view field) const {
    if (!present(field)) fail(field, "missing");
    if (!object.at(field).is_string()) fail(field, "must be a string, got " + json_excerpt(object.at(field)));
    return object.at(field).get<std::string>();
  }
};

std::string_view torch_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f16: return "float16";
    case DType::f32: return "float32";
    default: return "bfloat16";
  }
}

DType parse_torch_dtype(const FieldReader& reader, std::string_view field) {
  const std::string name = reader.string(field);
  for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    if (torch_dtype_name(dtype) == name) return dtype;
  }
  reader.fail(field, "'" + name + "' is not one of bfloat16, float16, float32");
}

// partial_rotary_factor (top level in transformers 4, in rope_parameters in 5): rotating only the first
// part of each head changes the model, and the step graphs rotate all of it, so anything but 1 is refused.
void require_full_rotary(const FieldReader& reader) {
  if (reader.present("partial_rotary_factor") && reader.positive_number("partial_rotary_factor") != 1.0) {
    reader.fail("partial_rotary_factor", "only 1 is supported (rotary embeddings over the whole head), got " +
                                             json_excerpt(reader.object.at("partial_rotary_factor")));
  }
}

// rope_scaling (4) or rope_parameters (5): {"rope_type": "default" | "llama3", ...}. An absent
// original_max_position_embeddings is what transformers 5 puts there (standardize_rope_params):
// max_position_embeddings (transformers 4 requires it). A top-level one is read by neither for these
// architectures (5 takes it only where the config class has the field, as Phi-3's does).
void read_rope_type(const FieldReader& reader, RopeParameters& rope, std::int64_t max_position_embeddings) {
  require_full_rotary(reader);
  // "type" is the older spelling. transformers 4's configs copy "type" over "rope_type" when both are
  // given, later code reads rope_type first: two that disagree are refused. An error names the one given.
  if (reader.present("rope_type") && reader.present("type") && reader.string("rope_type") != reader.string("type")) {
    reader.fail("type", "'" + reader.string("type") + "' disagrees with rope_type '" + reader.string("rope_type") +
                            "' (give one of them)");
  }
  const std::string_view field = !reader.present("rope_type") && reader.present("type") ? "type" : "rope_type";
  const std::string type = reader.present(field) ? reader.string(field) : "default";
  if (type == "default") return;
  if (type != "llama3") reader.fail(field, "'" + type + "' is not supported (default or llama3)");
  rope.llama3_scaling = true;
  rope.factor = reader.positive_number("factor");
  rope.low_freq_factor = reader.positive_number("low_freq_factor");
  rope.high_freq_factor = reader.positive_number("high_freq_factor");
  rope.original_max_position_embeddings = reader.present("original_max_position_embeddings")
                                              ? reader.positive_whole_number("original_max_position_embeddings")
                                              : max_position_embeddings;
  if (!(rope.high_freq_factor > rope.low_freq_factor)) {
    reader.fail("high_freq_factor", "must exceed low_freq_factor");
  }
}

// eos_token_id (config.json or generation_config.json): one token id, or a list of them (Llama 3.1's
// instruct checkpoints list three); null or an empty list: none. Ids are token ids of metile's 32-bit
// step graphs: non-negative and below 2^31 (one at or past the vocabulary is never generated, as in
// transformers, which checks neither).
std::vector<std::int64_t> read_eos_token_ids(const FieldReader& reader) {
  const std::string_view field = "eos_token_id";
  if (!reader.present(field)) return {};
  const Json& value = reader.object.at(field);
  constexpr std::string_view kRule = "must be a token id (0 to 2^31 - 1) or a list of them";
  const auto is_token_id = [](const Json& id) {
    return id.is_number_integer() && id.get<std::int64_t>() >= 0 &&
           id.get<std::int64_t>() <= std::numeric_limits<std::int32_t>::max();
  };
  if (!value.is_array()) {
    if (!is_token_id(value)) reader.fail(field, fmt::format("{}, got {}", kRule, json_excerpt(value)));
    return {value.get<std::int64_t>()};
  }
  std::vector<std::int64_t> ids;
  for (const Json& id : value) {
    if (!is_token_id(id)) {  // named by its place: a long list's excerpt may not reach it
      reader.fail(field, fmt::format("{}, got {} at index {}", kRule, json_excerpt(id), ids.size()));
    }
    ids.push_back(id.get<std::int64_t>());
  }
  return ids;
}

}  // namespace

std::string_view architecture_class_name(ModelArchitecture architecture) {
  switch (architecture) {
    case ModelArchitecture::llama: return "LlamaForCausalLM";
    case ModelArchitecture::qwen2: return "Qwen2ForCausalLM";
    case ModelArchitecture::mistral: return "MistralForCausalLM";
  }
  return "?";
}

std::string_view model_type_name(ModelArchitecture architecture) {
  switch (architecture) {
    case ModelArchitecture::llama: return "llama";
    case ModelArchitecture::qwen2: return "qwen2";
    case ModelArchitecture::mistral: return "mistral";
  }
  return "?";
}

ModelArchitecture parse_architecture_short_name(std::string_view name) {
  for (ModelArchitecture architecture :
       {ModelArchitecture::llama, ModelArchitecture::qwen2, ModelArchitecture::mistral}) {
    if (model_type_name(architecture) == name) return architecture;
  }
  throw InputError(fmt::format("unknown architecture '{}' (llama, qwen2 or mistral)", name));
}

ModelConfig ModelConfig::parse_json(std::string_view text, std::string_view source) {
  const Json json = parse_json_input(text, source);  // the nesting limit of every JSON metile reads
  if (!json.is_object()) throw InputError(fmt::format("{}: not a JSON object", source));
  const FieldReader reader{json, std::string(source), ""};
  ModelConfig config;

  if (reader.present("architectures")) {
    const Json& list = json.at("architectures");
    if (!list.is_array() || list.size() != 1 || !list[0].is_string()) {
      reader.fail("architectures", "must be a list of one class name, got " + json_excerpt(list));
    }
    const std::string name = list[0].get<std::string>();
    bool known = false;
    for (ModelArchitecture architecture :
         {ModelArchitecture::llama, ModelArchitecture::qwen2, ModelArchitecture::mistral}) {
      if (architecture_class_name(architecture) == name) {
        config.architecture = architecture;
        known = true;
      }
    }
    if (!known) {
      reader.fail("architectures",
                  "'" + name + "' is not supported (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)");
    }
    // transformers' Auto classes and mlx-lm build the model model_type names: one that names
    // another architecture would make them and this loader compute different models.
    if (reader.present("model_type") && reader.string("model_type") != model_type_name(config.architecture)) {
      reader.fail("model_type", fmt::format("'{}' contradicts architectures '{}' (model_type '{}')",
                                            reader.string("model_type"), name, model_type_name(config.architecture)));
    }
  } else {
    const std::string model_type = reader.string("model_type");
    try {
      config.architecture = parse_architecture_short_name(model_type);
    } catch (const InputError& error) {
      reader.fail("model_type", error.what());
    }
  }

  config.vocab_size = reader.dimension("vocab_size");
  config.hidden_size = reader.dimension("hidden_size");
  config.intermediate_size = reader.dimension("intermediate_size");
  config.num_hidden_layers = reader.dimension("num_hidden_layers");
  config.num_attention_heads = reader.dimension("num_attention_heads");
  // Absent, transformers' default for the architecture: LlamaConfig num_attention_heads, Qwen2Config 32,
  // MistralConfig 8 (a Mistral config without it was taken as one KV head a query head); an explicit
  // null is num_attention_heads in all three.
  const bool kv_heads_absent = !json.contains("num_key_value_heads");
  std::int64_t default_kv_heads = config.num_attention_heads;
  if (kv_heads_absent && config.architecture == ModelArchitecture::qwen2) default_kv_heads = 32;
  if (kv_heads_absent && config.architecture == ModelArchitecture::mistral) default_kv_heads = 8;
  config.num_key_value_heads = reader.dimension_or("num_key_value_heads", default_kv_heads);
  if (config.num_attention_heads % config.num_key_value_heads != 0) {
    reader.fail("num_key_value_heads",
                fmt::format("{}{} does not divide num_attention_heads {}", config.num_key_value_heads,
                            kv_heads_absent ? fmt::format(" (absent: transformers' default for {})", model_type_name(config.architecture))
                                            : std::string(),
                            config.num_attention_heads));
  }
  if (reader.present("head_dim")) {
    config.head_dim = reader.dimension("head_dim");
  } else {
    if (config.hidden_size % config.num_attention_heads != 0) {
      reader.fail("hidden_size", "is not a multiple of num_attention_heads and no head_dim is given");
    }
    config.head_dim = config.hidden_size / config.num_attention_heads;
  }
  if (config.head_dim % 2 != 0) reader.fail("head_dim", "must be even for rotary embeddings");
  // A count transformers also reads when written as a real (4096.0), as original_max_position_embeddings.
  // Absent, transformers' default for the architecture: LlamaConfig 2048, Qwen2Config 32768,
  // MistralConfig 4096 * 32 (a Llama config without it was taken as 4096).
  const std::int64_t default_positions = config.architecture == ModelArchitecture::llama   ? 2048
                                         : config.architecture == ModelArchitecture::qwen2 ? 32768
                                                                                           : 4096 * 32;
  config.max_position_embeddings = reader.present("max_position_embeddings")
                                       ? reader.positive_whole_number("max_position_embeddings")
                                       : default_positions;
  config.rms_norm_eps = reader.positive_number_or("rms_norm_eps", 1e-6);
  // Every rms_norm of the step graphs takes it: refused here, naming the field, not at the first step
  // naming graph node 'layers.0.input_norm'.
  try {
    check_norm_eps(config.rms_norm_eps);
  } catch (const InputError& error) {
    reader.fail("rms_norm_eps", error.what());
  }
  config.tie_word_embeddings = reader.boolean_or("tie_word_embeddings", false);
  // Absent: none, as transformers 5's generate reads config.json where no generation_config.json is
  // (4's took the config class's default: 2 for Llama and Mistral, none for Qwen2).
  config.eos_token_ids = read_eos_token_ids(reader);
  if (reader.present("hidden_act") && reader.string("hidden_act") != "silu") {
    reader.fail("hidden_act", "'" + reader.string("hidden_act") + "' is not supported (silu)");
  }
  if (reader.boolean_or("attention_bias", false) && config.architecture != ModelArchitecture::qwen2) {
    reader.fail("attention_bias", "true is not supported");
  }
  if (reader.boolean_or("mlp_bias", false)) reader.fail("mlp_bias", "true is not supported");
  // The sliding window, with transformers' defaults where config.json leaves a field out: MistralConfig
  // and Qwen2Config take a window of 4096 (an explicit null is none), and Qwen2 puts it only on layers
  // max_window_layers (default 28) and up. Within the window windowed and full attention agree, so a
  // window bounds the capacity instead (attention over a sliding window is not implemented; load_model).
  // use_sliding_window is Qwen2Config's (LlamaConfig has no window: one there is not read).
  bool sliding = config.architecture == ModelArchitecture::mistral ||
                 (config.architecture == ModelArchitecture::qwen2 && reader.boolean_or("use_sliding_window", false));
  if (config.architecture == ModelArchitecture::qwen2 && reader.present("layer_types")) {
    // Qwen2Config (transformers >= 4.53) takes an explicit layer_types as given, max_window_layers aside;
    // a "sliding_attention" layer slides only when use_sliding_window is true (else its window is None).
    const Json& types = json.at("layer_types");
    if (!types.is_array() || static_cast<std::int64_t>(types.size()) != config.num_hidden_layers) {
      reader.fail("layer_types", fmt::format("must be a list of {} layer types (num_hidden_layers), got {}",
                                             config.num_hidden_layers, json_excerpt(types)));
    }
    bool any_sliding = false;
    for (const Json& type : types) {
      if (type != "full_attention" && type != "sliding_attention") {
        reader.fail("layer_types", "each must be \"full_attention\" or \"sliding_attention\", got " + json_excerpt(type));
      }
      any_sliding = any_sliding || type == "sliding_attention";
    }
    sliding = sliding && any_sliding;
  } else if (sliding && config.architecture == ModelArchitecture::qwen2) {
    std::int64_t max_window_layers = 28;
    if (reader.present("max_window_layers")) {
      const Json& value = json.at("max_window_layers");
      if (!value.is_number_integer() || (!value.is_number_unsigned() && value.get<std::int64_t>() < 0)) {
        reader.fail("max_window_layers", "must be a non-negative integer, got " + json_excerpt(value));
      }
      // Past int64 (2^63 and up, unsigned to nlohmann) it is past every layer, as in transformers.
      max_window_layers = value.is_number_unsigned()
                              ? static_cast<std::int64_t>(std::min<std::uint64_t>(value.get<std::uint64_t>(),
                                                                                  std::numeric_limits<std::int64_t>::max()))
                              : value.get<std::int64_t>();
    }
    if (max_window_layers >= config.num_hidden_layers) sliding = false;  // no layer slides
  }
  if (sliding && !json.contains("sliding_window")) {
    config.sliding_window = 4096;
  } else if (sliding && reader.present("sliding_window")) {
    config.sliding_window = reader.positive_whole_number("sliding_window");  // 4096.0 too, as the other counts
  }

  if (reader.present("torch_dtype")) {
    config.dtype = parse_torch_dtype(reader, "torch_dtype");
  } else if (reader.present("dtype")) {
    config.dtype = parse_torch_dtype(reader, "dtype");
  }

  require_full_rotary(reader);
  if (reader.present("rope_parameters")) {  // transformers 5
    const Json& parameters = json.at("rope_parameters");
    if (!parameters.is_object()) reader.fail("rope_parameters", "must be an object");
    const FieldReader nested{parameters, reader.source, "rope_parameters."};
    config.rope.theta = nested.positive_number_or("rope_theta", reader.positive_number_or("rope_theta", 10000));
    // A top-level rope_theta beside it is what transformers 4 reads (it knows no rope_parameters), 5 the
    // nested one: two models, unless they agree.
    if (nested.present("rope_theta") && reader.present("rope_theta") &&
        reader.positive_number("rope_theta") != config.rope.theta) {
      reader.fail("rope_theta", "contradicts rope_parameters.rope_theta (give one of the two)");
    }
    read_rope_type(nested, config.rope, config.max_position_embeddings);
    if (reader.present("rope_scaling")) {
      // Both spellings: the scaling rope_parameters gives was kept and a different rope_scaling (a
      // yarn one, say) ignored without a word; they must say the same.
      const Json& scaling = json.at("rope_scaling");
      if (!scaling.is_object()) reader.fail("rope_scaling", "must be an object or null");
      // Read over a copy: a default type leaves the copy's llama3 fields as they were, so only the
      // scaling itself can make the two differ.
      RopeParameters other = config.rope;
      other.llama3_scaling = false;
      read_rope_type(FieldReader{scaling, reader.source, "rope_scaling."}, other, config.max_position_embeddings);
      if (other != config.rope) reader.fail("rope_scaling", "contradicts rope_parameters (give one of the two)");
    }
  } else {  // transformers 4
    config.rope.theta = reader.positive_number_or("rope_theta", 10000);
    if (reader.present("rope_scaling")) {
      const Json& scaling = json.at("rope_scaling");
      if (!scaling.is_object()) reader.fail("rope_scaling", "must be an object or null");
      read_rope_type(FieldReader{scaling, reader.source, "rope_scaling."}, config.rope, config.max_position_embeddings);
    }
  }

  // Every rope node of the step graphs checks its frequencies: refused here, naming the field, not at the
  // first step naming graph node 'layers.0.q.rope' (and a model loaded from Python failed only at logits()).
  {
    const bool nested = reader.present("rope_parameters");
    const std::string theta_field =
        nested && FieldReader{json.at("rope_parameters"), reader.source, "rope_parameters."}.present("rope_theta")
            ? "rope_parameters.rope_theta"
            : "rope_theta";
    try {
      check_rope_frequencies(config.rope.theta, config.head_dim, 1.0);
    } catch (const InputError& error) {
      reader.fail(theta_field, error.what());
    }
    try {
      if (config.rope.llama3_scaling) check_rope_frequencies(config.rope.theta, config.head_dim, config.rope.factor);
    } catch (const InputError& error) {
      reader.fail(nested ? "rope_parameters.factor" : "rope_scaling.factor", error.what());
    }
  }

  if (reader.present("quantization")) {
    const Json& quantization = json.at("quantization");
    if (!quantization.is_object()) reader.fail("quantization", "must be an object");
    const FieldReader nested{quantization, reader.source, "quantization."};
    for (const auto& [key, value] : quantization.items()) {
      if (key != "group_size" && key != "bits" && key != "mode") {
        nested.fail(key, "per-layer quantization settings are not supported");
      }
    }
    if (nested.present("mode") && nested.string("mode") != "affine") {
      nested.fail("mode", "'" + nested.string("mode") + "' is not supported (affine)");
    }
    AffineQuantization format{static_cast<int>(nested.positive_int_at_most("bits", 64)),
                              static_cast<int>(nested.positive_int_at_most("group_size", std::int64_t{1} << 20))};
    try {
      format.validate();
    } catch (const InputError& error) {
      reader.fail("quantization", error.what());
    }
    config.quantization = format;
  }
  // transformers' own quantized checkpoints (GPTQ, AWQ, bitsandbytes, FP8, ...) name their method in
  // quantization_config.quant_method (mlx-lm copies its 'quantization' there, without one). Their
  // tensors (qweight, qzeros, scales) were taken for an MLX layer: "the checkpoint is quantized but
  // config.json has no 'quantization'", which the config then seemed to have.
  if (reader.present("quantization_config") && json.at("quantization_config").is_object()) {
    const FieldReader nested{json.at("quantization_config"), reader.source, "quantization_config."};
    if (nested.present("quant_method")) {
      nested.fail("quant_method", json_excerpt(nested.object.at("quant_method")) +
                                      " checkpoints are not supported (dense, or MLX's affine 'quantization')");
    }
  }
  return config;
}

void ModelConfig::read_generation_config(std::string_view text, std::string_view source) {
  const Json json = parse_json_input(text, source);
  if (!json.is_object()) throw InputError(fmt::format("{}: not a JSON object", source));
  eos_token_ids = read_eos_token_ids(FieldReader{json, std::string(source), ""});
}

std::string ModelConfig::to_json(int transformers_version) const {
  Json json = Json::object();
  json["architectures"] = {std::string(architecture_class_name(architecture))};
  json["model_type"] = std::string(model_type_name(architecture));
  json["vocab_size"] = vocab_size;
  json["hidden_size"] = hidden_size;
  json["intermediate_size"] = intermediate_size;
  json["num_hidden_layers"] = num_hidden_layers;
  json["num_attention_heads"] = num_attention_heads;
  json["num_key_value_heads"] = num_key_value_heads;
  // Qwen2's head_dim only where it is not hidden_size / num_attention_heads (older Qwen2Config has none).
  if (architecture != ModelArchitecture::qwen2 || head_dim * num_attention_heads != hidden_size) {
    json["head_dim"] = head_dim;
  }
  json["max_position_embeddings"] = max_position_embeddings;
  json["rms_norm_eps"] = rms_norm_eps;
  json["tie_word_embeddings"] = tie_word_embeddings;
  json["hidden_act"] = "silu";
  json["attention_dropout"] = 0.0;
  json["initializer_range"] = 0.02;
  json["use_cache"] = true;
  json["bos_token_id"] = 1;
  // As read_eos_token_ids reads it back: null for none (transformers 4 took an absent one as 2 for Llama).
  json["eos_token_id"] = eos_token_ids.empty()       ? Json(nullptr)
                         : eos_token_ids.size() == 1 ? Json(eos_token_ids[0])
                                                     : Json(eos_token_ids);
  if (architecture == ModelArchitecture::llama) {
    json["attention_bias"] = false;
    json["mlp_bias"] = false;
    json["pretraining_tp"] = 1;
  }
  // The window as parse_json reads it back: Qwen2's on every layer (max_window_layers 0), since only
  // whether some layer slides is kept (it bounds the capacity).
  const Json window = sliding_window ? Json(*sliding_window) : Json(nullptr);
  if (architecture == ModelArchitecture::mistral) json["sliding_window"] = window;
  if (architecture == ModelArchitecture::qwen2) {
    json["use_sliding_window"] = sliding_window.has_value();
    json["sliding_window"] = window;
    json["max_window_layers"] = sliding_window ? 0 : num_hidden_layers;
  }
  Json rope_type = {{"rope_type", rope.llama3_scaling ? "llama3" : "default"}};
  if (rope.llama3_scaling) {
    rope_type["factor"] = rope.factor;
    rope_type["low_freq_factor"] = rope.low_freq_factor;
    rope_type["high_freq_factor"] = rope.high_freq_factor;
    rope_type["original_max_position_embeddings"] = rope.original_max_position_embeddings;
  }
  if (transformers_version >= 5) {
    rope_type["rope_theta"] = rope.theta;
    json["rope_parameters"] = rope_type;
    json["dtype"] = std::string(torch_dtype_name(dtype));
    json["transformers_version"] = "5.0.0";
  } else {
    json["rope_theta"] = rope.theta;
    json["rope_scaling"] = rope.llama3_scaling ? rope_type : Json(nullptr);
    json["torch_dtype"] = std::string(torch_dtype_name(dtype));
    json["transformers_version"] = "4.46.0";
  }
  if (quantization) json["quantization"] = {{"group_size", quantization->group_size}, {"bits", quantization->bits}};
  return json.dump(2) + "\n";
}

}  // namespace metile
