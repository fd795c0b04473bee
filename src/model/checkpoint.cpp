// DecoderModel::load: a Hugging Face checkpoint directory into runtime weights.
//
//   config.json                      -> ModelConfig (model_config.cpp)
//   generation_config.json           -> its eos_token_id, where there is one (the tokens generation stops at)
//   model.safetensors                -> one mapped file, or
//   model.safetensors.index.json     -> {"weight_map": {tensor: shard file}}, each shard mapped once
//
// Every tensor the config implies is looked up by its Hugging Face name, its
// shape and dtype checked, and converted once from the mapping into the runtime
// dtype (bf16 or f32); tensors the model does not use are ignored: buffers
// (rotary inv_freq, ...) without a word, weights (those of layers past
// num_hidden_layers, and others config.json does not call for) with a warning
// (LoadOptions::warn). MLX-quantized linears (NAME.weight u32, NAME.scales,
// NAME.biases) stay quantized, their scales and biases in the runtime dtype;
// with LoadOptions::quantize, dense ones are quantized here (src/quant).
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "json_input.h"
#include "metile/error.h"
#include "metile/io.h"
#include "metile/model.h"
#include "model_internal.h"

namespace metile {
namespace {

using Json = nlohmann::json;

// config.json, generation_config.json and the shard index: regular files read within
// kMaximumCheckpointJsonBytes (a directory, a FIFO or a device in their place is an error, not a hang:
// opening a FIFO with no writer blocks); each is parsed with parse_json_input's nesting limit.
std::string read_checkpoint_json(const std::filesystem::path& path) {
  const std::filesystem::file_status status = input_path_status(path);
  if (std::filesystem::exists(status) && !std::filesystem::is_directory(status) &&
      !std::filesystem::is_regular_file(status)) {
    throw InputError(path.string() +
                     ": not a regular file (a checkpoint's config.json, generation_config.json and shard index are files)");
  }
  return read_input_file(path, kMaximumCheckpointJsonBytes, "checkpoint JSON");
}

// Whether a checkpoint file is there. A symbolic link whose target is missing is not "no such file"
// (the checkpoint would be reported as having neither weight file): it is an error naming both.
bool checkpoint_file_present(const std::filesystem::path& path) {
  if (std::filesystem::exists(input_path_status(path))) return true;
  if (!std::filesystem::is_symlink(input_path_status(path, false))) return false;
  std::error_code error;
  const std::filesystem::path target = std::filesystem::read_symlink(path, error);
  throw InputError(fmt::format("{}: a symbolic link to {}, which does not exist", path.string(),
                               error ? std::string("a target it cannot read") : target.string()));
}

// The checkpoint's tensors by name, over one or several mapped files.
class CheckpointFiles {
 public:
  explicit CheckpointFiles(const std::filesystem::path& directory) {
    const std::filesystem::path index = directory / "model.safetensors.index.json";
    if (checkpoint_file_present(index)) {
      index_ = index;
      const Json json = parse_json_input(read_checkpoint_json(index), index.string());
      if (!json.is_object() || !json.contains("weight_map") || !json["weight_map"].is_object()) {
        throw InputError(fmt::format("{}: field 'weight_map': missing or not an object", index.string()));
      }
      if (json["weight_map"].empty()) throw InputError(fmt::format("{}: field 'weight_map': lists no tensor", index.string()));
      std::map<std::string, std::size_t> file_index;
      for (const auto& [name, file] : json["weight_map"].items()) {
        // No '/' (a file of this directory), no NUL (the system would open the name cut at it), and not
        // "", "." or "..", which name a directory ("is a directory", without the field that said it).
        const auto not_a_file_name = [](const std::string& text) {
          return text.empty() || text == "." || text == ".." || text.find_first_of(std::string_view("/\0", 2)) != std::string::npos;
        };
        if (!file.is_string() || not_a_file_name(file.get<std::string>())) {
          throw InputError(fmt::format("{}: field 'weight_map.{}': must be a file name in the directory, got {}",
                                       index.string(), name, json_excerpt(file)));
        }
        const auto [slot, added] = file_index.emplace(file.get<std::string>(), files_.size());
        if (added) files_.push_back(std::make_unique<MappedSafetensors>(directory / file.get<std::string>()));
        owner_[name] = slot->second;
      }
      // A model.safetensors the index does not list: transformers loads it (it looks for it before
      // the index), this loader the index's shards, mlx-lm every model*.safetensors: two models, no
      // word. Refused as a tensor in two shards is. (mlx-lm's index of one shard lists model.safetensors.)
      if (!file_index.contains("model.safetensors") && checkpoint_file_present(directory / "model.safetensors")) {
        throw InputError(fmt::format("{}: does not list model.safetensors, which is in the directory too (transformers "
                                     "would load it, this loader the listed shards): remove one of the two",
                                     index.string()));
      }
      for (const auto& [name, slot] : owner_) {
        if (!files_[slot]->contains(name)) {
          throw InputError(fmt::format("{}: tensor '{}': listed in {} but absent from the file",
                                       files_[slot]->path().string(), name, index.filename().string()));
        }
      }
      // A tensor in two shards is ambiguous: the index names one, while loaders that read every
      // shard (transformers, mlx-lm) keep the last; refused, as a name twice in one header is.
      std::map<std::string, std::size_t> first_file;
      for (std::size_t slot = 0; slot < files_.size(); ++slot) {
        for (const std::string& name : files_[slot]->names()) {
          const auto [seen, added] = first_file.emplace(name, slot);
          if (!added) {
            throw InputError(fmt::format("{}: tensor '{}': also in {} (a tensor belongs to one shard)",
                                         files_[slot]->path().string(), name,
                                         files_[seen->second]->path().filename().string()));
          }
        }
      }
    } else {
      const std::filesystem::path single = directory / "model.safetensors";
      if (!checkpoint_file_present(single)) {
        throw InputError(fmt::format("{}: neither model.safetensors nor model.safetensors.index.json",
                                     directory.string()));
      }
      files_.push_back(std::make_unique<MappedSafetensors>(single));
      for (const std::string& name : files_[0]->names()) owner_[name] = 0;
    }
  }

  std::vector<std::string> names() const {  // every tensor, sorted
    std::vector<std::string> names;
    for (const auto& [name, slot] : owner_) names.push_back(name);
    return names;
  }
  const MappedSafetensors::TensorView* find(const std::string& name) const {
    const auto found = owner_.find(name);
    return found == owner_.end() ? nullptr : files_[found->second]->find(name);
  }
  const MappedSafetensors::TensorView& require(const std::string& name) const {
    const MappedSafetensors::TensorView* view = find(name);
    if (!view) {
      // Not in owner_ (every name there is in its file, checked above). A shard the index lists may
      // hold it all the same (a stale index): say so, rather than that the checkpoint lacks it.
      // Loaders that read whole shards (transformers) would take it.
      for (const auto& file : files_) {
        if (file->contains(name)) {
          throw InputError(fmt::format("{}: tensor '{}' is missing from the weight_map, though {} holds it (is the index "
                                       "stale?)",
                                       where(), name, file->path().filename().string()));
        }
      }
      throw InputError(fmt::format("{}: tensor '{}' is missing", where(), name));
    }
    return *view;
  }
  std::string file_of(const std::string& name) const {
    const auto found = owner_.find(name);
    return found == owner_.end() ? where() : files_[found->second]->path().string();
  }
  // Where a tensor that is not there is missing from: the index where there is one (even listing
  // one shard: the index is what names the tensors), else model.safetensors.
  std::string where() const { return index_.empty() ? files_[0]->path().string() : index_.string(); }

 private:
  std::filesystem::path index_;  // model.safetensors.index.json; empty: one model.safetensors
  std::vector<std::unique_ptr<MappedSafetensors>> files_;
  std::map<std::string, std::size_t, std::less<>> owner_;
};

std::string shape_text(const std::vector<std::int64_t>& shape) {
  return TensorSpec(shape, DType::f32).to_string().substr(3);  // "[a, b]"
}

class WeightLoader {
 public:
  // measuring: check every tensor as loading would and add up the bytes the runtime weights will
  // take (weight_bytes()), allocating nothing; loading: convert them into `weights`.
  WeightLoader(const ModelConfig& config, const LoadOptions& options, const CheckpointFiles& files,
               TensorMap& weights, bool measuring)
      : config_(config), options_(options), files_(files), weights_(weights), measuring_(measuring) {}

  double weight_bytes() const { return weight_bytes_; }

  // A norm weight or bias: dense [length].
  void vector(const std::string& name, std::int64_t length) {
    const MappedSafetensors::TensorView& view = dense_view(name, {length});
    if (measuring_) {
      weight_bytes_ += dense_bytes(length, 1);
      return;
    }
    weights_.insert_or_assign(name, convert_tensor(view, options_.dtype));
  }

  // A linear (or the embedding table) [rows, columns]: dense, MLX-quantized, or quantized now.
  void matrix(const std::string& prefix, std::int64_t rows, std::int64_t columns) {
    const std::string weight_name = prefix + ".weight";
    if (files_.find(prefix + ".scales")) {
      quantized(prefix, rows, columns);
      return;
    }
    if (const auto* view = files_.find(weight_name); view && view->spec.dtype == DType::u32) {
      // Packed codes without their scales: name the tensor that is missing, not the weight's dtype.
      throw InputError(fmt::format("{}: tensor '{}.scales' is missing ('{}' is u32: the packed codes of a quantized layer)",
                                   files_.where(), prefix, weight_name));
    }
    const MappedSafetensors::TensorView& view = dense_view(weight_name, {rows, columns});
    const bool quantize = options_.quantize && columns % options_.quantize->group_size == 0;
    if (measuring_) {
      weight_bytes_ += quantize ? quantized_bytes(*options_.quantize, rows, columns) : dense_bytes(rows, columns);
      return;
    }
    HostTensor weight = convert_tensor(view, options_.dtype);
    if (quantize) {
      QuantizedMatrix matrix;
      try {
        matrix = quantize_affine(weight, *options_.quantize, options_.dtype);
      } catch (const InputError& error) {
        fail(weight_name, error.what());  // a weight it cannot quantize (inf, NaN): say which matrix holds it
      }
      weights_.insert_or_assign(weight_name, std::move(matrix.packed));
      weights_.insert_or_assign(prefix + ".scales", std::move(matrix.scales));
      weights_.insert_or_assign(prefix + ".biases", std::move(matrix.biases));
      return;
    }
    weights_.insert_or_assign(weight_name, std::move(weight));
  }

 private:
  [[noreturn]] void fail(const std::string& name, const std::string& why) const {
    throw InputError(fmt::format("{}: tensor '{}': {}", files_.file_of(name), name, why));
  }

  // A float tensor of the checkpoint with the shape the config implies.
  const MappedSafetensors::TensorView& dense_view(const std::string& name, const std::vector<std::int64_t>& shape) const {
    const MappedSafetensors::TensorView& view = files_.require(name);
    if (!is_floating(view.spec.dtype)) fail(name, fmt::format("dtype {} is not a float", dtype_name(view.spec.dtype)));
    if (view.spec.shape != shape) {
      fail(name, fmt::format("shape {} does not match the config (expected {})", shape_text(view.spec.shape),
                             shape_text(shape)));
    }
    return view;
  }

  // Bytes in memory: a dense [rows, columns] in the runtime dtype, and a quantized one (packed u32
  // codes, scales and biases in the runtime dtype).
  double dense_bytes(std::int64_t rows, std::int64_t columns) const {
    return static_cast<double>(rows) * static_cast<double>(columns) * static_cast<double>(dtype_size(options_.dtype));
  }
  double quantized_bytes(const AffineQuantization& format, std::int64_t rows, std::int64_t columns) const {
    return static_cast<double>(rows) * static_cast<double>(format.packed_columns(columns)) * 4.0 +
           2.0 * dense_bytes(rows, format.group_count(columns));
  }

  void quantized(const std::string& prefix, std::int64_t rows, std::int64_t columns) {
    const std::string weight_name = prefix + ".weight";
    if (!config_.quantization) {
      fail(prefix + ".scales", "the checkpoint is quantized but config.json has no 'quantization'");
    }
    const AffineQuantization format = *config_.quantization;
    if (columns % format.group_size != 0) {
      fail(weight_name, fmt::format("{} columns are not a multiple of group_size {}", columns, format.group_size));
    }
    const MappedSafetensors::TensorView& packed = files_.require(weight_name);
    const std::vector<std::int64_t> packed_shape{rows, format.packed_columns(columns)};
    if (packed.spec.dtype != DType::u32 || packed.spec.shape != packed_shape) {
      fail(weight_name, fmt::format("is {}, expected u32{} ({} bits)", packed.spec.to_string(),
                                    shape_text(packed_shape), format.bits));
    }
    const std::vector<std::int64_t> groups_shape{rows, format.group_count(columns)};
    const MappedSafetensors::TensorView& scales = dense_view(prefix + ".scales", groups_shape);
    const MappedSafetensors::TensorView& biases = dense_view(prefix + ".biases", groups_shape);
    if (measuring_) {
      weight_bytes_ += quantized_bytes(format, rows, columns);
      return;
    }
    weights_.insert_or_assign(weight_name, packed.copy());
    weights_.insert_or_assign(prefix + ".scales", convert_tensor(scales, options_.dtype));
    weights_.insert_or_assign(prefix + ".biases", convert_tensor(biases, options_.dtype));
  }

  const ModelConfig& config_;
  const LoadOptions& options_;
  const CheckpointFiles& files_;
  TensorMap& weights_;
  bool measuring_;
  double weight_bytes_ = 0;
};

// Every weight the config implies, in load order, through `loader`.
void visit_weights(const ModelConfig& config, WeightLoader& loader) {
  const std::int64_t hidden = config.hidden_size;
  const std::int64_t q_width = config.num_attention_heads * config.head_dim;
  const std::int64_t kv_width = config.num_key_value_heads * config.head_dim;
  loader.matrix("model.embed_tokens", config.vocab_size, hidden);
  for (std::int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    const std::string prefix = layer_prefix(layer);
    loader.vector(prefix + "input_layernorm.weight", hidden);
    loader.vector(prefix + "post_attention_layernorm.weight", hidden);
    loader.matrix(prefix + "self_attn.q_proj", q_width, hidden);
    loader.matrix(prefix + "self_attn.k_proj", kv_width, hidden);
    loader.matrix(prefix + "self_attn.v_proj", kv_width, hidden);
    loader.matrix(prefix + "self_attn.o_proj", hidden, q_width);
    if (config.qkv_bias()) {
      loader.vector(prefix + "self_attn.q_proj.bias", q_width);
      loader.vector(prefix + "self_attn.k_proj.bias", kv_width);
      loader.vector(prefix + "self_attn.v_proj.bias", kv_width);
    }
    loader.matrix(prefix + "mlp.gate_proj", config.intermediate_size, hidden);
    loader.matrix(prefix + "mlp.up_proj", config.intermediate_size, hidden);
    loader.matrix(prefix + "mlp.down_proj", hidden, config.intermediate_size);
  }
  loader.vector("model.norm.weight", hidden);
  if (!config.tie_word_embeddings) loader.matrix("lm_head", config.vocab_size, hidden);
}

// N of a tensor named "model.layers.N.*" (the largest int64 for an N past it); nullopt for others.
std::optional<std::int64_t> layer_of(std::string_view name) {
  const std::string_view prefix = "model.layers.";
  if (!name.starts_with(prefix)) return std::nullopt;
  const char* digits = name.data() + prefix.size();
  const char* end = name.data() + name.size();
  std::int64_t layer = 0;
  const auto [stop, error] = std::from_chars(digits, end, layer);
  if (stop == digits || stop == end || *stop != '.') return std::nullopt;  // not "model.layers.N.": not a layer's
  return error == std::errc::result_out_of_range ? std::numeric_limits<std::int64_t>::max() : layer;
}

// Tensors of layers at or past num_hidden_layers ("model.layers.40.*" under 32) are never looked up,
// so the checkpoint loads as the shorter model, as in transformers, which warns of unused weights.
// Other weights the model does not use are named by warn_of_unused_weights; these are weights of a
// model cut short by config.json, which its user may not know: said in one line
// naming the first (by layer, then name) and how many, once the load has succeeded (a failure stays
// one line).
void warn_of_layers_past_the_config(const ModelConfig& config, const CheckpointFiles& files,
                                    const LoadOptions& options) {
  if (!options.warn) return;
  std::int64_t count = 0;
  std::optional<std::pair<std::int64_t, std::string>> first;
  for (const std::string& name : files.names()) {
    const std::optional<std::int64_t> layer = layer_of(name);
    if (!layer || *layer < config.num_hidden_layers) continue;
    ++count;
    if (!first || std::pair(*layer, name) < *first) first = std::pair(*layer, name);
  }
  if (count == 0) return;
  options.warn(fmt::format("{}: {} of layers past config.json's num_hidden_layers ({}) {} not loaded, the first '{}'",
                           files.file_of(first->second), count == 1 ? "1 tensor" : fmt::format("{} tensors", count),
                           config.num_hidden_layers, count == 1 ? "is" : "are", first->second));
}

// Weights (".weight", ".bias" and MLX's ".scales" / ".biases") of the layers the model has, or of no
// layer, that config.json does not call for: a q_proj.bias beside "attention_bias": false, say. The
// model is what the config says (transformers loads it so too, warning of unused weights), which may
// not be what the checkpoint's maker meant: said in one line naming the first and how many. Buffers
// (inv_freq, masks) are not weights and are left alone without a word; a tied model's lm_head.weight
// is the embedding's.
void warn_of_unused_weights(const ModelConfig& config, const CheckpointFiles& files, const TensorMap& weights,
                            const LoadOptions& options) {
  if (!options.warn) return;
  std::int64_t count = 0;
  std::optional<std::pair<std::int64_t, std::string>> first;  // by layer (-1: none), then name, as the other warning
  for (const std::string& name : files.names()) {
    const bool weight_like = name.ends_with(".weight") || name.ends_with(".bias") || name.ends_with(".scales") ||
                             name.ends_with(".biases");
    if (!weight_like || weights.contains(name)) continue;
    if (config.tie_word_embeddings && name.starts_with("lm_head.")) continue;
    const std::optional<std::int64_t> layer = layer_of(name);
    if (layer && *layer >= config.num_hidden_layers) continue;  // warn_of_layers_past_the_config says these
    ++count;
    if (!first || std::pair(layer.value_or(-1), name) < *first) first = std::pair(layer.value_or(-1), name);
  }
  if (count == 0) return;
  options.warn(fmt::format("{}: {} config.json does not call for {} not loaded, the first '{}'",
                           files.file_of(first->second), count == 1 ? "1 weight" : fmt::format("{} weights", count),
                           count == 1 ? "is" : "are", first->second));
}

}  // namespace

std::vector<MatricesLeftDense> matrices_left_dense(const ModelConfig& config, const AffineQuantization& format) {
  std::map<std::int64_t, std::string> matrices_of_width;  // columns -> the matrices that have them
  for (const auto& [columns, matrices] : {std::pair<std::int64_t, const char*>{config.hidden_size, "q/k/v, gate/up, the embedding, the LM head"},
                                          {config.num_attention_heads * config.head_dim, "the o-projection"},
                                          {config.intermediate_size, "the down projection"}}) {
    std::string& names = matrices_of_width[columns];
    names += (names.empty() ? "" : ", ") + std::string(matrices);
  }
  std::vector<MatricesLeftDense> left;
  for (const auto& [columns, matrices] : matrices_of_width) {
    if (columns % format.group_size != 0) left.push_back({matrices, columns});
  }
  return left;
}

void print_warning_line(const std::string& line) {
  std::fprintf(stderr, "metile: warning: %s\n", control_bytes_spelled(line).c_str());
}

HostTensor convert_tensor(const MappedSafetensors::TensorView& view, DType dtype) {
  if (view.spec.dtype == dtype) return view.copy();
  HostTensor tensor(TensorSpec(view.spec.shape, dtype));
  const std::int64_t count = tensor.element_count();
  const std::byte* source = view.bytes.data();
  std::byte* target = tensor.bytes().data();
  for (std::int64_t index = 0; index < count; ++index) {
    float value;
    if (view.spec.dtype == DType::f32) {
      std::memcpy(&value, source + index * 4, 4);
    } else {
      std::uint16_t bits;
      std::memcpy(&bits, source + index * 2, 2);
      value = view.spec.dtype == DType::bf16 ? bf16_bits_to_f32(bits) : f16_bits_to_f32(bits);
    }
    if (dtype == DType::f32) {
      std::memcpy(target + index * 4, &value, 4);
    } else {
      const std::uint16_t bits = dtype == DType::bf16 ? f32_to_bf16_bits(value) : f32_to_f16_bits(value);
      std::memcpy(target + index * 2, &bits, 2);
    }
  }
  return tensor;
}

std::string layer_prefix(std::int64_t layer) { return fmt::format("model.layers.{}.", layer); }

double kv_cache_bytes(const ModelConfig& config, std::int64_t capacity, DType dtype) {
  return 2.0 * static_cast<double>(config.num_hidden_layers) * static_cast<double>(config.num_key_value_heads) *
         static_cast<double>(config.head_dim) * static_cast<double>(capacity) * static_cast<double>(dtype_size(dtype));
}

void DecoderModel::check_load_arguments(const std::filesystem::path& directory, const LoadOptions& options) {
  check_load_options(options);
  // Said with why: an empty path read ": not a model directory", and a missing directory read the same as
  // a file given for one.
  if (directory.empty()) throw InputError("the model directory is an empty path");
  if (const std::filesystem::file_status status = input_path_status(directory); !std::filesystem::is_directory(status)) {
    throw InputError(fmt::format("{}: not a model directory ({})", directory.string(),
                                 std::filesystem::exists(status) ? "not a directory" : "no such directory"));
  }
}

void DecoderModel::check_load_options(const LoadOptions& options) {
  if (options.dtype != DType::bf16 && options.dtype != DType::f32) {
    throw InputError(fmt::format("model dtype must be bf16 or f32, got {}", dtype_name(options.dtype)));
  }
  if (options.quantize) options.quantize->validate();
  if (options.max_sequence < 0) {
    throw InputError(fmt::format("{} {} is negative", options.max_sequence_source, options.max_sequence));
  }
  // Positions are i32 in the step graphs: the last one, capacity - 1, must fit.
  if (options.max_sequence > (std::int64_t{1} << 31)) {
    throw InputError(
        fmt::format("{} {}: at most 2^31 positions (they are 32-bit integers)", options.max_sequence_source, options.max_sequence));
  }
}

DecoderModel DecoderModel::load(const std::filesystem::path& directory, const LoadOptions& options) {
  check_load_arguments(directory, options);
  const std::filesystem::path config_path = directory / "config.json";
  if (!checkpoint_file_present(config_path)) throw InputError(fmt::format("{}: no config.json", directory.string()));
  DecoderModel model;
  model.config_ = ModelConfig::parse_json(read_checkpoint_json(config_path), config_path.string());
  // transformers' generate stops at generation_config.json's eos_token_id where the checkpoint has that
  // file. One that cannot be read as such is passed over with a warning, keeping config.json's tokens:
  // every command but generate (logits, verify-model) is indifferent to it. (transformers passes over a
  // missing or unparsable one, its OSError, and fails at generate on a malformed eos_token_id.)
  try {
    if (const std::filesystem::path path = directory / "generation_config.json"; checkpoint_file_present(path)) {
      model.config_.read_generation_config(read_checkpoint_json(path), path.string());
    }
  } catch (const InputError& error) {
    if (options.warn) {
      const std::vector<std::int64_t>& ids = model.config_.eos_token_ids;
      options.warn(fmt::format("{}; generation ends at config.json's eos_token_id instead ({})", error.what(),
                               ids.empty() ? "none" : fmt::format("{}", fmt::join(ids, ", "))));
    }
  }
  model.dtype_ = options.dtype;
  const ModelConfig& config = model.config_;
  if (config.quantization && options.quantize) {
    throw InputError(fmt::format("{}: the checkpoint is already quantized ({} bits); drop the quantize option",
                                 config_path.string(), config.quantization->bits));
  }
  std::int64_t capacity = options.max_sequence > 0 ? options.max_sequence
                                                   : std::min<std::int64_t>(4096, config.max_position_embeddings);
  model.capacity_source_ = options.max_sequence > 0 ? options.max_sequence_source
                                                   : "max_position_embeddings, at most 4096; " + options.max_sequence_option + " sets it";
  // (An explicit max_sequence's range is check_load_arguments'; the default is at most 4096.)
  if (config.sliding_window && capacity > *config.sliding_window) {
    // Attention here sees every cached position, so the window bounds the context instead of sliding.
    const std::int64_t needed = options.max_sequence_needed > 0 ? options.max_sequence_needed : options.max_sequence;
    if (options.max_sequence > 0 && needed > *config.sliding_window) {
      throw InputError(fmt::format("{} {}: the checkpoint's sliding_window {} bounds the context (attention over a "
                                   "sliding window is not implemented); ask for at most {} positions",
                                   options.max_sequence_source, options.max_sequence, *config.sliding_window,
                                   *config.sliding_window));
    }
    capacity = *config.sliding_window;
    model.capacity_source_ = "the checkpoint's sliding_window";
  }
  // A session keeps K and V of every layer for `capacity` positions: refuse a capacity whose caches
  // alone exceed this machine's memory (a typo in --max-seq) before anything allocates them.
  const double cache_bytes = kv_cache_bytes(config, capacity, options.dtype);
  if (const auto memory = static_cast<double>(physical_memory_bytes()); cache_bytes > memory) {
    throw InputError(fmt::format("the KV caches of {} positions ({}) x {} layers x {} KV heads x head dim {} take "
                                 "{:.1f} GB, more than this machine's {:.1f} GB of memory",
                                 capacity, model.capacity_source_, config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                                 cache_bytes / 1e9, memory / 1e9));
  }
  model.capacity_ = capacity;

  const CheckpointFiles files(directory);
  // Every tensor checked, and the memory its runtime copy takes added up, before any is converted: a
  // checkpoint whose weights (in the runtime dtype: bf16 read as f32 doubles) and KV caches pass this
  // machine's memory is refused here, not by the out-of-memory killer halfway through the load.
  WeightLoader measure(config, options, files, model.weights_, true);
  visit_weights(config, measure);
  if (const auto memory = static_cast<double>(physical_memory_bytes()); measure.weight_bytes() + cache_bytes > memory) {
    throw InputError(fmt::format("{}: the weights take {:.1f} GB in {} and the KV caches of {} positions ({}) {:.1f} "
                                 "GB, more than this machine's {:.1f} GB of memory",
                                 directory.string(), measure.weight_bytes() / 1e9, dtype_name(options.dtype), capacity,
                                 model.capacity_source_,
                                 cache_bytes / 1e9, memory / 1e9));
  }
  WeightLoader loader(config, options, files, model.weights_, false);
  visit_weights(config, loader);
  const bool any_quantized = std::any_of(model.weights_.begin(), model.weights_.end(), [](const auto& entry) {
    return entry.second.spec().dtype == DType::u32;
  });
  if (any_quantized) model.quantization_ = config.quantization ? *config.quantization : *options.quantize;
  warn_of_layers_past_the_config(config, files, options);
  warn_of_unused_weights(config, files, model.weights_, options);
  return model;
}

bool DecoderModel::is_quantized(std::string_view weight_prefix) const {
  return weights_.find(std::string(weight_prefix) + ".scales") != weights_.end();
}

std::int64_t DecoderModel::weight_bytes() const {
  std::int64_t bytes = 0;
  for (const auto& [name, tensor] : weights_) bytes += static_cast<std::int64_t>(tensor.bytes().size());
  return bytes;
}

std::int64_t DecoderModel::parameter_count() const {
  std::int64_t count = 0;
  for (const auto& [name, tensor] : weights_) {
    if (name.ends_with(".scales") || name.ends_with(".biases")) continue;
    const bool packed = tensor.spec().dtype == DType::u32;
    count += packed ? tensor.element_count() * quantization_->codes_per_word() : tensor.element_count();
  }
  return count;
}

}  // namespace metile
