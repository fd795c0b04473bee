// synthesize_model: a seeded random checkpoint in the Hugging Face layout, so that
// every command and test runs without a download. Presets copy the shapes of real
// models (tiny and small are ours); every tensor is drawn from its own SplitMix64
// stream (seed and tensor name), so the tied/untied, sharded, quantized and
// differently spelled variants of one seed hold the same numbers.
//
// Magnitudes are chosen for a model that behaves like a trained one numerically
// (activations of unit scale through every layer, logits spread over several
// units so that greedy tokens have clear margins), not for what it says:
//   embedding U(-1, 1); linear weights U(-1, 1)·sqrt(3 / fan_in) (unit-variance
//   outputs); norm weights 1 + U(-0.1, 0.1); q/k/v biases U(-0.1, 0.1); lm_head
//   U(-1, 1)·sqrt(3 / H)·3 (logits of standard deviation about 3).
//
// Drawing (ranges of elements, each jumping its stream ahead) and quantizing (ranges of rows)
// run on every hardware thread and write the bytes of the sequential loops, whatever the
// thread count (the model and quant unit suites check it).
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "metile/io.h"
#include "metile/model.h"
#include "model_internal.h"
#include "parallel.h"

namespace metile {
namespace {

struct TensorRecipe {
  std::string name;
  std::vector<std::int64_t> shape;
  enum class Kind { embedding, linear, norm, bias, head } kind;
  bool quantizable = false;
};

std::vector<TensorRecipe> recipes(const ModelConfig& config) {
  using Kind = TensorRecipe::Kind;
  const std::int64_t hidden = config.hidden_size;
  const std::int64_t q_width = config.num_attention_heads * config.head_dim;
  const std::int64_t kv_width = config.num_key_value_heads * config.head_dim;
  std::vector<TensorRecipe> list;
  list.push_back({"model.embed_tokens.weight", {config.vocab_size, hidden}, Kind::embedding, true});
  for (std::int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    const std::string prefix = layer_prefix(layer);
    list.push_back({prefix + "input_layernorm.weight", {hidden}, Kind::norm});
    list.push_back({prefix + "self_attn.q_proj.weight", {q_width, hidden}, Kind::linear, true});
    list.push_back({prefix + "self_attn.k_proj.weight", {kv_width, hidden}, Kind::linear, true});
    list.push_back({prefix + "self_attn.v_proj.weight", {kv_width, hidden}, Kind::linear, true});
    if (config.qkv_bias()) {
      list.push_back({prefix + "self_attn.q_proj.bias", {q_width}, Kind::bias});
      list.push_back({prefix + "self_attn.k_proj.bias", {kv_width}, Kind::bias});
      list.push_back({prefix + "self_attn.v_proj.bias", {kv_width}, Kind::bias});
    }
    list.push_back({prefix + "self_attn.o_proj.weight", {hidden, q_width}, Kind::linear, true});
    list.push_back({prefix + "post_attention_layernorm.weight", {hidden}, Kind::norm});
    list.push_back({prefix + "mlp.gate_proj.weight", {config.intermediate_size, hidden}, Kind::linear, true});
    list.push_back({prefix + "mlp.up_proj.weight", {config.intermediate_size, hidden}, Kind::linear, true});
    list.push_back({prefix + "mlp.down_proj.weight", {hidden, config.intermediate_size}, Kind::linear, true});
  }
  list.push_back({"model.norm.weight", {hidden}, Kind::norm});
  if (!config.tie_word_embeddings) list.push_back({"lm_head.weight", {config.vocab_size, hidden}, Kind::head, true});
  return list;
}

// Elements [first, last) of the stream drawn with `low`, `high`, `offset` into `data` (element
// `first` at data[0]): draw i + 1 of SplitMix64(stream_seed) for element i (draw 0 is discarded).
void draw_elements(std::byte* data, std::int64_t first, std::int64_t last, std::uint64_t stream_seed, float low,
                   float high, float offset) {
  SplitMix64 generator(stream_seed);
  generator.skip(1 + static_cast<std::uint64_t>(first));
  for (std::int64_t index = first; index < last; ++index) {
    const std::uint16_t bits = f32_to_bf16_bits(offset + generator.uniform(low, high));
    std::memcpy(data + (index - first) * 2, &bits, 2);
  }
}

struct Distribution {
  std::uint64_t stream_seed;
  float low = -1, high = 1, offset = 0;
};

Distribution distribution(const TensorRecipe& recipe, std::uint64_t seed) {
  Distribution result{seed ^ fnv1a_64(recipe.name)};
  const std::int64_t fan_in = recipe.shape.back();
  const float unit_variance = std::sqrt(3.0f / static_cast<float>(fan_in));
  switch (recipe.kind) {
    case TensorRecipe::Kind::embedding: break;
    case TensorRecipe::Kind::linear: result.low = -unit_variance, result.high = unit_variance; break;
    case TensorRecipe::Kind::head: result.low = -3 * unit_variance, result.high = 3 * unit_variance; break;
    case TensorRecipe::Kind::norm: result.low = -0.1f, result.high = 0.1f, result.offset = 1; break;
    case TensorRecipe::Kind::bias: result.low = -0.1f, result.high = 0.1f; break;
  }
  return result;
}

HostTensor draw(const TensorRecipe& recipe, std::uint64_t seed) {
  HostTensor tensor(TensorSpec(recipe.shape, DType::bf16));
  const Distribution d = distribution(recipe, seed);
  draw_uniform_bf16(tensor, d.stream_seed, d.low, d.high, d.offset);
  return tensor;
}

// quantize_affine(draw(recipe, seed), format, bf16, mlx), without the bf16 matrix: each thread
// draws a block of rows at a time into a small buffer and quantizes it (rows are independent,
// so the bytes are the same), which spares allocating and zero-filling 2 bytes a weight on one
// thread, a serial cost no thread count shrinks.
QuantizedMatrix draw_quantized(const TensorRecipe& recipe, std::uint64_t seed, AffineQuantization format) {
  const Distribution d = distribution(recipe, seed);
  const std::int64_t rows = recipe.shape.at(0);
  const std::int64_t columns = recipe.shape.at(1);
  format.check_columns(columns);
  QuantizedMatrix matrix;
  matrix.format = format;
  matrix.rows = rows;
  matrix.columns = columns;
  matrix.packed = HostTensor(TensorSpec({rows, format.packed_columns(columns)}, DType::u32));
  matrix.scales = HostTensor(TensorSpec({rows, format.group_count(columns)}, DType::bf16));
  matrix.biases = HostTensor(matrix.scales.spec());
  const std::int64_t block_rows = std::max<std::int64_t>(1, (std::int64_t{1} << 16) / columns);
  const auto quantize_rows = [&](std::int64_t first_row, std::int64_t last_row) {
    for (std::int64_t row = first_row; row < last_row; row += block_rows) {
      const std::int64_t count = std::min(block_rows, last_row - row);
      HostTensor block(TensorSpec({count, columns}, DType::bf16));
      draw_elements(block.bytes().data(), row * columns, (row + count) * columns, d.stream_seed, d.low, d.high,
                    d.offset);
      const QuantizedMatrix part = quantize_affine(block, format, DType::bf16, AffineRounding::mlx, 1);
      for (auto [target, source] : {std::pair{&matrix.packed, &part.packed}, std::pair{&matrix.scales, &part.scales},
                                    std::pair{&matrix.biases, &part.biases}}) {
        const std::size_t row_bytes = source->bytes().size() / static_cast<std::size_t>(count);
        std::memcpy(target->bytes().data() + static_cast<std::size_t>(row) * row_bytes, source->bytes().data(),
                    source->bytes().size());
      }
    }
  };
  parallel_ranges(rows, ranges_for(rows * columns, std::int64_t{1} << 20), quantize_rows);
  return matrix;
}

ModelConfig preset_config(const std::string& preset) {
  ModelConfig config;
  config.dtype = DType::bf16;
  if (preset == "tiny") {
    config.vocab_size = 256, config.hidden_size = 64, config.intermediate_size = 128;
    config.num_hidden_layers = 2, config.num_attention_heads = 4, config.num_key_value_heads = 2;
    config.max_position_embeddings = 256, config.rms_norm_eps = 1e-5;
  } else if (preset == "small") {  // about 125M parameters, untied
    config.vocab_size = 32000, config.hidden_size = 768, config.intermediate_size = 2048;
    config.num_hidden_layers = 12, config.num_attention_heads = 12, config.num_key_value_heads = 4;
    config.max_position_embeddings = 2048, config.rms_norm_eps = 1e-5;
  } else if (preset == "llama3.2-1b") {
    config.vocab_size = 128256, config.hidden_size = 2048, config.intermediate_size = 8192;
    config.num_hidden_layers = 16, config.num_attention_heads = 32, config.num_key_value_heads = 8;
    config.max_position_embeddings = 131072, config.rms_norm_eps = 1e-5, config.tie_word_embeddings = true;
    config.rope = {500000, true, 32, 1, 4, 8192};
  } else if (preset == "qwen2.5-1.5b") {
    config.architecture = ModelArchitecture::qwen2;
    config.vocab_size = 151936, config.hidden_size = 1536, config.intermediate_size = 8960;
    config.num_hidden_layers = 28, config.num_attention_heads = 12, config.num_key_value_heads = 2;
    config.max_position_embeddings = 32768, config.rms_norm_eps = 1e-6, config.tie_word_embeddings = true;
    config.rope.theta = 1000000;
  } else if (preset == "llama3-8b") {
    config.vocab_size = 128256, config.hidden_size = 4096, config.intermediate_size = 14336;
    config.num_hidden_layers = 32, config.num_attention_heads = 32, config.num_key_value_heads = 8;
    config.max_position_embeddings = 131072, config.rms_norm_eps = 1e-5;
    config.rope = {500000, true, 8, 1, 4, 8192};
  } else {
    throw InputError(
        fmt::format("unknown preset '{}' (tiny, small, llama3.2-1b, qwen2.5-1.5b or llama3-8b)", preset));
  }
  config.head_dim = config.hidden_size / config.num_attention_heads;
  return config;
}

// Writes `tensors` as one safetensors file; returns its name.
void write_shard(const std::filesystem::path& directory, const std::string& file, const TensorMap& tensors) {
  write_safetensors(directory / file, tensors);
}

}  // namespace

void draw_uniform_bf16(HostTensor& tensor, std::uint64_t stream_seed, float low, float high, float offset,
                       std::int64_t ranges) {
  if (tensor.spec().dtype != DType::bf16) {
    throw InputError(fmt::format("draw_uniform_bf16: tensor is {}, not bf16", tensor.spec().to_string()));
  }
  std::byte* data = tensor.bytes().data();
  const auto draw_range = [&](std::int64_t first, std::int64_t last) {
    draw_elements(data + first * 2, first, last, stream_seed, low, high, offset);
  };
  const std::int64_t count = tensor.element_count();
  constexpr std::int64_t kElementsPerRange = std::int64_t{1} << 20;
  parallel_ranges(count, ranges > 0 ? ranges : ranges_for(count, kElementsPerRange), draw_range);
}

ModelConfig synth_config(const SynthOptions& options) {
  ModelConfig config = preset_config(options.preset);
  // eos_token_ids stays empty (written as null): random weights give no text to end, and generation runs
  // the tokens asked for.
  if (options.architecture) config.architecture = *options.architecture;
  if (options.layers) {
    // The deepest public decoders have ~130 layers; the bound keeps a typo from filling the disk and memory.
    constexpr std::int64_t kMaximumLayers = 1024;
    if (*options.layers <= 0 || *options.layers > kMaximumLayers) {
      throw InputError(fmt::format("layers {} must be 1..{}", *options.layers, kMaximumLayers));
    }
    config.num_hidden_layers = *options.layers;
  }
  if (options.tie_word_embeddings) config.tie_word_embeddings = *options.tie_word_embeddings;
  // Mistral's explicit head_dim: tiny takes one that differs from hidden / heads, so the
  // loader and the graph are tested on the shapes where the two disagree.
  if (config.architecture == ModelArchitecture::mistral && options.preset == "tiny") config.head_dim = 32;
  if (options.quantize) {
    options.quantize->validate();
    config.quantization = *options.quantize;
  }
  if (options.transformers_version != 4 && options.transformers_version != 5) {
    throw InputError(fmt::format("config spelling {} is not 4 or 5", options.transformers_version));
  }
  return config;
}

namespace {

// rename(2) that fails with EEXIST where `to` exists (RENAME_NOREPLACE) instead of replacing a file or
// an empty directory; 0 on success, else the errno. A file system without the flag (EINVAL) gets a
// plain rename, which still refuses a directory that is not empty (ENOTEMPTY).
int rename_without_replacing(const std::filesystem::path& from, const std::filesystem::path& to) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return 0;
  // EINVAL: the file system has no RENAME_NOREPLACE; ENOSYS, EPERM: the kernel or a sandbox refuses
  // renameat2. A file then moves by a hard link, which fails with EEXIST as the flag would; a directory
  // by rename, which refuses one that is not empty (ENOTEMPTY).
  if (errno != EINVAL && errno != ENOSYS && errno != EPERM) return errno;
  if (std::filesystem::is_directory(from)) return ::rename(from.c_str(), to.c_str()) == 0 ? 0 : errno;
  if (::link(from.c_str(), to.c_str()) != 0) return errno;
  return ::unlink(from.c_str()) == 0 ? 0 : errno;
}

// The bytes a recipe's tensors take as written: bf16, or MLX's packed codes (u32) with bf16 scales and
// biases a group.
std::int64_t recipe_bytes(const TensorRecipe& recipe, const SynthOptions& options) {
  std::int64_t elements = 1;
  for (std::int64_t extent : recipe.shape) elements *= extent;
  if (options.quantize && recipe.quantizable && recipe.shape.back() % options.quantize->group_size == 0) {
    const std::int64_t rows = elements / recipe.shape.back();
    return rows * (options.quantize->packed_columns(recipe.shape.back()) * 4 + 2 * options.quantize->group_count(recipe.shape.back()) * 2);
  }
  return elements * 2;
}

// A shard is held in memory until it is written (up to max_shard_mb, with the tensor drawn next): refused
// before anything is written when that passes this machine's memory. It was checked nowhere, so a huge
// --max-shard-mb grew with the model (1.2 GB for six layers of Llama-3.2-1B) into "internal error: out of
// memory" or the out-of-memory killer, which left the staging folder behind.
void check_shards_fit_in_memory(const std::vector<TensorRecipe>& list, const SynthOptions& options) {
  std::int64_t total = 0, largest = 0;
  for (const TensorRecipe& recipe : list) {
    const std::int64_t bytes = recipe_bytes(recipe, options);
    total += bytes;
    largest = std::max(largest, bytes);
  }
  const double held = std::min(static_cast<double>(total), options.max_shard_mb * 1e6 + static_cast<double>(largest));
  if (const auto memory = static_cast<double>(physical_memory_bytes()); held > memory) {
    throw InputError(fmt::format("synth-model: a shard is held in memory until it is written: {:.1f} GB of this {:.1f} GB "
                                 "model at shards of {} MB, more than this machine's {:.1f} GB of memory (lower "
                                 "max-shard-mb, or max_shard_mb in Python)",
                                 held / 1e9, static_cast<double>(total) / 1e9, options.max_shard_mb, memory / 1e9));
  }
}

}  // namespace

void synthesize_model(const std::filesystem::path& directory, const SynthOptions& options,
                      const std::function<void(const std::string&)>& progress, const std::function<bool()>& cancelled) {
  const ModelConfig config = synth_config(options);
  // At most 10^6 MB (a terabyte): also keeps max_shard_mb * 1e6 inside an int64 below.
  if (!(options.max_shard_mb > 0 && options.max_shard_mb <= 1e6)) {
    throw InputError(fmt::format("the shard size {} MB must be in (0, 1000000] (max-shard-mb, or max_shard_mb in Python)", options.max_shard_mb));
  }
  check_shards_fit_in_memory(recipes(config), options);
  std::error_code error;
  if (directory.empty()) throw InputError("synth-model: the output directory is an empty path");
  // "d/", "d/." and "d" are one directory (the staging folder must not be taken for it). Only
  // trailing "/" and "." are dropped: a ".." after a symbolic link means what the system says it
  // means (lexically_normal would take "link/../d" for "d").
  std::filesystem::path target = directory;
  while (!target.empty() && target != target.parent_path() && (target.filename().empty() || target.filename() == ".")) {
    target = target.parent_path();
  }
  target = target.empty() ? std::filesystem::current_path() : std::filesystem::absolute(target);
  const std::filesystem::file_status target_status = input_path_status(target, false);
  if (std::filesystem::is_symlink(target_status)) {
    throw InputError(fmt::format("{}: is a symbolic link; name the directory itself", directory.string()));
  }
  if (std::filesystem::exists(target_status) && !std::filesystem::is_directory(target_status)) {
    throw InputError(fmt::format("{}: exists and is not a directory", directory.string()));
  }
  const bool target_exists = std::filesystem::exists(target_status);
  if (target_exists) {
    const bool empty = std::filesystem::is_empty(target, error);
    if (error) throw InputError(fmt::format("{}: {}", directory.string(), error.message()));
    if (!empty) throw InputError(fmt::format("{}: exists and is not an empty directory", directory.string()));
  }
  const std::filesystem::path parent = target.parent_path();
  const std::filesystem::file_status parent_status = input_path_status(parent);
  if (target == parent || !std::filesystem::exists(parent_status)) {
    throw InputError(fmt::format("{}: parent directory does not exist", parent.string()));
  }
  if (!std::filesystem::is_directory(parent_status)) throw InputError(fmt::format("{}: is not a directory", parent.string()));
  // A new directory is staged beside it and renamed into place. An empty directory that exists (".",
  // a folder a shell is in, a mounted volume) stays the same directory: the files are staged inside it
  // and moved up, so every rename stays on its file system (from beside a mount point, into it, each
  // failed with EXDEV).
  // One name a run: two threads of one process (Python's synth_model releases the GIL) write apart.
  static std::atomic<unsigned> runs{0};
  const std::string staging_name = fmt::format(".metile-partial-{}-{}", ::getpid(), runs++);  // short: fits NAME_MAX
  const std::filesystem::path staging_parent = target_exists ? target : parent;
  const std::filesystem::path staging = staging_parent / staging_name;
  std::vector<std::filesystem::path> moved;  // into an existing directory: removed again if a later move fails
  const auto remove_what_was_written = [&] {
    for (const std::filesystem::path& file : moved) std::filesystem::remove(file, error);
    std::filesystem::remove_all(staging, error);
  };
  // create_directory: a folder of that name already there is an error, not shared.
  if (!std::filesystem::create_directory(staging, error) && !error) error = std::make_error_code(std::errc::file_exists);
  if (error) {
    // Named after the directory the user gave: the staging folder is this run's own name.
    throw_write_failure(fmt::format("{}: cannot write there: {} (creating {})", staging_parent.string(), error.message(),
                                    staging_name),
                        error.value());
  }
  // Another writer that passed the emptiness check above at the same time (a second synth-model)
  // would be written over file by file: each run leaves its staging folder in the directory while it
  // writes, and a run that finds anything else there stops. Two runs that both look after both made
  // theirs both stop; none overwrites the other.
  const auto someone_else_writes = [&] {
    return InputError(fmt::format("{}: is no longer an empty directory: another process is writing into it",
                                  directory.string()));
  };
  if (target_exists) {
    bool alone = true;
    for (const auto& entry : std::filesystem::directory_iterator(target, error)) alone = alone && entry.path() == staging;
    if (error || !alone) {
      std::error_code ignored;
      std::filesystem::remove_all(staging, ignored);
      if (error) throw InputError(fmt::format("{}: {}", directory.string(), error.message()));
      throw someone_else_writes();
    }
  }
  // A write that failed inside the staging folder (a full disk, `ulimit -f`) is told in the user's terms:
  // the folder named above is gone, and nothing reached the directory asked for. Other messages stay.
  const auto in_the_users_terms = [&](const std::string& message) -> std::optional<std::string> {
    const std::string staged_prefix = (staging / "").string();
    const std::size_t colon = message.find(": ", staged_prefix.size());
    if (!message.starts_with(staged_prefix) || colon == std::string::npos) return std::nullopt;
    std::string file = message.substr(staged_prefix.size(), colon - staged_prefix.size());
    if (file.starts_with("shard-")) file = fmt::format("shard {}", std::stoull(file.substr(6)) + 1);  // not yet named
    std::string reason = message.substr(colon + 2);
    for (std::size_t at; (at = reason.find(staged_prefix)) != std::string::npos;) {  // a temporary's path in it
      reason.replace(at, staged_prefix.size(), (target / "").string());
    }
    return fmt::format("{}: {} (writing {}); nothing was written", directory.string(), reason, file);
  };
  try {
    const std::vector<TensorRecipe> list = recipes(config);
    const auto shard_limit = static_cast<std::int64_t>(options.max_shard_mb * 1e6);
    std::vector<TensorMap> shards(1);
    std::vector<std::int64_t> shard_bytes(1, 0);
    std::map<std::string, std::size_t> shard_of;
    std::vector<std::string> shard_files;
    std::int64_t total_bytes = 0;
    // Tensors are drawn and written shard by shard, so memory holds one shard at a time.
    std::size_t written = 0;
    const auto stop_if_cancelled = [&] {
      if (cancelled && cancelled()) throw InputError("synth-model: interrupted; nothing was written");
    };
    const auto flush = [&](bool last) {
      const std::size_t index = shard_files.size();
      shard_files.push_back(fmt::format("shard-{}", index));  // renamed once the count is known
      write_shard(staging, shard_files.back(), shards.back());
      stop_if_cancelled();
      if (progress) progress(fmt::format("synth-model: wrote shard {} ({} tensors so far)", index + 1, written));
      if (!last) {
        shards.back().clear();
        shard_bytes.back() = 0;
      }
    };
    for (const TensorRecipe& recipe : list) {
      stop_if_cancelled();
      TensorMap parts;
      if (options.quantize && recipe.quantizable && recipe.shape.back() % options.quantize->group_size == 0) {
        const std::string prefix = recipe.name.substr(0, recipe.name.size() - std::string(".weight").size());
        QuantizedMatrix matrix = draw_quantized(recipe, options.seed, *options.quantize);
        parts.emplace(recipe.name, std::move(matrix.packed));
        parts.emplace(prefix + ".scales", std::move(matrix.scales));
        parts.emplace(prefix + ".biases", std::move(matrix.biases));
      } else {
        parts.emplace(recipe.name, draw(recipe, options.seed));
      }
      std::int64_t bytes = 0;
      for (const auto& [name, part] : parts) bytes += static_cast<std::int64_t>(part.bytes().size());
      if (shard_bytes.back() > 0 && shard_bytes.back() + bytes > shard_limit) flush(false);
      for (auto& [name, part] : parts) {
        shard_of[name] = shard_files.size();
        shards.back().insert_or_assign(name, std::move(part));
      }
      shard_bytes.back() += bytes;
      total_bytes += bytes;
      ++written;
    }
    flush(true);
    const std::size_t count = shard_files.size();
    if (count == 1) {
      std::filesystem::rename(staging / shard_files[0], staging / "model.safetensors");
    } else {
      nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", nlohmann::json::object()}};
      std::vector<std::string> names;
      for (std::size_t shard = 0; shard < count; ++shard) {
        names.push_back(fmt::format("model-{:05d}-of-{:05d}.safetensors", shard + 1, count));
        std::filesystem::rename(staging / shard_files[shard], staging / names.back());
      }
      for (const auto& [name, shard] : shard_of) index["weight_map"][name] = names[shard];
      write_output_file(staging / "model.safetensors.index.json", [&](std::ostream& out) { out << index.dump(2) << "\n"; });
    }
    write_output_file(staging / "config.json",
                      [&](std::ostream& out) { out << config.to_json(static_cast<int>(options.transformers_version)); });
    stop_if_cancelled();  // the last moment: after the renames below the model is there
    // No rename replaces what is there: a directory or file that appeared meanwhile is another writer's.
    if (target_exists) {
      for (const auto& entry : std::filesystem::directory_iterator(staging)) {
        const std::filesystem::path destination = target / entry.path().filename();
        if (const int failure = rename_without_replacing(entry.path(), destination); failure != 0) {
          if (failure == EEXIST) throw someone_else_writes();
          throw_write_failure(fmt::format("{}: cannot move into place: {}", destination.string(), std::strerror(failure)),
                              failure);
        }
        moved.push_back(destination);
      }
      std::filesystem::remove(staging);
    } else if (const int failure = rename_without_replacing(staging, target); failure != 0) {
      if (failure == EEXIST || failure == ENOTEMPTY) {
        throw InputError(fmt::format("{}: exists now: another process made it while this one wrote", directory.string()));
      }
      throw_write_failure(fmt::format("{}: cannot move into place: {}", directory.string(), std::strerror(failure)), failure);
    }
  } catch (const InputError& failure) {
    remove_what_was_written();
    if (auto message = in_the_users_terms(failure.what())) throw InputError(*message);
    throw;
  } catch (const WriteError& failure) {
    remove_what_was_written();
    if (auto message = in_the_users_terms(failure.what())) throw WriteError(*message);
    throw;
  } catch (...) {
    remove_what_was_written();
    throw;
  }
}

}  // namespace metile
