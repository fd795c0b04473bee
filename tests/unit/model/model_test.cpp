// Decoder models on tiny synthetic checkpoints of each architecture:
//   * the decode-step graph against a per-op forward pass written here in double
//     from transformers' Llama conventions (rotate-half RoPE, GQA by head index,
//     rms_norm then weight, SwiGLU), reading the checkpoint with read_safetensors only;
//   * incremental decode with the KV cache == recomputing the prefix, chunked
//     prefill == token by token (bit for bit: every op is row-independent);
//   * synth round trips (config spellings 4 and 5, sharded), MLX-quantized ==
//     dequantize-then-dense, quantize-at-load == quantize-dequantize-dense;
//   * the greedy step graph's next_tokens == a brute-force argmax of its logits.
#include <gtest/gtest.h>

#include <limits>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "metile/cpu_runtime.h"
#include "metile/io.h"
#include "metile/quant.h"
#include "model_test_support.h"

namespace metile {
namespace {

using testing::ModelDirectoryTest;
using testing::random_tokens;
using testing::read_text;
using Matrix = std::vector<std::vector<double>>;  // [rows][columns]

// ------------------------------------------------------------ the per-op oracle
class OracleModel {
 public:
  explicit OracleModel(const std::filesystem::path& directory) {
    config_ = nlohmann::json::parse(read_text(directory / "config.json"));
    if (std::filesystem::exists(directory / "model.safetensors")) {
      tensors_ = read_safetensors(directory / "model.safetensors");
    } else {
      const auto index = nlohmann::json::parse(read_text(directory / "model.safetensors.index.json"));
      std::set<std::string> files;
      for (const auto& [name, file] : index["weight_map"].items()) files.insert(file.get<std::string>());
      for (const std::string& file : files) tensors_.merge(read_safetensors(directory / file));
    }
  }

  // Logits of every position of `tokens`, computed without any cache.
  Matrix logits(const std::vector<std::int32_t>& tokens) const {
    const auto hidden = config_["hidden_size"].get<std::int64_t>();
    const auto heads = config_["num_attention_heads"].get<std::int64_t>();
    const auto kv_heads = config_["num_key_value_heads"].get<std::int64_t>();
    const std::int64_t head_dim = config_.contains("head_dim") ? config_["head_dim"].get<std::int64_t>() : hidden / heads;
    const double eps = config_["rms_norm_eps"].get<double>();
    const bool qwen2 = config_["architectures"][0] == "Qwen2ForCausalLM";
    const std::size_t n = tokens.size();
    const Matrix embedding = matrix("model.embed_tokens");
    Matrix x;
    for (std::int32_t token : tokens) x.push_back(embedding[static_cast<std::size_t>(token)]);
    for (std::int64_t layer = 0; layer < config_["num_hidden_layers"].get<std::int64_t>(); ++layer) {
      const std::string p = "model.layers." + std::to_string(layer) + ".";
      const Matrix normed = rms_norm(x, vector(p + "input_layernorm.weight"), eps);
      Matrix q = linear(normed, p + "self_attn.q_proj", qwen2);
      Matrix k = linear(normed, p + "self_attn.k_proj", qwen2);
      const Matrix v = linear(normed, p + "self_attn.v_proj", qwen2);
      rotate(q, heads, head_dim);
      rotate(k, kv_heads, head_dim);
      Matrix context(n, std::vector<double>(static_cast<std::size_t>(heads * head_dim), 0.0));
      for (std::int64_t head = 0; head < heads; ++head) {
        const std::int64_t kv_head = head / (heads / kv_heads);  // transformers' repeat_kv
        for (std::size_t i = 0; i < n; ++i) {
          std::vector<double> scores(i + 1);
          double maximum = -INFINITY;
          for (std::size_t j = 0; j <= i; ++j) {
            double dot = 0;
            for (std::int64_t d = 0; d < head_dim; ++d) dot += q[i][head * head_dim + d] * k[j][kv_head * head_dim + d];
            scores[j] = dot / std::sqrt(static_cast<double>(head_dim));
            maximum = std::max(maximum, scores[j]);
          }
          double sum = 0;
          for (double& score : scores) sum += (score = std::exp(score - maximum));
          for (std::size_t j = 0; j <= i; ++j) {
            for (std::int64_t d = 0; d < head_dim; ++d) {
              context[i][head * head_dim + d] += scores[j] / sum * v[j][kv_head * head_dim + d];
            }
          }
        }
      }
      add_into(x, linear(context, p + "self_attn.o_proj", false));
      const Matrix normed2 = rms_norm(x, vector(p + "post_attention_layernorm.weight"), eps);
      Matrix gate = linear(normed2, p + "mlp.gate_proj", false);
      const Matrix up = linear(normed2, p + "mlp.up_proj", false);
      for (std::size_t row = 0; row < n; ++row) {
        for (std::size_t c = 0; c < gate[row].size(); ++c) {
          gate[row][c] = gate[row][c] / (1 + std::exp(-gate[row][c])) * up[row][c];
        }
      }
      add_into(x, linear(gate, p + "mlp.down_proj", false));
    }
    const Matrix normed = rms_norm(x, vector("model.norm.weight"), eps);
    return linear(normed, config_.value("tie_word_embeddings", false) ? "model.embed_tokens" : "lm_head", false);
  }

 private:
  std::vector<double> vector(const std::string& name) const { return tensors_.at(name).to_values(); }

  // A weight [rows, columns] in double; MLX-quantized ones through dequantize_affine.
  Matrix matrix(const std::string& prefix) const {
    HostTensor dense;
    if (tensors_.count(prefix + ".scales")) {
      const auto& q = config_["quantization"];
      dense = dequantize_affine(QuantizedMatrix::from_tensors({q["bits"].get<int>(), q["group_size"].get<int>()},
                                                              tensors_.at(prefix + ".weight"),
                                                              tensors_.at(prefix + ".scales"),
                                                              tensors_.at(prefix + ".biases")),
                                DType::f32);
    } else {
      dense = tensors_.at(prefix + ".weight");
    }
    const std::vector<double> values = dense.to_values();
    const std::int64_t columns = dense.spec().shape[1];
    Matrix rows;
    for (std::size_t first = 0; first < values.size(); first += static_cast<std::size_t>(columns)) {
      rows.emplace_back(values.begin() + static_cast<std::ptrdiff_t>(first),
                        values.begin() + static_cast<std::ptrdiff_t>(first + static_cast<std::size_t>(columns)));
    }
    return rows;
  }

  Matrix linear(const Matrix& x, const std::string& prefix, bool bias) const {
    const Matrix w = matrix(prefix);
    const std::vector<double> b = bias ? vector(prefix + ".bias") : std::vector<double>(w.size(), 0.0);
    Matrix y(x.size(), std::vector<double>(w.size()));
    for (std::size_t row = 0; row < x.size(); ++row) {
      for (std::size_t out = 0; out < w.size(); ++out) {
        double sum = 0;
        for (std::size_t in = 0; in < x[row].size(); ++in) sum += x[row][in] * w[out][in];
        y[row][out] = sum + b[out];
      }
    }
    return y;
  }

  static Matrix rms_norm(const Matrix& x, const std::vector<double>& weight, double eps) {
    Matrix y = x;
    for (auto& row : y) {
      double squares = 0;
      for (double value : row) squares += value * value;
      const double inverse = 1 / std::sqrt(squares / static_cast<double>(row.size()) + eps);
      for (std::size_t c = 0; c < row.size(); ++c) row[c] = row[c] * inverse * weight[c];
    }
    return y;
  }

  static void add_into(Matrix& x, const Matrix& y) {
    for (std::size_t row = 0; row < x.size(); ++row) {
      for (std::size_t c = 0; c < x[row].size(); ++c) x[row][c] += y[row][c];
    }
  }

  // transformers' default / llama3 inverse frequencies.
  double frequency(std::int64_t pair, std::int64_t head_dim) const {
    double theta = 10000;
    nlohmann::json scaling;
    if (config_.contains("rope_parameters")) {
      theta = config_["rope_parameters"].value("rope_theta", 10000.0);
      scaling = config_["rope_parameters"];
    } else {
      theta = config_.value("rope_theta", 10000.0);
      if (!config_["rope_scaling"].is_null()) scaling = config_["rope_scaling"];
    }
    const double base = 1 / std::pow(theta, 2.0 * static_cast<double>(pair) / static_cast<double>(head_dim));
    if (scaling.is_null() || scaling.value("rope_type", "default") != "llama3") return base;
    const double factor = scaling["factor"], low = scaling["low_freq_factor"], high = scaling["high_freq_factor"];
    const double context = scaling["original_max_position_embeddings"];
    const double wavelength = 2 * M_PI / base;
    if (wavelength < context / high) return base;
    if (wavelength > context / low) return base / factor;
    const double smooth = (context / wavelength - low) / (high - low);
    return (1 - smooth) * base / factor + smooth * base;
  }

  // rotate_half: x * cos + rotate_half(x) * sin, position = row index.
  void rotate(Matrix& x, std::int64_t heads, std::int64_t head_dim) const {
    const std::int64_t half = head_dim / 2;
    for (std::size_t position = 0; position < x.size(); ++position) {
      for (std::int64_t head = 0; head < heads; ++head) {
        for (std::int64_t pair = 0; pair < half; ++pair) {
          const double angle = static_cast<double>(position) * frequency(pair, head_dim);
          double& a = x[position][head * head_dim + pair];
          double& b = x[position][head * head_dim + pair + half];
          const double rotated_a = a * std::cos(angle) - b * std::sin(angle);
          const double rotated_b = b * std::cos(angle) + a * std::sin(angle);
          a = rotated_a;
          b = rotated_b;
        }
      }
    }
  }

  nlohmann::json config_;
  TensorMap tensors_;
};

// max |a - b| over max |b| of the last `rows` rows.
double relative_error(const std::vector<float>& actual, const Matrix& expected) {
  double error = 0, scale = 0;
  const std::size_t vocab = expected[0].size();
  for (std::size_t row = 0; row < expected.size(); ++row) {
    for (std::size_t c = 0; c < vocab; ++c) {
      error = std::max(error, std::abs(actual[row * vocab + c] - expected[row][c]));
      scale = std::max(scale, std::abs(expected[row][c]));
    }
  }
  return error / scale;
}

struct Variant {
  std::string name;
  ModelArchitecture architecture;
  bool tied;
  int spelling;
  bool llama3;
};

class DecoderModelTest : public ModelDirectoryTest {};

TEST_F(DecoderModelTest, StepGraphMatchesThePerOpOracleForEachArchitecture) {
  std::mt19937_64 generator(testing::model_test_seed());
  const std::vector<Variant> variants = {
      {"llama", ModelArchitecture::llama, false, 4, false},  {"llama_tied", ModelArchitecture::llama, true, 5, false},
      {"qwen2", ModelArchitecture::qwen2, true, 4, false},   {"qwen2_untied", ModelArchitecture::qwen2, false, 5, false},
      {"mistral", ModelArchitecture::mistral, false, 4, false}, {"llama3", ModelArchitecture::llama, false, 5, true}};
  for (const Variant& variant : variants) {
    SCOPED_TRACE(variant.name);
    SynthOptions options;
    options.architecture = variant.architecture;
    options.tie_word_embeddings = variant.tied;
    options.transformers_version = variant.spelling;
    const std::filesystem::path directory = synth(variant.name, options);
    if (variant.llama3) {  // llama3 scaling with a short original context, so all three bands occur
      auto config = nlohmann::json::parse(read_text(directory / "config.json"));
      config["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 8.0},
                                   {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                                   {"original_max_position_embeddings", 64}};
      testing::write_text(directory / "config.json", config.dump());
    }
    const std::vector<std::int32_t> tokens = random_tokens(generator, 7, 256);
    const Matrix expected = OracleModel(directory).logits(tokens);
    const DecoderModel f32 = DecoderModel::load(directory, {DType::f32, {}, 64});
    EXPECT_EQ(f32.config().rope.llama3_scaling, variant.llama3);
    DecodeSession f32_session(f32);
    EXPECT_LE(relative_error(f32_session.feed(tokens), expected), 1e-5);
    const DecoderModel bf16 = DecoderModel::load(directory, {DType::bf16, {}, 64});
    DecodeSession bf16_session(bf16);
    EXPECT_LE(relative_error(bf16_session.feed(tokens), expected), 0.05);
  }
}

TEST_F(DecoderModelTest, IncrementalDecodeEqualsRecomputingThePrefix) {
  std::mt19937_64 generator(testing::model_test_seed() + 1);
  for (ModelArchitecture architecture : {ModelArchitecture::llama, ModelArchitecture::qwen2}) {
    SynthOptions options;
    options.architecture = architecture;
    const DecoderModel model = DecoderModel::load(synth(std::string(architecture_class_name(architecture)), options));
    const std::vector<std::int32_t> tokens = random_tokens(generator, 12, 256);
    DecodeSession incremental(model);
    for (std::size_t length = 1; length <= tokens.size(); ++length) {
      const std::vector<float> step = incremental.feed(std::span<const std::int32_t>(&tokens[length - 1], 1));
      DecodeSession fresh(model);
      const std::vector<float> all = fresh.feed(std::span<const std::int32_t>(tokens.data(), length));
      const std::vector<float> last(all.end() - 256, all.end());
      EXPECT_EQ(step, last) << "prefix length " << length;
    }
  }
}

TEST_F(DecoderModelTest, ChunkedPrefillEqualsTokenByToken) {
  std::mt19937_64 generator(testing::model_test_seed() + 2);
  SynthOptions options;
  options.architecture = ModelArchitecture::mistral;
  const DecoderModel model = DecoderModel::load(synth("mistral", options), {DType::bf16, {}, 40});
  const std::vector<std::int32_t> tokens = random_tokens(generator, 37, 256);
  DecodeSession whole(model);
  const std::vector<float> chunked = whole.feed(tokens);  // steps of 16, 16 and 5
  DecodeSession single(model);
  std::vector<float> one_by_one;
  for (std::int32_t token : tokens) {
    const std::vector<float> step = single.feed(std::span<const std::int32_t>(&token, 1));
    one_by_one.insert(one_by_one.end(), step.begin(), step.end());
  }
  EXPECT_EQ(chunked, one_by_one);
  DecodeSession ragged(model);  // 3 + 11 + 23 (16 + 7)
  std::vector<float> pieces;
  for (auto [first, count] : {std::pair{0, 3}, std::pair{3, 11}, std::pair{14, 23}}) {
    const std::vector<float> part = ragged.feed(std::span<const std::int32_t>(tokens.data() + first, count));
    pieces.insert(pieces.end(), part.begin(), part.end());
  }
  EXPECT_EQ(pieces, one_by_one);
  EXPECT_NE(testing::error_of([&] { ragged.feed(tokens); }).find("past the KV-cache capacity 40"), std::string::npos);
}

// A session's caches grow with its positions (src/model/decoder.cpp): its logits are, to the bit, the
// whole-capacity step graph's, run here chunk by chunk with caches of every row, across each growth
// (128 -> 256 -> 512 -> the capacity 600) and with chunks that straddle one. A step graph of fewer rows
// names the rows its caches take.
TEST_F(DecoderModelTest, GrowingCachesGiveTheWholeCapacitysLogits) {
  std::mt19937_64 generator(testing::model_test_seed() + 9);
  SynthOptions options;
  options.architecture = ModelArchitecture::qwen2;  // biases, grouped heads
  const DecoderModel model = DecoderModel::load(synth("growing", options), {DType::bf16, {}, 600});
  const std::vector<std::int32_t> tokens = random_tokens(generator, 600, 256);
  const ComputeGraph& short_graph = model.step_graph(1, StepOutputs::logits, 128);
  EXPECT_EQ(short_graph.inputs().size(), model.step_graph(1).inputs().size());
  EXPECT_EQ(short_graph.value(*short_graph.find_value("layers.0.k_cache")).spec.shape[1], 128);
  EXPECT_EQ(model.step_graph(1).value(*model.step_graph(1).find_value("layers.0.k_cache")).spec.shape[1], 600);
  EXPECT_NE(testing::error_of([&] { (void)model.step_graph(1, StepOutputs::logits, 601); }).find("1 to 600 rows"), std::string::npos);

  DecodeSession growing(model);
  TensorMap whole;  // the oracle's state: caches of the capacity's rows
  const ModelConfig& config = model.config();
  for (std::int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    for (char which : {'k', 'v'}) {
      whole.insert_or_assign(fmt::format("layers.{}.{}_cache", layer, which),
                             HostTensor(TensorSpec({config.num_key_value_heads, 600, config.head_dim}, DType::bf16)));
    }
  }
  const TensorMap* weights[] = {&model.weights()};
  std::size_t first = 0;
  for (std::size_t count : {100, 20, 16, 9, 16, 140, 1, 1, 200, 97}) {  // 127, 129, 255, 256, 257, 511, 512, 513, 600
    const std::span<const std::int32_t> chunk(tokens.data() + first, count);
    const std::vector<float> logits = growing.feed(chunk);
    std::vector<float> expected;
    for_each_step_chunk(chunk, [&](std::span<const std::int32_t> piece) {
      const auto steps = static_cast<std::int64_t>(piece.size());
      const std::int64_t at = static_cast<std::int64_t>(first) + (piece.data() - chunk.data());
      HostTensor ids(TensorSpec({steps}, DType::i32)), positions(TensorSpec({steps}, DType::i32));
      for (std::int64_t step = 0; step < steps; ++step) {
        const std::int32_t token = piece[static_cast<std::size_t>(step)];
        const auto position = static_cast<std::int32_t>(at + step);
        std::memcpy(ids.bytes().data() + step * 4, &token, 4);
        std::memcpy(positions.bytes().data() + step * 4, &position, 4);
      }
      whole.insert_or_assign("token_ids", std::move(ids));
      whole.insert_or_assign("positions", std::move(positions));
      TensorMap outputs = run_reference(model.step_graph(steps), std::exchange(whole, {}), weights);
      for (std::int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
        for (char which : {'k', 'v'}) {
          const std::string name = fmt::format("layers.{}.{}_cache", layer, which);
          whole.insert_or_assign(name, std::move(outputs.at(name + "_out")));
        }
      }
      const HostTensor& step_logits = outputs.at("logits");
      for (std::int64_t index = 0; index < step_logits.element_count(); ++index) {
        expected.push_back(static_cast<float>(step_logits.at(index)));
      }
    });
    first += count;
    ASSERT_EQ(logits.size(), expected.size());
    EXPECT_EQ(std::memcmp(logits.data(), expected.data(), logits.size() * sizeof(float)), 0) << "after " << first << " tokens";
  }
  EXPECT_EQ(first, tokens.size());
}

TEST_F(DecoderModelTest, SynthRoundTripsThroughBothSpellingsAndShards) {
  std::mt19937_64 generator(testing::model_test_seed() + 3);
  SynthOptions options;
  options.architecture = ModelArchitecture::qwen2;
  const std::filesystem::path four = synth("four", options);
  options.transformers_version = 5;
  const std::filesystem::path five = synth("five", options);
  options.max_shard_mb = 0.05;
  const std::filesystem::path sharded = synth("sharded", options);
  EXPECT_TRUE(std::filesystem::exists(sharded / "model.safetensors.index.json"));
  EXPECT_FALSE(std::filesystem::exists(sharded / "model.safetensors"));
  int shards = 0;
  for (const auto& entry : std::filesystem::directory_iterator(sharded)) {
    shards += entry.path().filename().string().starts_with("model-0000") ? 1 : 0;
  }
  EXPECT_GE(shards, 3);
  EXPECT_NE(read_text(four / "config.json").find("\"rope_theta\""), std::string::npos);
  EXPECT_NE(read_text(five / "config.json").find("\"rope_parameters\""), std::string::npos);

  const ModelConfig expected = synth_config(options);
  const std::vector<std::int32_t> tokens = random_tokens(generator, 5, 256);
  std::vector<float> reference;
  for (const auto& directory : {four, five, sharded}) {
    const DecoderModel model = DecoderModel::load(directory);
    EXPECT_EQ(model.config().hidden_size, expected.hidden_size);
    EXPECT_EQ(model.config().num_key_value_heads, expected.num_key_value_heads);
    EXPECT_EQ(model.config().rope.theta, expected.rope.theta);
    EXPECT_EQ(model.config().rms_norm_eps, expected.rms_norm_eps);
    EXPECT_EQ(model.config().tie_word_embeddings, expected.tie_word_embeddings);
    EXPECT_EQ(model.config().architecture, ModelArchitecture::qwen2);
    DecodeSession session(model);
    const std::vector<float> logits = session.feed(tokens);
    if (reference.empty()) reference = logits;
    EXPECT_EQ(logits, reference) << directory;
  }
  // The weights on disk are the drawn ones: the oracle (read_safetensors) agrees with the model.
  const DecoderModel f32 = DecoderModel::load(sharded, {DType::f32, {}, 0});
  EXPECT_LE(relative_error(DecodeSession(f32).feed(tokens), OracleModel(four).logits(tokens)), 1e-5);
}

// A quantized synthetic checkpoint is drawn and quantized a block of rows at a time on every
// thread: its tensors are quantize_affine (mlx rounding, bf16 scales) of the dense checkpoint's
// weights of the same seed, byte for byte. `small`'s embedding (32000 x 768) is split into
// blocks of 85 rows (32000 is no multiple) and into ranges wherever there are two threads.
TEST_F(DecoderModelTest, SynthQuantizedIsQuantizeAffineOfTheDenseDraw) {
  SynthOptions options;
  options.preset = "small";
  options.layers = 1;
  const std::filesystem::path dense = synth("dense", options);
  options.quantize = AffineQuantization{4, 64};
  const std::filesystem::path quantized = synth("quantized", options);
  const TensorMap weights = read_safetensors(dense / "model.safetensors");
  const TensorMap packed = read_safetensors(quantized / "model.safetensors");
  int compared = 0;
  for (const auto& [name, tensor] : packed) {
    if (!name.ends_with(".scales")) continue;
    const std::string prefix = name.substr(0, name.size() - std::string(".scales").size());
    const QuantizedMatrix expected =
        quantize_affine(weights.at(prefix + ".weight"), *options.quantize, DType::bf16, AffineRounding::mlx);
    EXPECT_EQ(packed.at(prefix + ".weight"), expected.packed) << prefix;
    EXPECT_EQ(tensor, expected.scales) << prefix;
    EXPECT_EQ(packed.at(prefix + ".biases"), expected.biases) << prefix;
    ++compared;
  }
  EXPECT_EQ(compared, 9);  // the embedding, lm_head and one layer's seven linears
  for (const char* name : {"model.norm.weight", "model.layers.0.input_layernorm.weight"}) {
    EXPECT_EQ(packed.at(name), weights.at(name)) << name;
  }
}

// A dense f32 checkpoint whose weights are the dequantized ones of `source`
// (MLX-quantized) or, with `format`, those of quantize_affine at load.
std::filesystem::path dense_copy(const std::filesystem::path& source, const std::filesystem::path& target,
                                 std::optional<AffineQuantization> format) {
  auto config = nlohmann::json::parse(read_text(source / "config.json"));
  TensorMap tensors = read_safetensors(source / "model.safetensors");
  TensorMap dense;
  for (auto& [name, tensor] : tensors) {
    if (name.ends_with(".scales") || name.ends_with(".biases")) continue;
    const std::string prefix = name.substr(0, name.size() - 7);
    HostTensor f32 = HostTensor::from_values(TensorSpec(tensor.spec().shape, DType::f32), tensor.to_values());
    if (tensors.count(prefix + ".scales")) {
      const auto& q = config["quantization"];
      f32 = dequantize_affine(QuantizedMatrix::from_tensors({q["bits"].get<int>(), q["group_size"].get<int>()}, tensor,
                                                            tensors.at(prefix + ".scales"), tensors.at(prefix + ".biases")),
                              DType::f32);
    } else if (format && tensor.spec().rank() == 2) {
      f32 = dequantize_affine(quantize_affine(f32, *format, DType::f32), DType::f32);
    }
    dense.insert_or_assign(name, std::move(f32));
  }
  config.erase("quantization");
  std::filesystem::create_directories(target);
  testing::write_text(target / "config.json", config.dump());
  write_safetensors(target / "model.safetensors", dense);
  return target;
}

TEST_F(DecoderModelTest, MlxQuantizedEqualsDequantizeThenDense) {
  std::mt19937_64 generator(testing::model_test_seed() + 4);
  for (int bits : {4, 8}) {
    for (bool tied : {false, true}) {
      SCOPED_TRACE(std::to_string(bits) + (tied ? " bits tied" : " bits untied"));
      SynthOptions options;
      options.quantize = AffineQuantization{bits, 32};
      options.tie_word_embeddings = tied;
      const std::string name = std::to_string(bits) + (tied ? "t" : "u");
      const std::filesystem::path quantized = synth("q" + name, options);
      const DecoderModel model = DecoderModel::load(quantized, {DType::f32, {}, 0});
      EXPECT_TRUE(model.is_quantized("model.embed_tokens"));
      EXPECT_TRUE(model.is_quantized("model.layers.1.mlp.down_proj"));
      EXPECT_EQ(model.weights().at("model.layers.0.self_attn.q_proj.weight").spec().dtype, DType::u32);
      const std::vector<std::int32_t> tokens = random_tokens(generator, 6, 256);
      DecodeSession quantized_session(model);
      const DecoderModel dense = DecoderModel::load(dense_copy(quantized, root_ / ("d" + name), {}), {DType::f32, {}, 0});
      DecodeSession dense_session(dense);
      const std::vector<float> expected = dense_session.feed(tokens);
      const std::vector<float> actual = quantized_session.feed(tokens);
      Matrix rows(tokens.size(), std::vector<double>(256));
      for (std::size_t index = 0; index < expected.size(); ++index) rows[index / 256][index % 256] = expected[index];
      EXPECT_LE(relative_error(actual, rows), 1e-6);
    }
  }
}

TEST_F(DecoderModelTest, QuantizeAtLoadEqualsQuantizeDequantizeDense) {
  std::mt19937_64 generator(testing::model_test_seed() + 5);
  const std::filesystem::path directory = synth("dense", {});
  const AffineQuantization format{8, 64};
  const DecoderModel quantized = DecoderModel::load(directory, {DType::f32, format, 0});
  EXPECT_TRUE(quantized.is_quantized("lm_head"));
  EXPECT_LT(quantized.weight_bytes(), DecoderModel::load(directory, {DType::f32, {}, 0}).weight_bytes() / 2);
  const DecoderModel dense = DecoderModel::load(dense_copy(directory, root_ / "copy", format), {DType::f32, {}, 0});
  const std::vector<std::int32_t> tokens = random_tokens(generator, 6, 256);
  DecodeSession quantized_session(quantized), dense_session(dense);
  const std::vector<float> expected = dense_session.feed(tokens);
  Matrix rows(tokens.size(), std::vector<double>(256));
  for (std::size_t index = 0; index < expected.size(); ++index) rows[index / 256][index % 256] = expected[index];
  EXPECT_LE(relative_error(quantized_session.feed(tokens), rows), 1e-6);
}

TEST_F(DecoderModelTest, PlannedPathEqualsReferenceAndGenerationIsGreedy) {
  std::mt19937_64 generator(testing::model_test_seed() + 6);
  const DecoderModel model = DecoderModel::load(synth("llama", {}));
  const std::vector<std::int32_t> prompt = random_tokens(generator, 4, 256);
  DecodeSession reference(model, DecodePath::reference), planned(model, DecodePath::planned);
  EXPECT_EQ(reference.feed(prompt), planned.feed(prompt));
  DecodeSession generating(model), checking(model);
  const Generation generation = generate_greedy(generating, prompt, 6);
  ASSERT_EQ(generation.tokens.size(), 6u);
  std::vector<float> logits = checking.feed(prompt);
  for (std::int32_t token : generation.tokens) {
    EXPECT_EQ(token, argmax_index(std::span<const float>(logits).last(256)));
    logits = checking.feed(std::span<const std::int32_t>(&token, 1));
  }
  // More tokens than the caches hold are refused before the first step (the session feeds nothing),
  // also where the count alone would overflow the sum; exactly up to the capacity is fine.
  const std::int64_t capacity = model.capacity();
  for (const std::int64_t count : {capacity - 4 + 2, std::numeric_limits<std::int64_t>::max()}) {
    DecodeSession full(model);
    EXPECT_NE(testing::error_of([&] { generate_greedy(full, prompt, count); }).find("past the KV-cache capacity"),
              std::string::npos)
        << count;
    EXPECT_EQ(full.position(), 0);
  }
  // Exactly at the boundary: a 16-row cache, a 4-token prompt and 13 tokens (the last one is not fed).
  LoadOptions small;
  small.max_sequence = 16;
  const DecoderModel short_model = DecoderModel::load(root_ / "llama", small);
  DecodeSession exact(short_model);
  EXPECT_EQ(generate_greedy(exact, prompt, 16 - 4 + 1).tokens.size(), 13u);
  EXPECT_EQ(exact.position(), 16);
  DecodeSession one_more(short_model);
  EXPECT_THROW(generate_greedy(one_more, prompt, 16 - 4 + 2), InputError);
  EXPECT_EQ(one_more.position(), 0);
  // A session already fed names its position: the count alone did not explain the refusal.
  DecodeSession continued(short_model);
  continued.feed(prompt);
  EXPECT_EQ(testing::error_of([&] { generate_greedy(continued, prompt, 10); }),
            "10 tokens after a 4-token prompt at position 4 would go past the KV-cache capacity 16 (--max-seq)");
  EXPECT_EQ(testing::error_of([&] { generate_greedy(continued, random_tokens(generator, 13, 256), 1); }),
            "a 13-token prompt at position 4 goes past the KV-cache capacity 16 (--max-seq)");
  EXPECT_EQ(continued.position(), 4);
}

// Python looks for Ctrl-C between a prompt's steps: feed_all_but_the_last_step feeds all but the last
// step and hands back the rest, and generate with that rest gives the whole prompt's generation, its
// caches the same to the bit (the next token's logits compared with memcmp), greedy and sampled, for
// prompts around the 16-token step. A refusal comes before any step.
TEST_F(DecoderModelTest, APromptFedAStepAtATimeGeneratesAsTheWholePrompt) {
  std::mt19937_64 generator(testing::model_test_seed() + 11);
  const DecoderModel model = DecoderModel::load(synth("llama", {}), {DType::bf16, {}, 80});
  const std::int64_t vocab = model.config().vocab_size;
  SamplingOptions sampled;
  sampled.temperature = 0.9;
  sampled.seed = generator();
  for (const std::int64_t length : {1, 15, 16, 17, 32, 33, 50}) {
    const std::vector<std::int32_t> prompt = random_tokens(generator, length, vocab);
    for (const SamplingOptions& sampling : {SamplingOptions{}, sampled}) {
      DecodeSession whole(model);
      const Generation expected = generate(whole, prompt, 6, sampling);
      DecodeSession stepped(model);
      int between = 0;
      const std::span<const std::int32_t> rest = feed_all_but_the_last_step(stepped, prompt, 6, [&] { ++between; });
      EXPECT_EQ(between, (length - 1) / 16) << length;
      EXPECT_EQ(static_cast<std::int64_t>(rest.size()), length - 16 * between) << length;
      EXPECT_EQ(rest.data(), prompt.data() + 16 * between);
      EXPECT_EQ(generate(stepped, rest, 6, sampling).tokens, expected.tokens) << length;
      const std::vector<std::int32_t> next = random_tokens(generator, 1, vocab);
      const std::vector<float> after_whole = whole.feed(next);
      const std::vector<float> after_stepped = stepped.feed(next);
      ASSERT_EQ(after_whole.size(), after_stepped.size());
      EXPECT_EQ(std::memcmp(after_whole.data(), after_stepped.data(), after_whole.size() * sizeof(float)), 0) << length;
    }
  }
  const std::vector<std::int32_t> prompt = random_tokens(generator, 40, vocab);
  DecodeSession refused(model);
  int between = 0;
  EXPECT_EQ(testing::error_of([&] { feed_all_but_the_last_step(refused, prompt, 42, [&] { ++between; }); }),
            "42 tokens after a 40-token prompt would go past the KV-cache capacity 80 (--max-seq)");
  EXPECT_EQ(testing::error_of([&] { feed_all_but_the_last_step(refused, prompt, 0, [&] { ++between; }); }),
            "cannot generate 0 tokens (at least 1)");
  EXPECT_EQ(testing::error_of([&] { feed_all_but_the_last_step(refused, {}, 1, [&] { ++between; }); }), "the prompt is empty");
  EXPECT_EQ(refused.position(), 0);
  EXPECT_EQ(between, 0);
}

// Python's logits look for Ctrl-C between steps: feed_a_step_at_a_time gives feed's logits to the bit
// (memcmp) and calls `between` once a step, and what feed would refuse it refuses before any step.
TEST_F(DecoderModelTest, LogitsFedAStepAtATimeAreFeedsLogits) {
  std::mt19937_64 generator(testing::model_test_seed() + 13);
  const DecoderModel model = DecoderModel::load(synth("llama", {}), {DType::bf16, {}, 80});
  const std::int64_t vocab = model.config().vocab_size;
  for (const std::int64_t length : {1, 15, 16, 17, 33, 47}) {
    const std::vector<std::int32_t> tokens = random_tokens(generator, length, vocab);
    DecodeSession whole(model);
    const std::vector<float> expected = whole.feed(tokens);
    DecodeSession stepped(model);
    int between = 0;
    const std::vector<float> logits = feed_a_step_at_a_time(stepped, tokens, [&] { ++between; });
    EXPECT_EQ(between, (length + 15) / 16) << length;  // for_each_step_chunk's pieces of at most 16
    ASSERT_EQ(logits.size(), expected.size()) << length;
    EXPECT_EQ(std::memcmp(logits.data(), expected.data(), logits.size() * sizeof(float)), 0) << length;
    EXPECT_EQ(stepped.position(), length);
  }
  DecodeSession refused(model);
  int between = 0;
  const std::vector<std::int32_t> too_long = random_tokens(generator, 81, vocab);
  EXPECT_EQ(testing::error_of([&] { feed_a_step_at_a_time(refused, too_long, [&] { ++between; }); }),
            "the sequence would reach 81 tokens, past the KV-cache capacity 80 (--max-seq)");
  std::vector<std::int32_t> bad_last = random_tokens(generator, 40, vocab);
  bad_last.back() = static_cast<std::int32_t>(vocab);
  EXPECT_NE(testing::error_of([&] { feed_a_step_at_a_time(refused, bad_last, [&] { ++between; }); }), "(no InputError)");
  EXPECT_EQ(refused.position(), 0);
  EXPECT_EQ(between, 0);
}

// The greedy step graph: "next_tokens" is each row of its logits' argmax (brute force on the
// logits it also returns), its logits are the plain step graph's bit for bit, the CPU plan gives
// the same, and a session's feed_greedy picks the argmax of feed's logits.
TEST_F(DecoderModelTest, StepGraphNextTokensAreTheArgmaxOfItsLogits) {
  std::mt19937_64 generator(testing::model_test_seed() + 7);
  const DecoderModel model = DecoderModel::load(synth("llama", {}), {DType::bf16, {}, 48});
  const std::int64_t vocab = model.config().vocab_size;
  for (std::int64_t steps : {1, 5}) {
    SCOPED_TRACE(steps);
    const ComputeGraph& plain = model.step_graph(steps);
    const ComputeGraph& greedy = model.step_graph(steps, StepOutputs::logits_and_next_tokens);
    EXPECT_FALSE(plain.find_value("next_tokens"));
    ASSERT_EQ(greedy.outputs().size(), plain.outputs().size() + 1);
    EXPECT_EQ(greedy.value(greedy.outputs()[1]).name, "next_tokens");
    EXPECT_EQ(greedy.value(greedy.outputs()[1]).spec, TensorSpec({steps}, DType::i32));
    TensorMap state;
    const std::int64_t start = static_cast<std::int64_t>(generator() % 20);
    std::vector<double> ids, positions;
    for (std::int32_t token : random_tokens(generator, static_cast<std::size_t>(steps), vocab)) ids.push_back(token);
    for (std::int64_t step = 0; step < steps; ++step) positions.push_back(static_cast<double>(start + step));
    state.emplace("token_ids", HostTensor::from_values(TensorSpec({steps}, DType::i32), ids));
    state.emplace("positions", HostTensor::from_values(TensorSpec({steps}, DType::i32), positions));
    for (ValueId input : greedy.inputs()) {  // caches of random earlier rows
      const Value& value = greedy.value(input);
      if (!value.name.ends_with("_cache")) continue;
      std::vector<double> rows(static_cast<std::size_t>(value.spec.element_count()));
      for (double& element : rows) element = static_cast<double>(generator() % 2001) / 1000.0 - 1;
      state.emplace(value.name, HostTensor::from_values(value.spec, rows));
    }
    const TensorMap* inputs[] = {&state, &model.weights()};
    const TensorMap outputs = run_reference(greedy, inputs);
    const HostTensor& logits = outputs.at("logits");
    EXPECT_EQ(logits, run_reference(plain, inputs).at("logits"));
    for (std::int64_t row = 0; row < steps; ++row) {
      std::vector<double> values;
      for (std::int64_t column = 0; column < vocab; ++column) values.push_back(logits.at(row * vocab + column));
      EXPECT_EQ(outputs.at("next_tokens").at(row), static_cast<double>(testing::brute_force_argmax(values)));
    }
    EXPECT_EQ(run_plan_reference(plan_graph_fusion(greedy, FusionTarget::cpu()), inputs).at("next_tokens"),
              outputs.at("next_tokens"));
  }
  const std::vector<std::int32_t> tokens = random_tokens(generator, 19, vocab);  // a chunk of 16 and 3 steps
  DecodeSession by_logits(model), greedy(model);
  const std::vector<float> logits = by_logits.feed(tokens);
  const std::vector<std::int32_t> next = greedy.feed_greedy(tokens);
  ASSERT_EQ(next.size(), tokens.size());
  EXPECT_EQ(greedy.position(), 19);
  for (std::size_t row = 0; row < tokens.size(); ++row) {
    const std::vector<double> values(logits.begin() + static_cast<std::ptrdiff_t>(row * vocab),
                                     logits.begin() + static_cast<std::ptrdiff_t>((row + 1) * vocab));
    EXPECT_EQ(next[row], testing::brute_force_argmax(values)) << "row " << row;
  }
}

}  // namespace
}  // namespace metile

namespace metile::testing {
namespace {

// The step graph's buffers as DeviceValues will share them (alias_of): every cache write in place
// into the caller's cache, the head split/merge transposes free at S = 1 (they move a size-1 axis)
// and real copies at S = 3; reshapes always free.
class StepGraphAliasing : public ModelDirectoryTest {};

TEST_F(StepGraphAliasing, CachesWriteInPlaceAndSizeOneTransposesAreViews) {
  SynthOptions options;
  options.preset = "tiny";
  LoadOptions load;
  load.max_sequence = 32;
  const DecoderModel model = DecoderModel::load(synth("tiny", options), load);
  for (std::int64_t steps : {1, 3}) {
    const ComputeGraph& graph = model.step_graph(steps);
    const std::vector<ValueId> owner = alias_of(graph);
    int cache_writes = 0;
    for (const Node& node : graph.nodes()) {
      const ValueId out = node.outputs[0];
      const ValueId shared = owner[static_cast<std::size_t>(out)];
      if (node.op == "kv_cache_write") {
        ++cache_writes;
        EXPECT_EQ(shared, node.inputs[0]) << node.name;  // the graph input "layers.N.k_cache" itself
        EXPECT_EQ(graph.value(shared).producer, -1);
      }
      if (node.op == "reshape") {
        EXPECT_NE(shared, out) << node.name;
      }
      if (node.op == "transpose") {
        EXPECT_EQ(shared != out, steps == 1) << node.name;
      }
    }
    EXPECT_EQ(cache_writes, 2 * model.config().num_hidden_layers);
  }
}

// A feed that returns every position's logits is refused before any step when they cannot fit this
// machine's memory beside what is held, on either backend (check_logits_fit: the GPU engine's feed held
// each step's bf16 logits and their f32 copy, and ended in std::bad_alloc after all its steps).
TEST_F(DecoderModelTest, LogitsThatCannotFitAreRefusedUpFront) {
  const DecoderModel model = DecoderModel::load(synth("llama", {}));
  const auto memory = static_cast<double>(physical_memory_bytes());
  const std::int64_t vocab = model.config().vocab_size;
  const auto half = static_cast<std::int64_t>(memory / 4 / static_cast<double>(vocab) / 2);
  EXPECT_NO_THROW(check_logits_fit(half, model, 4, 0));
  EXPECT_NO_THROW(check_logits_fit(half, model, 4, memory / 4));
  const auto too_many = static_cast<std::int64_t>(memory / 4 / static_cast<double>(vocab)) + 1;
  const std::string refused = testing::error_of([&] { check_logits_fit(too_many, model, 4, 0); });
  EXPECT_TRUE(refused.starts_with(fmt::format("the logits of {} positions x {} tokens of vocabulary take ", too_many, vocab)))
      << refused;
  EXPECT_TRUE(refused.ends_with(": feed fewer tokens at a time")) << refused;
  EXPECT_NE(testing::error_of([&] { check_logits_fit(half, model, 4, memory * 0.6); }), "(no InputError)");
  EXPECT_NE(testing::error_of([&] { check_logits_fit(half, model, 10, 0); }), "(no InputError)");  // 4 + a copy
}

// The default feed_greedy feeds a step's tokens at a time (16: the sessions step through a prompt so
// anyway) and keeps only each row's argmax: it fed the whole prompt at once, holding every position's
// logits where generate wanted the last token (137 GB for 2048 tokens of a 2^24 vocabulary).
TEST(LogitsSession, FeedGreedyFeedsAStepAtATime) {
  class Recording : public LogitsSession {
   public:
    std::vector<float> feed(std::span<const std::int32_t> tokens) override {
      chunks.push_back(tokens.size());
      std::vector<float> logits(tokens.size() * 5, 0.0f);
      for (std::size_t row = 0; row < tokens.size(); ++row) logits[row * 5 + static_cast<std::size_t>(tokens[row]) % 5] = 1;
      position_ += static_cast<std::int64_t>(tokens.size());
      return logits;
    }
    std::int64_t position() const override { return position_; }
    std::int64_t capacity() const override { return 1000; }
    const std::string& capacity_source() const override { return source_; }
    std::vector<std::size_t> chunks;

   private:
    std::int64_t position_ = 0;
    std::string source_ = "test";
  };
  Recording session;
  std::vector<std::int32_t> tokens;
  std::vector<std::int32_t> expected;
  for (std::int32_t index = 0; index < 40; ++index) {
    tokens.push_back(index * 7);
    expected.push_back(index * 7 % 5);
  }
  EXPECT_EQ(session.feed_greedy(tokens), expected);
  EXPECT_EQ(session.chunks, (std::vector<std::size_t>{16, 16, 8}));
  EXPECT_EQ(session.position(), 40);
  EXPECT_TRUE(session.feed_greedy({}).empty());
}

// for_each_step_chunk cuts a sequence into steps of 16 in order, the last one shorter, and an empty
// sequence into none: the pieces put back together are the sequence.
TEST(StepChunks, ConsecutivePiecesOfAtMostOneStep) {
  for (std::size_t length : {0, 1, 15, 16, 17, 32, 33, 100}) {
    std::vector<std::int32_t> tokens(length);
    for (std::size_t index = 0; index < length; ++index) tokens[index] = static_cast<std::int32_t>(3 * index + 1);
    std::vector<std::int32_t> joined;
    std::vector<std::size_t> sizes;
    for_each_step_chunk(tokens, [&](std::span<const std::int32_t> chunk) {
      sizes.push_back(chunk.size());
      joined.insert(joined.end(), chunk.begin(), chunk.end());
    });
    EXPECT_EQ(joined, tokens) << length;
    EXPECT_EQ(sizes.size(), (length + 15) / 16) << length;
    for (std::size_t piece = 0; piece < sizes.size(); ++piece) {
      EXPECT_EQ(sizes[piece], piece + 1 < sizes.size() ? 16u : length - 16 * piece) << length;
    }
  }
}

// The synthetic checkpoints' draw runs ranges of elements at once, each jumping its stream
// ahead: every split gives the stream of one sequential SplitMix64 (written out here), on
// element counts that no range count and no 2^20 divides.
TEST(DrawUniformBf16, RangesGiveTheSequentialStream) {
  const std::uint64_t seed = metile::testing::test_seed("DrawUniformBf16.RangesGiveTheSequentialStream");
  SplitMix64 walked(seed);
  SplitMix64 jumped(seed);
  for (int draw = 0; draw < 1000; ++draw) walked.next();
  jumped.skip(1000);
  EXPECT_EQ(walked.next(), jumped.next());
  const std::vector<std::vector<std::int64_t>> shapes = {
      {1}, {7}, {3, 333}, {4099}, {(std::int64_t{1} << 20) + 3}, {3, 1 << 20, 1}, {5, 419431}};
  for (const std::vector<std::int64_t>& shape : shapes) {
    HostTensor expected(TensorSpec(shape, DType::bf16));
    const std::uint64_t stream = seed ^ static_cast<std::uint64_t>(shape.front());
    SplitMix64 generator(stream);
    generator.next();  // draw 0 is discarded
    for (std::int64_t index = 0; index < expected.element_count(); ++index) {
      const std::uint16_t bits = f32_to_bf16_bits(0.5f + generator.uniform(-0.25f, 0.75f));
      std::memcpy(expected.bytes().data() + index * 2, &bits, 2);
    }
    for (std::int64_t ranges : {0, 1, 2, 3, 5, 16}) {
      HostTensor drawn(TensorSpec(shape, DType::bf16));
      draw_uniform_bf16(drawn, stream, -0.25f, 0.75f, 0.5f, ranges);
      EXPECT_TRUE(std::ranges::equal(drawn.bytes(), expected.bytes()))
          << drawn.spec().to_string() << " in " << ranges << " ranges";
    }
  }
  HostTensor f32(TensorSpec({4}, DType::f32));
  EXPECT_THROW(draw_uniform_bf16(f32, seed, 0, 1, 0), InputError);
}

// Sampled generation: each token is sample_token's draw from the logits of the sequence so far, in
// order, from one generator seeded as given (replayed here over a second session's logits); a nucleus
// of one token (top-p 1e-300) is the greedy continuation at any temperature; the same seed gives the
// same tokens.
TEST_F(DecoderModelTest, SampledGenerationDrawsFromEachPositionsLogits) {
  std::mt19937_64 generator(testing::model_test_seed() + 11);
  const DecoderModel model = DecoderModel::load(synth("llama", {}));
  const std::vector<std::int32_t> prompt = random_tokens(generator, 5, 256);
  SamplingOptions sampling;
  sampling.temperature = 1.3;
  sampling.top_k = 50;
  sampling.top_p = 0.9;
  sampling.seed = generator();
  DecodeSession sampled(model), again(model), checking(model);
  const Generation generation = generate(sampled, prompt, 8, sampling);
  ASSERT_EQ(generation.tokens.size(), 8u);
  EXPECT_EQ(generate(again, prompt, 8, sampling).tokens, generation.tokens);
  std::mt19937_64 replay(sampling.seed);
  // Fed as generate feeds it: the prompt but its last token, then that token's step alone.
  checking.feed(std::span<const std::int32_t>(prompt).first(prompt.size() - 1));
  std::vector<float> logits = checking.feed(std::span<const std::int32_t>(prompt).last(1));
  for (std::int32_t token : generation.tokens) {
    EXPECT_EQ(token, sample_token(std::span<const float>(logits).last(256), sampling, replay));
    logits = checking.feed(std::span<const std::int32_t>(&token, 1));
  }
  DecodeSession top_one(model), greedy(model);
  sampling.top_p = 1e-300;
  EXPECT_EQ(generate(top_one, prompt, 8, sampling).tokens, generate_greedy(greedy, prompt, 8).tokens);
  DecodeSession refused(model);
  sampling.temperature = -0.5;
  EXPECT_EQ(testing::error_of([&] { generate(refused, prompt, 8, sampling); }),
            "temperature -0.5 must be a finite number >= 0 (0: greedy)");
  EXPECT_EQ(refused.position(), 0);
}

// feed_top_k (what sampled generation feeds through) keeps what top_logits keeps of the last row of the
// same tokens' logits, for top-k from 0 (every token) past the vocabulary, and moves the position as feed
// does; it refuses a bad last token, a sequence past the cache and a negative top-k before any step.
TEST_F(DecoderModelTest, FeedTopKKeepsWhatTopLogitsKeepsOfTheLastRow) {
  std::mt19937_64 generator(testing::model_test_seed() + 13);
  const DecoderModel model = DecoderModel::load(synth("llama", {}));
  const std::int64_t vocab = model.config().vocab_size;
  const std::vector<std::int32_t> prompt = random_tokens(generator, 5, vocab);
  for (std::int64_t top_k : {std::int64_t{0}, std::int64_t{1}, std::int64_t{7}, vocab - 1, vocab, vocab + 40}) {
    SCOPED_TRACE(::testing::Message() << "top_k " << top_k);
    DecodeSession selecting(model), feeding(model);
    const std::vector<TokenLogit> kept = selecting.feed_top_k(prompt, top_k);
    const std::vector<float> logits = feeding.feed(prompt);
    EXPECT_EQ(kept, top_logits(std::span<const float>(logits).last(static_cast<std::size_t>(vocab)), top_k));
    EXPECT_EQ(selecting.position(), 5);
  }
  DecodeSession refused(model);
  std::vector<std::int32_t> bad_last = prompt;
  bad_last.back() = static_cast<std::int32_t>(vocab);
  EXPECT_EQ(testing::error_of([&] { refused.feed_top_k(bad_last, 5); }),
            fmt::format("token id {} is outside the vocabulary [0, {})", vocab, vocab));
  EXPECT_EQ(testing::error_of([&] { refused.feed_top_k(prompt, -1); }), "top_k -1 must be >= 0 (0: every token)");
  EXPECT_EQ(testing::error_of([&] { refused.feed_top_k({}, 5); }), "no token to feed");
  const std::vector<std::int32_t> too_long(static_cast<std::size_t>(refused.capacity() + 1), 1);
  EXPECT_THROW(refused.feed_top_k(too_long, 5), InputError);
  EXPECT_EQ(refused.position(), 0);
}

// Generation ends after a stop token: the tokens are those of the same generation without stop tokens,
// up to and including the first that is one (transformers keeps its EOS), for greedy and sampled
// decoding; a stop token never produced changes nothing. The stop sets are drawn from the unstopped
// continuation, so each one ends it somewhere (or nowhere) the oracle finds by a plain scan.
TEST_F(DecoderModelTest, GenerationEndsAfterTheFirstStopToken) {
  std::mt19937_64 generator(testing::model_test_seed() + 12);
  const DecoderModel model = DecoderModel::load(synth("llama", {}));
  const std::vector<std::int32_t> prompt = random_tokens(generator, 4, 256);
  for (const double temperature : {0.0, 0.8}) {
    SamplingOptions sampling;
    sampling.temperature = temperature;
    if (temperature > 0) sampling.seed = generator();
    DecodeSession full(model);
    const std::vector<std::int32_t> unstopped = generate(full, prompt, 12, sampling).tokens;
    ASSERT_EQ(unstopped.size(), 12u);
    for (int trial = 0; trial < 6; ++trial) {
      std::vector<std::int64_t> stop_tokens = {unstopped[generator() % unstopped.size()], 256 + trial};
      if (trial == 0) stop_tokens = {300};  // outside the vocabulary: never produced
      std::shuffle(stop_tokens.begin(), stop_tokens.end(), generator);
      std::size_t end = 0;
      while (end < unstopped.size() &&
             std::find(stop_tokens.begin(), stop_tokens.end(), unstopped[end]) == stop_tokens.end()) {
        ++end;
      }
      const bool stops = end < unstopped.size();
      const std::vector<std::int32_t> want(unstopped.begin(), unstopped.begin() + (stops ? end + 1 : end));
      DecodeSession session(model);
      std::int64_t calls = 0;
      const Generation generation =
          generate(session, prompt, 12, sampling, stop_tokens, [&](std::int64_t) { ++calls; });
      EXPECT_EQ(generation.tokens, want) << "temperature " << temperature << ", trial " << trial;
      EXPECT_EQ(generation.stopped, stops);
      EXPECT_EQ(calls, static_cast<std::int64_t>(want.size()));
      EXPECT_EQ(generation.decode_steps, static_cast<std::int64_t>(want.size()) - 1);
      // The session holds the prompt and every token but the last (which ended it or was the count's).
      EXPECT_EQ(session.position(), static_cast<std::int64_t>(prompt.size() + want.size() - 1));
    }
    // The ends, fixed: the first token a stop token (one token, no decode step), and the last one
    // (all of count, and stopped, since it is a stop token) where it appears nowhere before.
    DecodeSession first(model);
    const std::vector<std::int64_t> first_stop = {unstopped.front()};
    const Generation at_first = generate(first, prompt, 12, sampling, first_stop);
    EXPECT_EQ(at_first.tokens, std::vector<std::int32_t>{unstopped.front()});
    EXPECT_TRUE(at_first.stopped);
    EXPECT_EQ(at_first.decode_steps, 0);
    if (std::count(unstopped.begin(), unstopped.end(), unstopped.back()) == 1) {
      DecodeSession last(model);
      const std::vector<std::int64_t> last_stop = {unstopped.back()};
      const Generation at_last = generate(last, prompt, 12, sampling, last_stop);
      EXPECT_EQ(at_last.tokens, unstopped);
      EXPECT_TRUE(at_last.stopped);
    }
  }
}

// continue_greedy (LogitsSession's default; the GPU engine's own is checked against it on the device):
// each token the argmax after the one before, fed a step at a time; the position moves by the tokens
// returned; a stop token ends it and is kept; on_token sees each token as it comes.
TEST_F(DecoderModelTest, GreedyContinuationFeedsEachChosenToken) {
  std::mt19937_64 generator(testing::model_test_seed() + 13);
  const DecoderModel model = DecoderModel::load(synth("llama", {}));
  const std::vector<std::int32_t> prompt = random_tokens(generator, 5, 256);
  DecodeSession stepped(model);
  std::int32_t token = stepped.feed_greedy(prompt).back();
  const std::int32_t first = token;
  std::vector<std::int32_t> want;
  for (int step = 0; step < 10; ++step) {
    token = static_cast<std::int32_t>(argmax_index(stepped.feed(std::span<const std::int32_t>(&token, 1))));
    want.push_back(token);
  }
  DecodeSession session(model);
  session.feed_greedy(prompt);
  std::vector<std::int32_t> streamed;
  EXPECT_EQ(session.continue_greedy(first, 10, {}, [&](std::int32_t next) { streamed.push_back(next); }), want);
  EXPECT_EQ(streamed, want);
  EXPECT_EQ(session.position(), static_cast<std::int64_t>(prompt.size()) + 10);
  EXPECT_TRUE(session.continue_greedy(first, 0).empty());
  EXPECT_EQ(session.position(), static_cast<std::int64_t>(prompt.size()) + 10);
  // One token past the cache, a count whose sum with the position overflows, a negative count: refused
  // before any step, the position where it was. The whole room is not.
  const std::int64_t room = session.capacity() - session.position();
  for (const std::int64_t count : {room + 1, std::numeric_limits<std::int64_t>::max(), std::int64_t{-1}}) {
    EXPECT_THROW(session.continue_greedy(first, count), InputError) << count;
    EXPECT_EQ(session.position(), static_cast<std::int64_t>(prompt.size()) + 10);
  }
  DecodeSession full(model);
  full.feed_greedy(prompt);
  EXPECT_EQ(full.continue_greedy(first, full.capacity() - full.position()).size(),
            static_cast<std::size_t>(full.capacity()) - prompt.size());
  EXPECT_EQ(full.position(), full.capacity());
  const std::size_t stop_at = generator() % want.size();
  const std::size_t first_stop = static_cast<std::size_t>(std::find(want.begin(), want.end(), want[stop_at]) - want.begin());
  DecodeSession stopped(model);
  stopped.feed_greedy(prompt);
  const std::vector<std::int64_t> stop_tokens = {want[stop_at]};
  EXPECT_EQ(stopped.continue_greedy(first, 10, stop_tokens),
            std::vector<std::int32_t>(want.begin(), want.begin() + static_cast<std::ptrdiff_t>(first_stop) + 1));
  EXPECT_EQ(stopped.position(), static_cast<std::int64_t>(prompt.size() + first_stop) + 1);
}

// eos_token_id as transformers 5's generate reads it (transformers 5.17 on the device, session 39, for
// absent, null, a list, and a generation_config.json with and without the key): absent or null none (4
// took Llama's and Mistral's absent one as 2); one id or a list; anything else refused naming the field.
// A generation_config.json takes config.json's place at load wholly (from_pretrained's generation
// config: without the key, no end-of-sequence token); synthetic checkpoints have none.
TEST_F(DecoderModelTest, EndOfSequenceTokensFollowTransformers) {
  using Json = nlohmann::json;
  const auto parse = [](ModelArchitecture architecture, const std::function<void(Json&)>& edit) {
    SynthOptions options;
    options.architecture = architecture;
    Json json = Json::parse(synth_config(options).to_json());
    json.erase("eos_token_id");
    edit(json);
    return ModelConfig::parse_json(json.dump(), "config.json").eos_token_ids;
  };
  using Ids = std::vector<std::int64_t>;
  for (ModelArchitecture architecture : {ModelArchitecture::llama, ModelArchitecture::qwen2, ModelArchitecture::mistral}) {
    EXPECT_EQ(parse(architecture, [](Json&) {}), Ids{});
    EXPECT_EQ(parse(architecture, [](Json& c) { c["eos_token_id"] = nullptr; }), Ids{});
    EXPECT_EQ(parse(architecture, [](Json& c) { c["eos_token_id"] = 151645; }), Ids{151645});
    EXPECT_EQ(parse(architecture, [](Json& c) { c["eos_token_id"] = {128001, 128008, 128009}; }),
              (Ids{128001, 128008, 128009}));
    EXPECT_EQ(parse(architecture, [](Json& c) { c["eos_token_id"] = Json::array(); }), Ids{});
  }
  const std::string rule = "config.json: field 'eos_token_id': must be a token id (0 to 2^31 - 1) or a list of them, got ";
  for (const Json& bad : {Json(-1), Json(2.0), Json(2.5), Json("2"), Json(true), Json(std::int64_t{1} << 31)}) {
    EXPECT_EQ(error_of([&] { parse(ModelArchitecture::llama, [&](Json& c) { c["eos_token_id"] = bad; }); }),
              rule + bad.dump())
        << bad.dump();
  }
  // In a list, the element is named by its index (an excerpt of a long list may not reach it).
  Json long_list = Json::array();
  for (int index = 0; index < 5000; ++index) long_list.push_back(index);
  long_list.push_back(-5);
  for (const auto& [bad, index] : std::vector<std::pair<Json, std::string>>{
           {Json{1, "x"}, "\"x\" at index 1"}, {Json{Json::array()}, "[] at index 0"}, {long_list, "-5 at index 5000"}}) {
    EXPECT_EQ(error_of([&] { parse(ModelArchitecture::qwen2, [&](Json& c) { c["eos_token_id"] = bad; }); }),
              rule + index);
  }
  EXPECT_EQ(synth_config({}).eos_token_ids, Ids{});

  const std::filesystem::path directory = synth("eos", {});
  EXPECT_EQ(DecoderModel::load(directory).config().eos_token_ids, Ids{});
  Json config = Json::parse(read_text(directory / "config.json"));
  config["eos_token_id"] = 5;
  write_text(directory / "config.json", config.dump());
  EXPECT_EQ(DecoderModel::load(directory).config().eos_token_ids, Ids{5});
  write_text(directory / "generation_config.json", R"({"do_sample": true, "temperature": 0.6})");
  EXPECT_EQ(DecoderModel::load(directory).config().eos_token_ids, Ids{});
  write_text(directory / "generation_config.json", R"({"bos_token_id": 1, "eos_token_id": [7, 9]})");
  EXPECT_EQ(DecoderModel::load(directory).config().eos_token_ids, (Ids{7, 9}));
  write_text(directory / "generation_config.json", R"({"eos_token_id": null})");
  EXPECT_EQ(DecoderModel::load(directory).config().eos_token_ids, Ids{});
  // One that cannot be read as a generation config is passed over, as from_pretrained passes over an
  // error loading it, with one warning: config.json's tokens stand (logits and verify-model need none).
  const std::string path = (directory / "generation_config.json").string();
  const auto load_warning = [&](std::vector<std::int64_t>& ids) {
    std::vector<std::string> warnings;
    LoadOptions options;
    options.warn = [&](const std::string& line) { warnings.push_back(line); };
    ids = DecoderModel::load(directory, options).config().eos_token_ids;
    return warnings.size() == 1 ? warnings[0] : fmt::format("{} warnings", warnings.size());
  };
  const std::string instead = "; generation ends at config.json's eos_token_id instead (5)";
  Ids ids;
  write_text(directory / "generation_config.json", R"({"eos_token_id": "</s>"})");
  EXPECT_EQ(load_warning(ids),
            path + ": field 'eos_token_id': must be a token id (0 to 2^31 - 1) or a list of them, got \"</s>\"" + instead);
  EXPECT_EQ(ids, Ids{5});
  write_text(directory / "generation_config.json", "[1]");
  EXPECT_EQ(load_warning(ids), path + ": not a JSON object" + instead);
  EXPECT_EQ(ids, Ids{5});
  std::filesystem::remove(directory / "generation_config.json");
  std::filesystem::create_directory(directory / "generation_config.json");
  EXPECT_EQ(load_warning(ids).rfind(path + ": ", 0), 0u);
  EXPECT_EQ(ids, Ids{5});
  std::filesystem::remove(directory / "generation_config.json");
  std::filesystem::create_symlink(directory / "missing.json", directory / "generation_config.json");
  EXPECT_NE(load_warning(ids).find("a symbolic link to"), std::string::npos);
  EXPECT_EQ(ids, Ids{5});
  std::filesystem::remove(directory / "generation_config.json");
  EXPECT_EQ(load_warning(ids), "0 warnings");
  // Without a warn, passed over without a word (LoadOptions::warn empty: nothing is said).
  write_text(directory / "generation_config.json", "{");
  LoadOptions silent;
  silent.warn = {};
  EXPECT_EQ(DecoderModel::load(directory, silent).config().eos_token_ids, Ids{5});
  config["eos_token_id"] = nullptr;
  write_text(directory / "config.json", config.dump());
  EXPECT_EQ(load_warning(ids), path + ": " + error_of([] { ModelConfig().read_generation_config("{", "x"); }).substr(3) +
                                   "; generation ends at config.json's eos_token_id instead (none)");
}

// The sliding window as transformers reads config.json: MistralConfig and Qwen2Config default it to
// 4096 when the field is absent (an explicit null is no window), and Qwen2 slides only layers
// max_window_layers (default 28) and up. Before, an absent field meant no window, so a Mistral
// config without one ran past 4096 positions with full attention where transformers slides.
TEST(ModelConfigSlidingWindow, FollowsTransformersDefaults) {
  const auto parse = [](ModelArchitecture architecture, const std::function<void(nlohmann::json&)>& edit) {
    SynthOptions options;
    options.architecture = architecture;
    nlohmann::json json = nlohmann::json::parse(synth_config(options).to_json());
    json.erase("sliding_window");
    edit(json);
    return ModelConfig::parse_json(json.dump(), "config.json");
  };
  using Json = nlohmann::json;
  EXPECT_EQ(parse(ModelArchitecture::mistral, [](Json&) {}).sliding_window, 4096);
  EXPECT_EQ(parse(ModelArchitecture::mistral, [](Json& c) { c["sliding_window"] = nullptr; }).sliding_window, std::nullopt);
  EXPECT_EQ(parse(ModelArchitecture::mistral, [](Json& c) { c["sliding_window"] = 512; }).sliding_window, 512);
  EXPECT_EQ(parse(ModelArchitecture::llama, [](Json&) {}).sliding_window, std::nullopt);
  // use_sliding_window is Qwen2Config's: LlamaConfig has no window (one capped a Llama's capacity).
  EXPECT_EQ(parse(ModelArchitecture::llama, [](Json& c) {
              c["use_sliding_window"] = true;
              c["sliding_window"] = 64;
            }).sliding_window,
            std::nullopt);
  // Qwen2: only with use_sliding_window, and only where some layer is at or past max_window_layers.
  EXPECT_EQ(parse(ModelArchitecture::qwen2, [](Json& c) { c["use_sliding_window"] = false; }).sliding_window, std::nullopt);
  EXPECT_EQ(parse(ModelArchitecture::qwen2, [](Json& c) {
              c["use_sliding_window"] = true;
              c["max_window_layers"] = 0;
            }).sliding_window,
            4096);
  EXPECT_EQ(parse(ModelArchitecture::qwen2, [](Json& c) {
              c["use_sliding_window"] = true;
              c["sliding_window"] = 64;
              c["max_window_layers"] = c["num_hidden_layers"];
            }).sliding_window,
            std::nullopt);
  EXPECT_EQ(parse(ModelArchitecture::qwen2, [](Json& c) {
              c["use_sliding_window"] = true;
              c["sliding_window"] = 64;
              c.erase("max_window_layers");  // 28 by default: past this model's layers
            }).sliding_window,
            std::nullopt);
  EXPECT_EQ(parse(ModelArchitecture::qwen2, [](Json& c) {
              c["use_sliding_window"] = true;
              c["sliding_window"] = 64;
              c["max_window_layers"] = 9223372036854775808ULL;  // past int64: past every layer, as in transformers
            }).sliding_window,
            std::nullopt);
  EXPECT_EQ(error_of([&] {
              parse(ModelArchitecture::qwen2, [](Json& c) {
                c["use_sliding_window"] = true;
                c["max_window_layers"] = -1;
              });
            }),
            "config.json: field 'max_window_layers': must be a non-negative integer, got -1");
  // An explicit layer_types (Qwen2Config, transformers >= 4.53) is taken as given, max_window_layers aside:
  // a window read nowhere ran the model unwindowed, its logits those of the model without one.
  const auto with_layer_types = [&](const std::vector<std::string>& types, bool use_sliding_window) {
    return parse(ModelArchitecture::qwen2, [&](Json& c) {
      c["use_sliding_window"] = use_sliding_window;
      c["sliding_window"] = 4;
      c["max_window_layers"] = 28;
      c["layer_types"] = types;
    });
  };
  const std::int64_t layers = parse(ModelArchitecture::qwen2, [](Json&) {}).num_hidden_layers;
  ASSERT_GE(layers, 2);
  std::vector<std::string> types(static_cast<std::size_t>(layers), "full_attention");
  EXPECT_EQ(with_layer_types(types, true).sliding_window, std::nullopt);
  types.back() = "sliding_attention";
  EXPECT_EQ(with_layer_types(types, true).sliding_window, 4);
  EXPECT_EQ(with_layer_types(types, false).sliding_window, std::nullopt);  // transformers: a window of None
  types.back() = "chunked_attention";
  EXPECT_EQ(error_of([&] { with_layer_types(types, true); }),
            "config.json: field 'layer_types': each must be \"full_attention\" or \"sliding_attention\", got \"chunked_attention\"");
  types.pop_back();
  EXPECT_NE(error_of([&] { with_layer_types(types, true); }).find("field 'layer_types': must be a list of"), std::string::npos);
}

// max_position_embeddings written as a whole real (4096.0, as some exported configs write it and
// transformers reads it) is that count; a fraction or a non-number is refused naming the field.
TEST(ModelConfigPositions, MaxPositionEmbeddingsMayBeAWholeReal) {
  const auto parse = [](const nlohmann::json& value) {
    nlohmann::json json = nlohmann::json::parse(synth_config(SynthOptions{}).to_json());
    json["max_position_embeddings"] = value;
    return ModelConfig::parse_json(json.dump(), "config.json");
  };
  EXPECT_EQ(parse(4096.0).max_position_embeddings, 4096);
  EXPECT_EQ(parse(131072).max_position_embeddings, 131072);
  EXPECT_EQ(error_of([&] { parse(4096.5); }),
            "config.json: field 'max_position_embeddings': must be a positive whole number, got 4096.5");
  EXPECT_EQ(error_of([&] { parse("4096"); }),
            "config.json: field 'max_position_embeddings': must be a positive number, got \"4096\"");
  EXPECT_EQ(error_of([&] { parse(0); }),
            "config.json: field 'max_position_embeddings': must be a positive number, got 0");
  // Absent: transformers' default for the architecture (LlamaConfig 2048, Qwen2Config 32768,
  // MistralConfig 131072), not one number for all.
  for (const auto& [architecture, positions] : {std::pair{ModelArchitecture::llama, 2048},
                                                std::pair{ModelArchitecture::qwen2, 32768},
                                                std::pair{ModelArchitecture::mistral, 131072}}) {
    SynthOptions options;
    options.architecture = architecture;
    nlohmann::json json = nlohmann::json::parse(synth_config(options).to_json());
    json.erase("max_position_embeddings");
    EXPECT_EQ(ModelConfig::parse_json(json.dump(), "config.json").max_position_embeddings, positions)
        << architecture_class_name(architecture);
  }
}

// num_key_value_heads absent: transformers' default for the architecture (LlamaConfig the query head
// count, Qwen2Config 32, MistralConfig 8: a Mistral checkpoint of 16 heads and 8 KV heads that
// transformers loads was refused, its k_proj taken for 16 heads); an explicit null is the query head
// count in all three; a default that does not divide the heads is named as the default.
TEST(ModelConfigHeads, AbsentKeyValueHeadsTakeTransformersDefaults) {
  const auto parse = [](ModelArchitecture architecture, std::int64_t heads, std::optional<nlohmann::json> kv_heads) {
    SynthOptions options;
    options.architecture = architecture;
    nlohmann::json json = nlohmann::json::parse(synth_config(options).to_json());
    json["num_attention_heads"] = heads;
    json["head_dim"] = 8;
    json.erase("num_key_value_heads");
    if (kv_heads) json["num_key_value_heads"] = *kv_heads;
    return ModelConfig::parse_json(json.dump(), "config.json");
  };
  EXPECT_EQ(parse(ModelArchitecture::llama, 16, std::nullopt).num_key_value_heads, 16);
  EXPECT_EQ(parse(ModelArchitecture::mistral, 16, std::nullopt).num_key_value_heads, 8);
  EXPECT_EQ(parse(ModelArchitecture::qwen2, 64, std::nullopt).num_key_value_heads, 32);
  for (ModelArchitecture architecture : {ModelArchitecture::llama, ModelArchitecture::qwen2, ModelArchitecture::mistral}) {
    EXPECT_EQ(parse(architecture, 12, nlohmann::json(nullptr)).num_key_value_heads, 12) << model_type_name(architecture);
    EXPECT_EQ(parse(architecture, 12, nlohmann::json(4)).num_key_value_heads, 4) << model_type_name(architecture);
  }
  EXPECT_EQ(error_of([&] { parse(ModelArchitecture::mistral, 12, std::nullopt); }),
            "config.json: field 'num_key_value_heads': 8 (absent: transformers' default for mistral) does not divide "
            "num_attention_heads 12");
}

// to_json writes what parse_json reads back, in both spellings: windows (Mistral's, Qwen2's), a Qwen2
// head_dim apart from hidden / heads, llama3 RoPE, MLX quantization, f32, end-of-sequence tokens. (synth-model writes
// config.json with it; the window and the Qwen2 head_dim were dropped.) fuzz/fuzz_model_config.cpp
// holds every config it parses to the same.
TEST(ModelConfigJson, ToJsonReadsBackAsTheSameConfig) {
  std::vector<ModelConfig> configs;
  for (ModelArchitecture architecture : {ModelArchitecture::llama, ModelArchitecture::qwen2, ModelArchitecture::mistral}) {
    SynthOptions options;
    options.architecture = architecture;
    ModelConfig config = synth_config(options);
    configs.push_back(config);
    if (architecture != ModelArchitecture::llama) {
      config.sliding_window = 48;
      configs.push_back(config);
    }
    config.head_dim = 2 * config.hidden_size / config.num_attention_heads;
    config.rope = RopeParameters{500000, true, 32, 1, 4, 4096};
    config.quantization = AffineQuantization{8, 32};
    config.dtype = DType::f32;
    config.rms_norm_eps = 1.0 / 3;
    config.eos_token_ids = {2};
    configs.push_back(config);
    config.eos_token_ids = {128001, 128008, 128009};
    configs.push_back(config);
  }
  for (const ModelConfig& config : configs) {
    for (int version : {4, 5}) {
      const std::string text = config.to_json(version);
      EXPECT_TRUE(ModelConfig::parse_json(text, "written") == config) << text;
    }
  }
}

}  // namespace
}  // namespace metile::testing
