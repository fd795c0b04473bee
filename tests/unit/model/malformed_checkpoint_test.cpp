// Every malformed-checkpoint case: DecoderModel::load throws an InputError naming
// the file and the tensor or config field, and `metile logits` prints that one
// line with exit 2 and writes nothing to stdout. Each case starts from a valid
// tiny checkpoint and breaks one thing.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <thread>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "metile/io.h"
#include "model_test_support.h"

namespace metile {
namespace {

using testing::read_text;
using Json = nlohmann::json;

struct Breakage {
  std::string name;
  std::function<void(const std::filesystem::path&)> apply;
  std::string message;  // a fragment the one-line error must contain
};

void edit_config(const std::filesystem::path& directory, const std::function<void(Json&)>& edit) {
  Json config = Json::parse(read_text(directory / "config.json"));
  edit(config);
  testing::write_text(directory / "config.json", config.dump());
}

void edit_tensors(const std::filesystem::path& directory, const std::function<void(TensorMap&)>& edit) {
  TensorMap tensors = read_safetensors(directory / "model.safetensors");
  edit(tensors);
  write_safetensors(directory / "model.safetensors", tensors);
}

// Appends a tensor of any dtype string of the format (those metile does not read too) to the
// directory's model.safetensors: the header gains the entry, the data its bytes.
void append_raw_tensor(const std::filesystem::path& directory, const std::string& name, const std::string& dtype,
                       const std::vector<std::int64_t>& shape, std::size_t bytes) {
  const std::filesystem::path path = directory / "model.safetensors";
  const std::string file = read_text(path);
  std::uint64_t header_bytes = 0;
  for (int index = 7; index >= 0; --index) header_bytes = (header_bytes << 8) | static_cast<unsigned char>(file[index]);
  Json header = Json::parse(file.substr(8, header_bytes));
  std::string data = file.substr(8 + header_bytes);
  header[name] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {data.size(), data.size() + bytes}}};
  data += std::string(bytes, '\x01');
  const std::string text = header.dump();
  std::string out(8, '\0');
  for (int index = 0; index < 8; ++index) out[index] = static_cast<char>((text.size() >> (8 * index)) & 0xFF);
  testing::write_text(path, out + text + data);
}

class MalformedCheckpoint : public testing::ModelDirectoryTest {
 protected:
  int run_logits(const std::filesystem::path& directory, std::string& out, std::string& err) {
    return run_metile("logits " + directory.string() + " --prompt-ids 1,2", out, err);
  }
};

TEST_F(MalformedCheckpoint, EachCaseIsOneLineNamingTheTensorOrFieldAndExit2) {
  const std::string layer = "model.layers.1.";
  const std::vector<Breakage> cases = {
      {"missing_tensor", [&](auto d) { edit_tensors(d, [&](TensorMap& t) { t.erase(layer + "mlp.up_proj.weight"); }); },
       "tensor 'model.layers.1.mlp.up_proj.weight' is missing"},
      {"misshapen_tensor",
       [&](auto d) {
         edit_tensors(d, [&](TensorMap& t) {
           t.insert_or_assign(layer + "self_attn.k_proj.weight", HostTensor(TensorSpec({16, 64}, DType::bf16)));
         });
       },
       "tensor 'model.layers.1.self_attn.k_proj.weight': shape [16, 64] does not match the config (expected [32, 64])"},
      {"integer_tensor",
       [&](auto d) {
         edit_tensors(d, [](TensorMap& t) { t.insert_or_assign("model.norm.weight", HostTensor(TensorSpec({64}, DType::i32))); });
       },
       "tensor 'model.norm.weight': dtype i32 is not a float"},
      {"untied_without_lm_head", [](auto d) { edit_tensors(d, [](TensorMap& t) { t.erase("lm_head.weight"); }); },
       "tensor 'lm_head.weight' is missing"},
      {"unknown_architecture", [](auto d) { edit_config(d, [](Json& c) { c["architectures"] = {"GPT2LMHeadModel"}; }); },
       "field 'architectures': 'GPT2LMHeadModel' is not supported"},
      {"unknown_rope_type",
       [](auto d) { edit_config(d, [](Json& c) { c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; }); },
       "field 'rope_scaling.rope_type': 'yarn' is not supported"},
      // The older key "type" (transformers 4.3x, many Llama 2 fine-tunes): the error named 'rope_scaling.rope_type',
      // a field the file does not have.
      {"unknown_rope_type_older_key",
       [](auto d) { edit_config(d, [](Json& c) { c["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}}; }); },
       "field 'rope_scaling.type': 'linear' is not supported (default or llama3)"},
      // Both spellings, disagreeing: transformers 4's configs take "type", later code reads rope_type first.
      {"rope_type_and_older_key_disagree",
       [](auto d) {
         edit_config(d, [](Json& c) {
           c["rope_scaling"] = {{"rope_type", "llama3"}, {"type", "linear"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                                {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
         });
       },
       "field 'rope_scaling.type': 'linear' disagrees with rope_type 'llama3' (give one of them)"},
      {"rope_type_older_key_not_a_string",
       [](auto d) { edit_config(d, [](Json& c) { c["rope_scaling"] = {{"type", 2}}; }); },
       "field 'rope_scaling.type': must be a string, got 2"},
      {"unknown_rope_type_5",
       [](auto d) {
         edit_config(d, [](Json& c) { c["rope_parameters"] = {{"rope_type", "dynamic"}, {"rope_theta", 1e4}}; });
       },
       "field 'rope_parameters.rope_type': 'dynamic' is not supported"},
      // Ignored, it loaded a model that rotates every dimension of each head where the config asks for half.
      {"partial_rotary_factor", [](auto d) { edit_config(d, [](Json& c) { c["partial_rotary_factor"] = 0.5; }); },
       "field 'partial_rotary_factor': only 1 is supported (rotary embeddings over the whole head), got 0.5"},
      {"partial_rotary_factor_5",
       [](auto d) {
         edit_config(d, [](Json& c) {
           c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e4}, {"partial_rotary_factor", 0.25}};
         });
       },
       "field 'rope_parameters.partial_rotary_factor': only 1 is supported"},
      // transformers 5's rope_parameters beside a transformers 4 rope_scaling that says otherwise: the
      // llama3 scaling was dropped for rope_parameters' default without a word.
      {"rope_scaling_contradicts_rope_parameters",
       [](auto d) {
         edit_config(d, [](Json& c) {
           c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e4}};
           c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                                {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
         });
       },
       "config.json: field 'rope_scaling': contradicts rope_parameters (give one of the two)"},
      // The same for rope_theta: rope_parameters' was used and the top-level one, which transformers 4 reads,
      // ignored.
      {"rope_theta_contradicts_rope_parameters",
       [](auto d) {
         edit_config(d, [](Json& c) {
           c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e5}};
           c["rope_theta"] = 1e4;
         });
       },
       "config.json: field 'rope_theta': contradicts rope_parameters.rope_theta (give one of the two)"},
      {"llama3_without_factor",
       [](auto d) { edit_config(d, [](Json& c) { c["rope_scaling"] = {{"rope_type", "llama3"}}; }); },
       "field 'rope_scaling.factor': missing"},
      {"config_not_json", [](auto d) { testing::write_text(d / "config.json", "{\"hidden_size\": 64,"); },
       "config.json: invalid JSON"},
      // The nesting limit of every JSON input (a wrong-typed value 100k brackets deep once overflowed the stack
      // when its message quoted it), the size limit (config.json a link to /dev/zero grew without bound).
      {"config_nested_too_deep",
       [](auto d) {
         std::string text = read_text(d / "config.json");
         const std::size_t at = text.find("\"vocab_size\"");
         text.insert(at, "\"deep\": " + std::string(100000, '[') + std::string(100000, ']') + ", ");
         testing::write_text(d / "config.json", text);
       },
       "config.json: invalid JSON: nested deeper than 64 levels"},
      {"config_is_dev_zero",
       [](auto d) {
         std::filesystem::remove(d / "config.json");
         std::filesystem::create_symlink("/dev/zero", d / "config.json");
       },
       "config.json: not a regular file"},
      {"config_past_the_size_limit",
       [](auto d) { testing::write_text(d / "config.json", std::string(16 * 1024 * 1024, ' ') + "{}"); },
       "config.json: larger than the 16777216-byte limit for checkpoint JSON files"},
      {"quantization_bits_past_32_bits",
       [](auto d) { edit_config(d, [](Json& c) { c["quantization"] = {{"group_size", 64}, {"bits", 4294967300LL}}; }); },
       "field 'quantization.bits': must be at most 64, got 4294967300"},
      {"rope_original_positions_a_fraction",
       [](auto d) {
         edit_config(d, [](Json& c) {
           c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                                {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 0.5}};
         });
       },
       "field 'rope_scaling.original_max_position_embeddings': must be a positive whole number, got 0.5"},
      // An eps the step graphs' rms_norm refuses (0 in f32): the error named graph node
      // 'layers.0.input_norm' at the first step, after the load had succeeded.
      {"rms_norm_eps_below_f32", [](auto d) { edit_config(d, [](Json& c) { c["rms_norm_eps"] = 1e-40; }); },
       "config.json: field 'rms_norm_eps': eps 1e-40 is outside f32's normal range"},
      {"rms_norm_eps_past_f32", [](auto d) { edit_config(d, [](Json& c) { c["rms_norm_eps"] = 1e39; }); },
       "config.json: field 'rms_norm_eps': eps 1e+39 is outside f32's normal range"},
      // Frequencies the step graphs' rope refuses (an angle past f32: every logit NaN): a subnormal theta
      // loaded and gave NaN logits with exit 0; a tiny llama3 factor was refused at the first step, naming
      // graph node 'layers.0.q.rope', after load_model had succeeded.
      {"rope_theta_subnormal", [](auto d) { edit_config(d, [](Json& c) { c["rope_theta"] = 5e-324; }); },
       "config.json: field 'rope_theta': theta 4.94066e-324 is too small: its largest frequency theta^(-"},
      {"rope_factor_tiny",
       [](auto d) {
         edit_config(d, [](Json& c) {
           c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 1e-300}, {"low_freq_factor", 1.0},
                                {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 64}};
         });
       },
       "config.json: field 'rope_scaling.factor': factor 1e-300 is too small: frequencies divided by it reach 1e+300, past "
       "1.58456e+29, where an i32 position's angle would leave f32"},
      {"missing_field", [](auto d) { edit_config(d, [](Json& c) { c.erase("hidden_size"); }); },
       "field 'hidden_size': missing"},
      {"field_of_wrong_type", [](auto d) { edit_config(d, [](Json& c) { c["num_attention_heads"] = "four"; }); },
       "field 'num_attention_heads': must be a positive integer, got \"four\""},
      // 2^62 heads of dimension 2: heads x head_dim overflowed an int64 (undefined behaviour), and with
      // 2^62 + 12 heads of 4 it wrapped to a width the weights matched, so the model loaded.
      {"heads_past_the_dimension_limit",
       [](auto d) {
         edit_config(d, [](Json& c) {
           c["num_attention_heads"] = (std::int64_t{1} << 62) + 12;
           c["head_dim"] = 4;
         });
       },
       "field 'num_attention_heads': must be at most 16777216, got 4611686018427387916"},
      // 2^63 and up, which nlohmann keeps unsigned: read as an int64 they wrapped negative, and the message
      // called them not positive.
      {"layers_past_int64", [](auto d) { edit_config(d, [](Json& c) { c["num_hidden_layers"] = 9223372036854775808ULL; }); },
       "field 'num_hidden_layers': must be at most 16777216, got 9223372036854775808"},
      {"vocabulary_at_the_largest_uint64",
       [](auto d) { edit_config(d, [](Json& c) { c["vocab_size"] = 18446744073709551615ULL; }); },
       "field 'vocab_size': must be at most"},
      {"positions_past_two_to_the_53",
       [](auto d) { edit_config(d, [](Json& c) { c["max_position_embeddings"] = 4611686018427387904LL; }); },
       "field 'max_position_embeddings': must be below 2^53, got 4611686018427387904"},
      // A Qwen2 checkpoint (q/k/v biases) labelled LlamaForCausalLM loaded as Llama, biases dropped, while
      // transformers and mlx-lm, which go by model_type, build Qwen2.
      {"model_type_contradicts_architectures",
       [](auto d) { edit_config(d, [](Json& c) { c["model_type"] = "qwen2"; }); },
       "config.json: field 'model_type': 'qwen2' contradicts architectures 'LlamaForCausalLM' (model_type 'llama')"},
      {"model_type_missing",
       [](auto d) {
         edit_config(d, [](Json& c) {
           c.erase("architectures");
           c.erase("model_type");
         });
       },
       "config.json: field 'model_type': missing"},
      {"heads_not_grouped", [](auto d) { edit_config(d, [](Json& c) { c["num_key_value_heads"] = 3; }); },
       "field 'num_key_value_heads': 3 does not divide num_attention_heads 4"},
      {"unsupported_activation", [](auto d) { edit_config(d, [](Json& c) { c["hidden_act"] = "gelu"; }); },
       "field 'hidden_act': 'gelu' is not supported"},
      {"quantized_without_config",
       [&](auto d) {
         edit_tensors(d, [&](TensorMap& t) {
           t.insert_or_assign(layer + "mlp.up_proj.scales", HostTensor(TensorSpec({128, 1}, DType::bf16)));
         });
       },
       "tensor 'model.layers.1.mlp.up_proj.scales': the checkpoint is quantized but config.json has no 'quantization'"},
      {"packed_codes_without_scales",
       [&](auto d) {
         edit_tensors(d, [&](TensorMap& t) {
           t.insert_or_assign(layer + "mlp.up_proj.weight", HostTensor(TensorSpec({128, 8}, DType::u32)));
         });
       },
       "tensor 'model.layers.1.mlp.up_proj.scales' is missing ('model.layers.1.mlp.up_proj.weight' is u32: the packed "
       "codes of a quantized layer)"},
      // A GPTQ (or AWQ) checkpoint's q_proj.scales made it look MLX-quantized: "config.json has no
      // 'quantization'", though it has transformers' quantization_config.
      {"transformers_quantized",
       [&](auto d) {
         edit_config(d, [](Json& c) { c["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 4}, {"group_size", 32}}; });
         edit_tensors(d, [&](TensorMap& t) {
           t.insert_or_assign(layer + "self_attn.q_proj.scales", HostTensor(TensorSpec({2, 64}, DType::f16)));
         });
       },
       "config.json: field 'quantization_config.quant_method': \"gptq\" checkpoints are not supported (dense, or MLX's "
       "affine 'quantization')"},
      // A tensor of a dtype of the format metile does not read, where the model needs it.
      {"unreadable_dtype",
       [](auto d) {
         edit_tensors(d, [](TensorMap& t) { t.erase("model.norm.weight"); });
         append_raw_tensor(d, "model.norm.weight", "F64", {64}, 64 * 8);
       },
       "model.safetensors: tensor 'model.norm.weight': dtype 'F64' is not one metile reads (metile reads F16, BF16, F32, "
       "I8, U8, I32 and U32)"},
      {"bad_quantization", [](auto d) { edit_config(d, [](Json& c) { c["quantization"] = {{"group_size", 48}, {"bits", 4}}; }); },
       "field 'quantization': "},
      {"no_config", [](auto d) { std::filesystem::remove(d / "config.json"); }, "no config.json"},
      {"no_weights", [](auto d) { std::filesystem::remove(d / "model.safetensors"); },
       "neither model.safetensors nor model.safetensors.index.json"},
      {"truncated_weights", [](auto d) { std::filesystem::resize_file(d / "model.safetensors", 4); },
       "model.safetensors: too short for a safetensors file"},
      {"index_names_a_missing_shard",
       [](auto d) {
         testing::write_text(d / "model.safetensors.index.json",
                             R"({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})");
       },
       "model-00002-of-00002.safetensors: cannot open the file"},
      {"index_lists_an_absent_tensor",
       [](auto d) {
         testing::write_text(d / "model.safetensors.index.json",
                             R"({"weight_map": {"model.norm.weight": "model.safetensors", "ghost.weight": "model.safetensors"}})");
       },
       "tensor 'ghost.weight': listed in model.safetensors.index.json but absent from the file"},
      // A stale index that leaves out a tensor its shard holds: named as such, not as a tensor the
      // checkpoint lacks ("tensor 'model.norm.weight' is missing" sent the user looking for it).
      {"index_leaves_out_a_tensor_its_shard_holds",
       [](auto d) {
         const TensorMap tensors = read_safetensors(d / "model.safetensors");
         Json index = {{"weight_map", Json::object()}};
         for (const auto& [name, tensor] : tensors) {
           if (name != "model.norm.weight") index["weight_map"][name] = "model.safetensors";
         }
         testing::write_text(d / "model.safetensors.index.json", index.dump());
       },
       "model.safetensors.index.json: tensor 'model.norm.weight' is missing from the weight_map, though model.safetensors "
       "holds it (is the index stale?)"},
      // The index names one copy and the model used it; transformers and mlx-lm, which read every shard,
      // keep the last shard's: two loaders, two models, no word.
      {"tensor_in_two_shards",
       [](auto d) {
         TensorMap tensors = read_safetensors(d / "model.safetensors");
         TensorMap second;
         second.insert_or_assign("model.norm.weight", HostTensor(TensorSpec({64}, DType::bf16)));
         write_safetensors(d / "model-00002-of-00002.safetensors", second);
         std::filesystem::rename(d / "model.safetensors", d / "model-00001-of-00002.safetensors");
         Json index = {{"weight_map", Json::object()}};
         for (const auto& [name, tensor] : tensors) index["weight_map"][name] = "model-00001-of-00002.safetensors";
         index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors";
         testing::write_text(d / "model.safetensors.index.json", index.dump());
       },
       "model-00002-of-00002.safetensors: tensor 'model.norm.weight': also in model-00001-of-00002.safetensors"},
      // Shards and an index beside a model.safetensors the index does not list: the index's shards were
      // loaded, while transformers loads model.safetensors.
      {"index_beside_an_unlisted_model_safetensors",
       [](auto d) {
         TensorMap tensors = read_safetensors(d / "model.safetensors");
         Json index = {{"weight_map", Json::object()}};
         for (const auto& [name, tensor] : tensors) index["weight_map"][name] = "model-00001-of-00001.safetensors";
         tensors.at("model.norm.weight").store(0, 2.0);
         write_safetensors(d / "model-00001-of-00001.safetensors", tensors);
         testing::write_text(d / "model.safetensors.index.json", index.dump());
       },
       "model.safetensors.index.json: does not list model.safetensors, which is in the directory too (transformers "
       "would load it, this loader the listed shards): remove one of the two"},
      // "model.safetensors\0x" opened model.safetensors: the file read was not the one named.
      {"index_names_a_file_with_a_nul",
       [](auto d) {
         testing::write_text(d / "model.safetensors.index.json",
                             R"({"weight_map": {"model.norm.weight": "model.safetensors\u0000x"}})");
       },
       "field 'weight_map.model.norm.weight': must be a file name in the directory, got \"model.safetensors\\u0000x\""},
      // "", "." and ".." name the directory: "is a directory, not a safetensors file", naming no field.
      {"index_names_the_directory_itself",
       [](auto d) { testing::write_text(d / "model.safetensors.index.json", R"({"weight_map": {"model.norm.weight": ".."}})"); },
       "field 'weight_map.model.norm.weight': must be a file name in the directory, got \"..\""},
      {"index_names_an_empty_file_name",
       [](auto d) { testing::write_text(d / "model.safetensors.index.json", R"({"weight_map": {"model.norm.weight": ""}})"); },
       "field 'weight_map.model.norm.weight': must be a file name in the directory, got \"\""},
      {"index_lists_no_tensor", [](auto d) { testing::write_text(d / "model.safetensors.index.json", R"({"weight_map": {}})"); },
       "model.safetensors.index.json: field 'weight_map': lists no tensor"},
      {"index_nested_too_deep",
       [](auto d) {
         testing::write_text(d / "model.safetensors.index.json", R"({"weight_map": {"model.norm.weight": )" +
                                                                    std::string(100000, '[') + std::string(100000, ']') + "}}");
       },
       "model.safetensors.index.json: invalid JSON: nested deeper than 64 levels"},
  };
  for (const Breakage& breakage : cases) {
    SCOPED_TRACE(breakage.name);
    const std::filesystem::path directory = synth(breakage.name, {});
    breakage.apply(directory);
    const std::string message = testing::error_of([&] { DecoderModel::load(directory); });
    EXPECT_NE(message.find(breakage.message), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos);
    // The field is named once (a wrapped message once repeated "config.json: field 'model_type': ").
    const std::size_t field = message.find("field '");
    EXPECT_TRUE(field == std::string::npos || message.find("field '", field + 1) == std::string::npos) << message;
    std::string out, err;
    EXPECT_EQ(run_logits(directory, out, err), 2);
    EXPECT_EQ(out, "");
    EXPECT_EQ(err, "metile: error: " + message + "\n");
  }
}

// Tensors of dtypes metile does not read (an I64 buffer, a BOOL mask, F64 statistics), which the model
// does not use: the checkpoint loads, and its logits are those of the same checkpoint without them.
// Before, any such tensor failed the whole file ("unsupported dtype 'I64'").
TEST_F(MalformedCheckpoint, UnusedTensorsOfUnreadableDtypesAreLeftAlone) {
  const std::filesystem::path plain = synth("plain", {});
  const std::filesystem::path extra = synth("extra", {});
  append_raw_tensor(extra, "model.position_ids", "I64", {1, 32}, 32 * 8);
  append_raw_tensor(extra, "model.layers.0.self_attn.causal_mask", "BOOL", {8, 8}, 64);
  append_raw_tensor(extra, "model.layers.1.statistics", "F64", {3}, 24);
  // The format's newer dtypes too (they failed the whole file: "unknown dtype 'C64'").
  append_raw_tensor(extra, "model.spectrum", "C64", {2}, 16);
  append_raw_tensor(extra, "model.layers.0.mlp.fp4_weight", "F4", {4, 6}, 12);
  append_raw_tensor(extra, "model.layers.0.mlp.fp6_weight", "F6_E3M2", {4}, 3);
  append_raw_tensor(extra, "model.layers.0.mlp.fp6_scales", "F6_E2M3", {8}, 6);
  append_raw_tensor(extra, "model.layers.0.mlp.e8m0_scales", "F8_E8M0", {5}, 5);
  const std::vector<std::int32_t> tokens = {1, 5, 9, 2};
  const DecoderModel with_extra = DecoderModel::load(extra);
  const DecoderModel without = DecoderModel::load(plain);
  EXPECT_EQ(DecodeSession(with_extra).feed(tokens), DecodeSession(without).feed(tokens));
  // `metile run --inputs` reads every tensor of its file: there the unreadable one is refused.
  const std::string message = testing::error_of([&] { read_safetensors(extra / "model.safetensors"); });
  EXPECT_NE(message.find("tensor 'model.layers.0.mlp.e8m0_scales': dtype 'F8_E8M0' is not one metile reads"),
            std::string::npos)
      << message;
}

// A checkpoint with more layers than config.json's num_hidden_layers (4 in the file, 2 in the config)
// loaded as the 2-layer model without a word. It still loads as that model (transformers does too), and
// says so in one warning line on stderr naming the first tensor left out and how many there are.
TEST_F(MalformedCheckpoint, LayersPastNumHiddenLayersAreNamedInOneWarning) {
  SynthOptions four_layers;
  four_layers.layers = 4;
  SynthOptions two_layers;
  two_layers.layers = 2;
  const std::filesystem::path cut = synth("cut", four_layers);
  const std::filesystem::path shorter = synth("shorter", two_layers);  // the same numbers for layers 0 and 1
  edit_config(cut, [](Json& c) { c["num_hidden_layers"] = 2; });
  // The oracle: the tensors of the 4-layer file that the 2-layer file has not, in name order.
  std::vector<std::string> left_out;
  {
    const TensorMap all = read_safetensors(cut / "model.safetensors");
    const TensorMap kept = read_safetensors(shorter / "model.safetensors");
    for (const auto& [name, tensor] : all) {
      if (!kept.contains(name)) left_out.push_back(name);
    }
  }
  ASSERT_FALSE(left_out.empty());
  ASSERT_TRUE(left_out.front().starts_with("model.layers.2.")) << left_out.front();
  const std::string warning = fmt::format(
      "metile: warning: {}: {} tensors of layers past config.json's num_hidden_layers (2) are not loaded, the first "
      "'{}'\n",
      (cut / "model.safetensors").string(), left_out.size(), left_out.front());

  ::testing::internal::CaptureStderr();
  const DecoderModel model = DecoderModel::load(cut);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), warning);
  ::testing::internal::CaptureStderr();
  const DecoderModel reference = DecoderModel::load(shorter);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(model.config().num_hidden_layers, 2);
  const std::vector<std::int32_t> tokens = {1, 5, 9, 2};
  EXPECT_EQ(DecodeSession(model).feed(tokens), DecodeSession(reference).feed(tokens));

  std::string out, err;
  EXPECT_EQ(run_logits(cut, out, err), 0) << err;
  EXPECT_EQ(err, warning);
  EXPECT_NE(out, "");
}

// Weights config.json does not call for (q/k/v biases beside "attention_bias": false, an MLP bias, a
// tied model's lm_head and a rotary buffer aside) loaded as the config's model without a word, where
// transformers warns of unused weights: the checkpoint's maker may have meant another model. One
// warning names the first and how many; the model is the one without them (the oracle).
TEST_F(MalformedCheckpoint, WeightsTheConfigDoesNotCallForAreNamedInOneWarning) {
  const std::filesystem::path plain = synth("plain", {});
  const std::filesystem::path extra = synth("extra", {});
  const ModelConfig config = DecoderModel::load(plain).config();
  ASSERT_FALSE(config.qkv_bias());  // a Llama: no q/k/v biases
  const std::int64_t hidden = config.hidden_size;
  edit_tensors(extra, [&](TensorMap& tensors) {
    tensors.emplace("model.layers.1.self_attn.q_proj.bias", HostTensor(TensorSpec({hidden}, DType::f32)));
    tensors.emplace("model.layers.0.mlp.gate_proj.bias", HostTensor(TensorSpec({config.intermediate_size}, DType::f32)));
    tensors.emplace("model.layers.0.self_attn.rotary_emb.inv_freq", HostTensor(TensorSpec({8}, DType::f32)));  // a buffer
  });
  const std::string warning = fmt::format(
      "metile: warning: {}: 2 weights config.json does not call for are not loaded, the first "
      "'model.layers.0.mlp.gate_proj.bias'\n",
      (extra / "model.safetensors").string());
  ::testing::internal::CaptureStderr();
  const DecoderModel model = DecoderModel::load(extra);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), warning);
  const std::vector<std::int32_t> tokens = {1, 5, 9, 2};
  const DecoderModel reference = DecoderModel::load(plain);
  EXPECT_EQ(DecodeSession(model).feed(tokens), DecodeSession(reference).feed(tokens));
  std::string out, err;
  EXPECT_EQ(run_logits(extra, out, err), 0) << err;
  EXPECT_EQ(err, warning);
  // A tied model's lm_head.weight is the embedding's: no warning.
  SynthOptions tied;
  tied.tie_word_embeddings = true;
  const std::filesystem::path tied_model = synth("tied", tied);
  edit_tensors(tied_model, [&](TensorMap& tensors) {
    tensors.emplace("lm_head.weight", tensors.at("model.embed_tokens.weight"));
  });
  ::testing::internal::CaptureStderr();
  DecoderModel::load(tied_model);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

// A dense weight quantize_affine cannot quantize (inf here) under --quantize: the error said
// "quantize_affine: weight [3, 5] is inf" and nothing of which of the checkpoint's matrices held it.
TEST_F(MalformedCheckpoint, QuantizingANonFiniteWeightNamesTheTensor) {
  const std::filesystem::path directory = synth("model", {});
  edit_tensors(directory, [](TensorMap& t) {
    HostTensor& weight = t.at("model.layers.1.mlp.up_proj.weight");
    weight.store(3 * 64 + 5, std::numeric_limits<double>::infinity());
  });
  LoadOptions options;
  options.quantize = AffineQuantization{4, 32};
  const std::string message = testing::error_of([&] { DecoderModel::load(directory, options); });
  EXPECT_NE(message.find("model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight': "), std::string::npos)
      << message;
  EXPECT_NE(message.find("weight [3, 5] is inf"), std::string::npos) << message;
  std::string out, err;
  EXPECT_EQ(run_metile("logits " + directory.string() + " --prompt-ids 1,2 --quantize 4 --group-size 32", out, err), 2);
  EXPECT_EQ(out, "");
  EXPECT_EQ(err, "metile: error: " + message + "\n");
  DecoderModel::load(directory);  // unquantized, the checkpoint loads (the inf is the model's)
}

// A capacity whose caches fit this machine's memory but whose CPU step does not (one layer's
// attention scores for 16 tokens over the whole cache): refused when the session is made, before it
// allocates anything, instead of by the out-of-memory killer halfway through a prompt.
TEST_F(MalformedCheckpoint, ACpuStepPastTheMachinesMemoryIsRefusedUpFront) {
  const std::filesystem::path directory = synth("model", {});
  // The tiny preset: 2 layers, 2 KV heads of 16 (caches 256 bytes a position in bf16), 4 query heads.
  const std::uint64_t memory = physical_memory_bytes();
  const auto capacity = static_cast<std::int64_t>(memory / 2 / 256);  // caches: half the memory
  if (capacity > (std::int64_t{1} << 31)) GTEST_SKIP() << "a machine this large takes positions past 2^31";
  LoadOptions options;
  options.max_sequence = capacity;
  const DecoderModel model = DecoderModel::load(directory, options);  // the caches alone fit
  const std::string message = testing::error_of([&] { DecodeSession session(model); });
  EXPECT_EQ(message.rfind(fmt::format("a CPU decode step over {} positions (--max-seq) needs about", capacity), 0), 0u)
      << message;
  EXPECT_NE(message.find("more than this machine's"), std::string::npos) << message;
}

// A one-layer Llama checkpoint of one head of dimension 2 and an MLP of width 2, its weights zeros
// (a sparse file): only the embedding's size is the caller's.
void write_zero_llama(const std::filesystem::path& directory, std::int64_t vocab, std::int64_t hidden) {
  std::filesystem::create_directories(directory);
  testing::write_text(directory / "config.json",
                      Json{{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", vocab}, {"hidden_size", hidden},
                           {"intermediate_size", 2}, {"num_hidden_layers", 1}, {"num_attention_heads", 1},
                           {"head_dim", 2}, {"tie_word_embeddings", true}, {"max_position_embeddings", 16}}
                          .dump());
  const std::string layer = "model.layers.0.";
  const std::vector<std::pair<std::string, std::vector<std::int64_t>>> shapes = {
      {"model.embed_tokens.weight", {vocab, hidden}},
      {"model.norm.weight", {hidden}},
      {layer + "input_layernorm.weight", {hidden}},
      {layer + "post_attention_layernorm.weight", {hidden}},
      {layer + "self_attn.q_proj.weight", {2, hidden}},
      {layer + "self_attn.k_proj.weight", {2, hidden}},
      {layer + "self_attn.v_proj.weight", {2, hidden}},
      {layer + "self_attn.o_proj.weight", {hidden, 2}},
      {layer + "mlp.gate_proj.weight", {2, hidden}},
      {layer + "mlp.up_proj.weight", {2, hidden}},
      {layer + "mlp.down_proj.weight", {hidden, 2}}};
  Json header = Json::object();
  std::uint64_t offset = 0;
  for (const auto& [name, shape] : shapes) {
    const auto bytes = static_cast<std::uint64_t>(TensorSpec(shape, DType::bf16).bytes());
    header[name] = {{"dtype", "BF16"}, {"shape", shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  const std::string text = header.dump();
  std::string file(8, '\0');
  for (int index = 0; index < 8; ++index) file[index] = static_cast<char>((text.size() >> (8 * index)) & 0xFF);
  testing::write_text(directory / "model.safetensors", file + text);
  std::filesystem::resize_file(directory / "model.safetensors", file.size() + text.size() + offset);  // sparse
}

// Weights whose copy in memory passes the machine's memory: refused before any tensor is converted,
// naming the sizes. Each tensor was converted in turn, until the allocator failed ("metile: internal
// error: out of memory", exit 1) or, with the first tensors fitting (a bf16 checkpoint of two thirds
// of the memory read as f32), the out-of-memory killer ended the process. The embedding here, a
// sparse file, holds twice the machine's memory in bf16.
TEST_F(MalformedCheckpoint, WeightsPastTheMachinesMemoryAreRefusedBeforeLoading) {
  const std::uint64_t memory = physical_memory_bytes();
  const std::int64_t vocab = std::int64_t{1} << 20;
  const auto hidden = static_cast<std::int64_t>((memory >> 20) + 2) & ~std::int64_t{1};  // bf16: 2 bytes an element
  ASSERT_LE(hidden, kLargestModelDimension) << "a machine this large takes a wider embedding";
  const std::filesystem::path directory = root_ / "large";
  write_zero_llama(directory, vocab, hidden);

  for (const DType dtype : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(dtype_name(dtype));
    LoadOptions options;
    options.dtype = dtype;
    const std::string message = testing::error_of([&] { DecoderModel::load(directory, options); });
    EXPECT_EQ(message.rfind(directory.string() + ": the weights take ", 0), 0u) << message;
    // No --max-seq: the capacity is config.json's max_position_embeddings, and the message says so.
    EXPECT_NE(message.find(fmt::format(" GB in {} and the KV caches of 16 positions (max_position_embeddings, at most "
                                       "4096; --max-seq sets it) 0.0 GB, more than this machine's ",
                                       dtype_name(dtype))),
              std::string::npos)
        << message;
    std::string out, err;
    EXPECT_EQ(run_metile("logits " + directory.string() + " --prompt-ids 1 --dtype " + std::string(dtype_name(dtype)),
                         out, err),
              2);
    EXPECT_EQ(out, "");
    EXPECT_EQ(err, "metile: error: " + message + "\n");
  }
}

// synth-model interrupted (the CLI's Ctrl-C answers `cancelled`): the staging folder, with the
// tensors written so far, is removed and the target never appears (it was left as a hidden
// .NAME.partial-PID folder, up to the whole model's size).
TEST_F(MalformedCheckpoint, AnInterruptedSynthesisLeavesNothing) {
  int asked = 0;
  SynthOptions options;
  options.preset = "small";
  options.max_shard_mb = 10;  // several shards, some written before the interruption
  EXPECT_EQ(testing::error_of([&] {
              synthesize_model(root_ / "model", options, {}, [&] { return ++asked > 40; });
            }),
            "synth-model: interrupted; nothing was written");
  EXPECT_EQ(asked, 41);
  EXPECT_TRUE(std::filesystem::is_empty(root_)) << "left behind: " << std::filesystem::directory_iterator(root_)->path();
}

#ifdef METILE_BINARY
// `metile synth-model` past `ulimit -f`: the write fails (the CLI ignores SIGXFSZ) and its error named
// the staging folder's file (/tmp/.metile-partial-PID-0/shard-0), which the cleanup had just removed.
// The error now names the directory asked for, and that directory is not made.
TEST_F(MalformedCheckpoint, ASynthesisPastTheFileSizeLimitNamesItsDirectory) {
  const std::filesystem::path target = root_ / "model";
  const std::string command = "ulimit -f 64; exec '" + std::string(METILE_BINARY) + "' synth-model '" + target.string() +
                              "' --preset tiny >/dev/null 2>'" + (root_ / "err.txt").string() + "'";
  const int status = std::system(command.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << "status " << status;  // a failed write, as to stdout
  EXPECT_EQ(read_text(root_ / "err.txt"),
            "metile: error: " + target.string() + ": write failed: File too large (writing shard 1); nothing was written\n");
  EXPECT_FALSE(std::filesystem::exists(target));
  for (const auto& entry : std::filesystem::directory_iterator(root_)) {
    EXPECT_EQ(entry.path().filename(), "err.txt") << "left behind: " << entry.path();
  }
}
#endif

// `metile synth-model` stopped by a signal once its staging folder holds a shard: Ctrl-C and a kill
// were cancelled cleanly, but a closed terminal (SIGHUP) ended the process and left the staging folder
// (inside an existing empty directory, where the next run then found it not empty); so did Ctrl-\ and
// the other signals of kStoppingSignals (include/metile/io.h).
TEST_F(MalformedCheckpoint, ASignalledSynthesisLeavesNothing) {
  for (const int signal : kStoppingSignals) {
    const std::filesystem::path target = root_ / "existing";
    std::filesystem::create_directory(target);
    const std::filesystem::path errors = root_ / "err.txt";
    const pid_t child = start_metile({"synth-model", target.string(), "--preset", "small", "--max-shard-mb", "1"}, errors);
    ASSERT_GE(child, 0);
    // Wait for a written shard in the staging folder (the run is then among its tensors, where it checks).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    bool staged = false;
    while (!staged && std::chrono::steady_clock::now() < deadline) {
      std::error_code error;
      for (const auto& entry : std::filesystem::directory_iterator(target, error)) {
        if (entry.path().filename().string().starts_with(".metile-partial-") &&
            std::filesystem::exists(entry.path() / "shard-1", error)) {
          staged = true;
        }
      }
      if (!staged) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    ::kill(child, signal);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(staged) << "signal " << signal << ": no shard was staged in time";
    // The shell's convention for a command a signal stopped: 128 + the signal (130 for Ctrl-C).
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + signal) << "signal " << signal << ", status " << status;
    EXPECT_EQ(read_text(errors), "metile: synth-model: interrupted; nothing was written\n") << "signal " << signal;
    EXPECT_TRUE(std::filesystem::is_empty(target)) << "signal " << signal << " left "
                                                   << std::filesystem::directory_iterator(target)->path();
    std::filesystem::remove_all(target);
  }
}

// Two synth-model runs into one directory, simulated: the other writer acts while this one writes
// (its progress callback). Each file was renamed over what was there, so both runs said they had
// written the model and the directory held a mix of the two; a run racing into a new directory ended
// in filesystem_error ("Directory not empty", an internal error). Now this run stops, removes what it
// moved and its staging folder, and leaves the other writer's files as they are.
TEST_F(MalformedCheckpoint, ASynthesisThatFindsAnotherWriterStopsAndOverwritesNothing) {
  SynthOptions options;
  options.preset = "tiny";
  options.max_shard_mb = 0.05;  // shards, an index and a config: several files to move
  const auto files_in = [](const std::filesystem::path& directory) {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(directory)) names.push_back(entry.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  };
  // An existing empty directory: the other writer's config.json appears while this run writes.
  const std::filesystem::path existing = root_ / "existing";
  std::filesystem::create_directory(existing);
  bool planted = false;
  const auto plant = [&](const std::string&) {
    if (!planted) testing::write_text(existing / "config.json", "the other writer's");
    planted = true;
  };
  EXPECT_EQ(testing::error_of([&] { synthesize_model(existing, options, plant); }),
            existing.string() + ": is no longer an empty directory: another process is writing into it");
  EXPECT_EQ(files_in(existing), std::vector<std::string>{"config.json"});
  EXPECT_EQ(read_text(existing / "config.json"), "the other writer's");
  // A new directory that another writer makes, empty or not, while this run writes.
  for (const bool with_a_file : {false, true}) {
    const std::filesystem::path fresh = root_ / (with_a_file ? "fresh_full" : "fresh_empty");
    planted = false;
    const auto make = [&](const std::string&) {
      if (planted) return;
      std::filesystem::create_directory(fresh);
      if (with_a_file) testing::write_text(fresh / "model.safetensors", "the other writer's");
      planted = true;
    };
    EXPECT_EQ(testing::error_of([&] { synthesize_model(fresh, options, make); }),
              fresh.string() + ": exists now: another process made it while this one wrote");
    EXPECT_EQ(files_in(fresh), with_a_file ? std::vector<std::string>{"model.safetensors"} : std::vector<std::string>{});
  }
  // Nothing of this run is left beside them either.
  EXPECT_EQ(files_in(root_), (std::vector<std::string>{"existing", "fresh_empty", "fresh_full"}));
}

TEST_F(MalformedCheckpoint, BadCommandLinesAreOneLineAndWriteNothing) {
  const std::filesystem::path directory = synth("model", {});
  std::string out, err;
  const auto metile = [&](const std::string& arguments) { return run_metile(arguments, out, err); };
  EXPECT_EQ(metile("logits " + directory.string() + " --prompt-ids 1,2 --backend tpu"), 2);
  EXPECT_EQ(err, "metile: error: --backend must be cpu or cuda, got 'tpu'\n");
  EXPECT_EQ(metile("logits " + directory.string() + " --prompt-ids 1,2 --decline swiglu_mlp"), 2);
  EXPECT_EQ(err, "metile: error: --decline applies to --backend cuda (the fused GPU engine)\n");
  EXPECT_EQ(metile("logits " + directory.string() + " --prompt-ids 1,x"), 2);
  EXPECT_EQ(err, "metile: error: --prompt-ids: 'x' is not a token id (expected e.g. 1,2,3)\n");
  EXPECT_EQ(metile("logits " + directory.string() + " --prompt-ids 1,256"), 2);
  EXPECT_EQ(err, "metile: error: --prompt-ids 1,256: token id 256 is outside the vocabulary [0, 256)\n");
  EXPECT_EQ(out, "");
  EXPECT_EQ(metile("generate " + directory.string() + " --prompt-ids -1 --tokens 2"), 2);
  EXPECT_EQ(err, "metile: error: --prompt-ids -1: token id -1 is outside the vocabulary [0, 256)\n");
  // verify-model's default prompt (1,2,3,4) past a tiny vocabulary is named as the default.
  const std::filesystem::path tiny = root_ / "tiny-vocabulary";
  write_zero_llama(tiny, 3, 2);
  EXPECT_EQ(metile("verify-model " + tiny.string() + " --tokens 2"), 2);
  EXPECT_EQ(err, "metile: error: --prompt-ids 1,2,3,4 (the default; give --prompt-ids): token id 3 is outside the "
                 "vocabulary [0, 3)\n");
  EXPECT_EQ(out, "");
  EXPECT_EQ(metile("synth-model " + directory.string()), 2);  // exists and holds a model
  EXPECT_NE(err.find("exists and is not an empty directory"), std::string::npos);
  testing::write_text(root_ / "a_file", "x");
  EXPECT_EQ(metile("synth-model " + (root_ / "a_file").string()), 2);
  EXPECT_EQ(err, "metile: error: " + (root_ / "a_file").string() + ": exists and is not a directory\n");
  // "d/" and "d/." name the directory d (the staging folder once went inside it, and the rename failed
  // after the whole model was written); a link and an empty path are refused before any work.
  std::filesystem::create_directories(root_ / "empty");
  struct stat before {};
  ASSERT_EQ(::stat((root_ / "empty").c_str(), &before), 0);
  EXPECT_EQ(metile("synth-model " + (root_ / "empty").string() + "/"), 0) << err;
  EXPECT_TRUE(std::filesystem::exists(root_ / "empty" / "config.json"));
  // An empty directory that exists stays the same directory (a shell inside it, `synth-model .`).
  struct stat after {};
  ASSERT_EQ(::stat((root_ / "empty").c_str(), &after), 0);
  EXPECT_EQ(before.st_ino, after.st_ino);
  // ".." after a symbolic link is the link target's parent, as mkdir takes it (not lexically dropped).
  std::filesystem::create_directories(root_ / "q" / "deep");
  std::filesystem::create_directory_symlink(root_ / "q" / "deep", root_ / "deep_link");
  EXPECT_EQ(metile("synth-model " + (root_ / "deep_link").string() + "/../beside"), 0) << err;
  EXPECT_TRUE(std::filesystem::exists(root_ / "q" / "beside" / "config.json"));
  EXPECT_FALSE(std::filesystem::exists(root_ / "beside"));
  EXPECT_EQ(metile("synth-model " + (root_ / "new").string() + "/."), 0) << err;
  EXPECT_TRUE(std::filesystem::exists(root_ / "new" / "model.safetensors"));
  std::filesystem::create_symlink(root_ / "nowhere", root_ / "link");
  EXPECT_EQ(metile("synth-model " + (root_ / "link").string()), 2);
  EXPECT_EQ(err, "metile: error: " + (root_ / "link").string() + ": is a symbolic link; name the directory itself\n");
  EXPECT_EQ(metile("synth-model ''"), 2);
  EXPECT_EQ(err, "metile: error: synth-model: the output directory is an empty path\n");
  EXPECT_EQ(metile("synth-model " + (root_ / "none").string() + " --layers 0"), 2);
  EXPECT_EQ(err, "metile: error: layers 0 must be 1..1024\n");
  for (const auto& entry : std::filesystem::directory_iterator(root_)) {
    EXPECT_EQ(entry.path().filename().string().find(".partial-"), std::string::npos) << entry.path();
  }
  EXPECT_EQ(metile("synth-model " + (root_ / "fresh").string() + " --preset huge"), 2);
  EXPECT_EQ(err, "metile: error: unknown preset 'huge' (tiny, small, llama3.2-1b, qwen2.5-1.5b or llama3-8b)\n");
  EXPECT_FALSE(std::filesystem::exists(root_ / "fresh"));
  // Sizes and thresholds out of range (a typo must not fill the memory or the disk, nor pass as a default).
  EXPECT_EQ(metile("logits " + directory.string() + " --prompt-ids 1,2 --max-seq 2000000000"), 2);
  EXPECT_NE(err.find("the KV caches of 2000000000 positions (--max-seq) x 2 layers"), std::string::npos) << err;
  EXPECT_EQ(err.find('\n'), err.size() - 1) << err;
  EXPECT_EQ(metile("logits " + directory.string() + " --prompt-ids 1,2 --max-seq 1000000000000"), 2);
  EXPECT_EQ(err, "metile: error: --max-seq 1000000000000: at most 2^31 positions (they are 32-bit integers)\n");
  EXPECT_EQ(metile("synth-model " + (root_ / "deep").string() + " --layers 100000000000"), 2);
  EXPECT_EQ(err, "metile: error: layers 100000000000 must be 1..1024\n");
  // Past int64, CLI11 alone saturated the number (99999999999999999999 ran as 9223372036854775807);
  // every 64-bit integer option now refuses it by name.
  EXPECT_EQ(metile("synth-model " + (root_ / "deep").string() + " --layers 99999999999999999999"), 2);
  EXPECT_EQ(err, "metile: error: --layers: 99999999999999999999 does not fit in a 64-bit signed integer (see metile --help)\n");
  EXPECT_EQ(metile("generate " + directory.string() + " --prompt-ids 1 --tokens -9223372036854775809"), 2);
  EXPECT_EQ(err, "metile: error: --tokens: -9223372036854775809 does not fit in a 64-bit signed integer (see metile --help)\n");
  EXPECT_EQ(metile("logits " + directory.string() + " --prompt-ids 1 --max-seq 9223372036854775808"), 2);
  EXPECT_NE(err.find("--max-seq: 9223372036854775808 does not fit"), std::string::npos) << err;
  EXPECT_EQ(metile("bench-model --preset tiny --context 18446744073709551616"), 2);
  EXPECT_NE(err.find("--context: 18446744073709551616 does not fit"), std::string::npos) << err;
  EXPECT_EQ(metile("generate " + directory.string() + " --prompt-ids 1 --tokens +1"), 0);  // a sign is still a number
  // Integers are decimal: CLI11 alone read a leading 0 as octal and 0x as hexadecimal (`--tokens 010` made 8
  // tokens, `--layers 010` wrote 8 layers, where `--seed 010` is 10).
  EXPECT_EQ(metile("generate " + directory.string() + " --prompt-ids 1 --tokens 010"), 0) << err;
  EXPECT_NE(err.find("10 tokens after a 1-token prompt"), std::string::npos) << err;
  for (const std::string option : {"--tokens 0x2", "--tokens 0x8000000000000000", "--tokens 1e3", "--tokens ''",
                                   "--tokens 0b11", "--group-size 0x40"}) {
    EXPECT_EQ(metile("generate " + directory.string() + " --prompt-ids 1 --quantize 4 " + option), 2) << option;
    EXPECT_EQ(err, fmt::format("metile: error: {}: '{}' is not a decimal integer (see metile --help)\n",
                               option.substr(0, option.find(' ')), option.substr(option.find(' ') + 1) == "''" ? "" : option.substr(option.find(' ') + 1)))
        << option;
  }
  // Leading zeros are dropped before the range check: 21 sevens and 1 followed by 21 zeros are past 2^63.
  EXPECT_EQ(metile("generate " + directory.string() + " --prompt-ids 1 --tokens 0777777777777777777777"), 2);
  EXPECT_NE(err.find("--tokens: 0777777777777777777777 does not fit"), std::string::npos) << err;
  EXPECT_EQ(metile("generate " + directory.string() + " --prompt-ids 1 --tokens 000000000000000000000000002"), 0) << err;
  EXPECT_EQ(metile("synth-model " + (root_ / "octal").string() + " --layers 010"), 0) << err;
  EXPECT_NE(read_text(root_ / "octal" / "config.json").find("\"num_hidden_layers\": 10"), std::string::npos);
  // A shard is held in memory until written: one past this machine's memory is refused before anything is
  // written (1024 layers of Llama-3-8B are ~450 GB; with shards that large it grew into an out-of-memory end).
  EXPECT_EQ(metile("synth-model " + (root_ / "deep").string() + " --preset llama3-8b --layers 1024 --max-shard-mb 1000000"), 2);
  EXPECT_NE(err.find("synth-model: a shard is held in memory until it is written"), std::string::npos) << err;
  EXPECT_EQ(err.find('\n'), err.size() - 1) << err;
  EXPECT_FALSE(std::filesystem::exists(root_ / "deep"));
  EXPECT_EQ(metile("synth-model " + (root_ / "deep").string() + " --max-shard-mb inf"), 2);
  EXPECT_NE(err.find("--max-shard-mb: inf is not a finite decimal number"), std::string::npos) << err;
  EXPECT_FALSE(std::filesystem::exists(root_ / "deep"));
  // An empty or half-numeric threshold is not 0 (strtod read "" as 0).
  for (const std::string threshold : {"--max-logit-error -0.5", "--min-agreement nan", "--max-kl inf", "--max-kl-mean -1",
                                      "--max-kl ''", "--max-kl 0.1x", "--max-kl-mean 0x10", "--max-kl 0x1p-4",
                                      "--max-kl +-1", "--max-kl -", "--max-kl 1e400", "--min-agreement 1e309"}) {
    EXPECT_EQ(metile("verify-model " + directory.string() + " --tokens 4 " + threshold), 2) << threshold;
    EXPECT_NE(err.find(threshold.substr(0, threshold.find(' '))), std::string::npos) << err;
    EXPECT_EQ(err.find('\n'), err.size() - 1) << err;
  }
  // A C hexadecimal float is not read (strtod and CLI11 read "0x10" as 16); a sign and an exponent are.
  EXPECT_EQ(metile("verify-model " + directory.string() + " --tokens 4 --max-kl-mean 0x10"), 2);
  EXPECT_NE(err.find("--max-kl-mean: 0x10 is not a finite decimal number"), std::string::npos) << err;
  EXPECT_EQ(metile("verify-model " + directory.string() + " --tokens 4 --max-kl +1e-2 --min-agreement 0.5"), 0) << err;
  // A figure past the largest double is named as written (it read as inf, and the message said "inf"); one below
  // the smallest is a figure (0).
  EXPECT_EQ(metile("generate " + directory.string() + " --prompt-ids 1 --tokens 1 --temperature 1e400"), 2);
  EXPECT_NE(err.find("--temperature: 1e400 is not a finite decimal number"), std::string::npos) << err;
  EXPECT_EQ(metile("generate " + directory.string() + " --prompt-ids 1 --tokens 1 --temperature 1e-400"), 0) << err;
  EXPECT_EQ(metile("synth-model " + (root_ / "deep").string() + " --max-shard-mb 0x1p-30"), 2);
  EXPECT_NE(err.find("--max-shard-mb: 0x1p-30 is not a finite decimal number"), std::string::npos) << err;
  EXPECT_FALSE(std::filesystem::exists(root_ / "deep"));
  // A fraction: above 1 no run could pass (a perfect one printed FAIL), so it is a usage error.
  EXPECT_EQ(metile("verify-model " + directory.string() + " --tokens 4 --min-agreement 1.01"), 2);
  EXPECT_NE(err.find("--min-agreement: must be a fraction from 0 to 1"), std::string::npos) << err;
  EXPECT_EQ(metile("verify-model " + directory.string() + " --tokens 4 --min-agreement 1"), 0) << err;
  EXPECT_EQ(metile("verify-model " + directory.string() + " --tokens 4"), 0);
  EXPECT_NE(out.find("next-token agreement   1.0000"), std::string::npos);
  // --format json on the CPU too (it was ignored there: text where a script expected JSON).
  EXPECT_EQ(metile("verify-model " + directory.string() + " --tokens 4 --format json"), 0);
  const nlohmann::json verdict = nlohmann::json::parse(out);
  EXPECT_EQ(verdict.at("backend"), "cpu");
  EXPECT_EQ(verdict.at("positions"), 4);
  EXPECT_EQ(verdict.at("figures").at("agreement"), 1.0);
  EXPECT_EQ(verdict.at("passed"), true);
  EXPECT_EQ(metile("verify-model " + directory.string() + " --tokens 0"), 2);  // unset means the default; 0 is no count
  EXPECT_NE(err.find("--tokens: Value 0 not in range 1"), std::string::npos) << err;
  // A comparison too long for the caches fails before its first step, as generate does.
  EXPECT_EQ(metile("verify-model " + directory.string() + " --prompt-ids 1,2 --max-seq 16 --tokens 20"), 2);
  EXPECT_EQ(err, "metile: error: 20 tokens after a 2-token prompt would go past the KV-cache capacity 16 (--max-seq)\n");
  EXPECT_EQ(out, "");
  // The prompt alone past the capacity is said so ("1 tokens after a 9-token prompt" blamed the count).
  EXPECT_EQ(metile("verify-model " + directory.string() + " --prompt-ids 1,2,3,4,5,6,7,8,9 --max-seq 8 --tokens 1"), 2);
  EXPECT_EQ(err, "metile: error: a 9-token prompt goes past the KV-cache capacity 8 (--max-seq)\n");
  EXPECT_EQ(metile("verify-model " + directory.string() + " --prompt-ids 1,2,3,4,5,6,7,8 --max-seq 8 --tokens 2"), 2);
  EXPECT_EQ(err, "metile: error: 2 tokens after a 8-token prompt would go past the KV-cache capacity 8 (--max-seq)\n");
  // logits checks the whole prompt before its first step: it was refused after the steps that fit,
  // naming the end of the step that did not (33 tokens at capacity 20: "would reach 32").
  std::string ids = "1";
  for (int token = 2; token <= 33; ++token) ids += "," + std::to_string(token % 7);
  EXPECT_EQ(metile("logits " + directory.string() + " --prompt-ids " + ids + " --max-seq 20"), 2);
  EXPECT_EQ(err, "metile: error: the sequence would reach 33 tokens, past the KV-cache capacity 20 (--max-seq)\n");
  EXPECT_EQ(out, "");
  // A sliding window bounds the context (attention sees every cached position): asking for more is
  // an error naming the window, not a capacity silently cut to it.
  const std::filesystem::path windowed = synth("windowed", {});
  edit_config(windowed, [](Json& c) {  // a Mistral (Llama's tensors; a window LlamaConfig does not have)
    c["architectures"] = {"MistralForCausalLM"};
    c["model_type"] = "mistral";
    c["sliding_window"] = 8.0;  // a whole number written as a real, as transformers reads it (it was refused)
  });
  EXPECT_EQ(metile("logits " + windowed.string() + " --prompt-ids 1,2 --max-seq 100"), 2);
  EXPECT_EQ(err, "metile: error: --max-seq 100: the checkpoint's sliding_window 8 bounds the context (attention over a sliding "
                 "window is not implemented); ask for at most 8 positions\n");
  EXPECT_EQ(metile("logits " + windowed.string() + " --prompt-ids 1,2"), 0);
  // A capacity a tool computed (bench-model, without --max-seq) is named as that tool names it, not
  // as a max-seq the user never gave; so is the capacity's source once loaded.
  LoadOptions computed;
  computed.max_sequence = 100;
  computed.max_sequence_source = "the capacity this run needs";
  try {
    (void)DecoderModel::load(windowed, computed);
    ADD_FAILURE() << "a capacity past the sliding window loaded";
  } catch (const InputError& error) {
    EXPECT_EQ(std::string(error.what()), "the capacity this run needs 100: the checkpoint's sliding_window 8 bounds the "
                                         "context (attention over a sliding window is not implemented); ask for at most "
                                         "8 positions");
  }
  computed.max_sequence = 8;
  EXPECT_EQ(DecoderModel::load(windowed, computed).capacity_source(), "the capacity this run needs");
  // A capacity rounded up from what the run needs (bench-model: 256 from 5) takes the window where
  // the window holds what it needs; it was refused, the window being under the rounding.
  computed.max_sequence = 256;
  computed.max_sequence_needed = 5;
  const DecoderModel capped = DecoderModel::load(windowed, computed);
  EXPECT_EQ(capped.capacity(), 8);
  EXPECT_EQ(capped.capacity_source(), "the checkpoint's sliding_window");
  computed.max_sequence_needed = 9;
  EXPECT_THROW((void)DecoderModel::load(windowed, computed), InputError);
  // The capacity says where it came from: here the window, not --max-seq (which was not given).
  EXPECT_EQ(metile("generate " + windowed.string() + " --prompt-ids 1,2 --tokens 8"), 2);
  EXPECT_EQ(err, "metile: error: 8 tokens after a 2-token prompt would go past the KV-cache capacity 8 (the "
                 "checkpoint's sliding_window)\n");
  // And from config.json's max_position_embeddings when neither is set.
  const std::filesystem::path short_context = synth("short-context", {});
  edit_config(short_context, [](Json& c) { c["max_position_embeddings"] = 6; });
  EXPECT_EQ(metile("generate " + short_context.string() + " --prompt-ids 1,2 --tokens 6"), 2);
  EXPECT_EQ(err, "metile: error: 6 tokens after a 2-token prompt would go past the KV-cache capacity 6 "
                 "(max_position_embeddings, at most 4096; --max-seq sets it)\n");
}

// The logits a prompt returns are checked against this machine's memory, as the caches are: a checkpoint
// within the limits (a vocabulary of 2^24, here at hidden size 2: 128 MB of weights) and a prompt within its
// capacity ended in "internal error: out of memory" (std::bad_alloc), exit 1. feed() returns every
// position's logits and refuses past the memory; `metile logits` keeps only the rows it shows, and refuses
// --all-positions, whose JSON takes up to 28 bytes a logit with the logits, before feeding anything.
TEST_F(MalformedCheckpoint, PromptLogitsPastTheMemoryAreRefusedBeforeTheFirstStep) {
  constexpr std::int64_t vocab = std::int64_t{1} << 24, hidden = 2;
  const std::filesystem::path directory = root_ / "wide_vocabulary";
  std::filesystem::create_directories(directory);
  testing::write_text(directory / "config.json",
                      Json{{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"vocab_size", vocab},
                           {"hidden_size", hidden}, {"intermediate_size", 2}, {"num_hidden_layers", 1},
                           {"num_attention_heads", 1}, {"num_key_value_heads", 1}, {"head_dim", 2},
                           {"max_position_embeddings", 4096}, {"rms_norm_eps", 1e-5}}
                          .dump());
  TensorMap tensors;
  const auto add = [&](const std::string& name, std::vector<std::int64_t> shape) {
    tensors.emplace(name, HostTensor(TensorSpec(std::move(shape), DType::bf16)));
  };
  add("model.embed_tokens.weight", {vocab, hidden});
  add("lm_head.weight", {vocab, hidden});
  add("model.norm.weight", {hidden});
  add("model.layers.0.input_layernorm.weight", {hidden});
  add("model.layers.0.post_attention_layernorm.weight", {hidden});
  for (const char* projection : {"q", "k", "v"}) add(fmt::format("model.layers.0.self_attn.{}_proj.weight", projection), {2, hidden});
  add("model.layers.0.self_attn.o_proj.weight", {hidden, 2});
  add("model.layers.0.mlp.gate_proj.weight", {2, hidden});
  add("model.layers.0.mlp.up_proj.weight", {2, hidden});
  add("model.layers.0.mlp.down_proj.weight", {hidden, 2});
  write_safetensors(directory / "model.safetensors", tensors);
  tensors.clear();

  const auto memory = static_cast<double>(physical_memory_bytes());
  const auto fed = static_cast<std::int64_t>(memory / (static_cast<double>(vocab) * 4)) + 1;
  if (fed > 4000) GTEST_SKIP() << "this machine's memory holds the logits of the whole context";
  const DecoderModel model = DecoderModel::load(directory);
  DecodeSession session(model);
  const std::vector<std::int32_t> prompt(static_cast<std::size_t>(fed), 1);
  const std::string error = testing::error_of([&] { (void)session.feed(prompt); });
  EXPECT_NE(error.find(fmt::format("the logits of {} positions x 16777216 tokens of vocabulary", fed)), std::string::npos)
      << error;
  EXPECT_EQ(session.position(), 0);  // nothing was fed
  // feed_greedy feeds a step at a time but checks every token first: a bad id at position 20 fed nothing.
  std::vector<std::int32_t> with_bad_id(20, 1);
  with_bad_id.back() = static_cast<std::int32_t>(vocab);
  EXPECT_EQ(testing::error_of([&] { (void)session.feed_greedy(with_bad_id); }),
            "token id 16777216 is outside the vocabulary [0, 16777216)");
  EXPECT_EQ(session.position(), 0);

  const auto shown = static_cast<std::int64_t>(memory / (static_cast<double>(vocab) * 28)) + 1;
  std::string ids = "1";
  for (std::int64_t index = 1; index < shown; ++index) ids += ",1";
  std::string out, err;
  EXPECT_EQ(run_metile("logits " + directory.string() + " --prompt-ids " + ids + " --format json --all-positions", out, err), 2);
  EXPECT_NE(err.find(fmt::format("metile: error: --all-positions: {} positions x 16777216 logits take about", shown)),
            std::string::npos)
      << err;
  EXPECT_EQ(out, "");
}

// verify-model holds two CPU sessions, each with its own caches: each checked itself alone, so a capacity
// that fit one session but not two passed every check and ended in the out-of-memory killer. Both are
// checked first now. The capacity: the first power of two at which two sessions do not fit (one session
// of it needs no more than two of half of it, which fit).
TEST_F(MalformedCheckpoint, VerifyModelChecksBothOfItsSessionsAgainstTheMemory) {
  const std::filesystem::path directory = synth("model", {});
  LoadOptions options;
  std::int64_t capacity = 1024;
  for (;; capacity *= 2) {
    ASSERT_LT(capacity, std::int64_t{1} << 31) << "two sessions fit at every capacity";
    options.max_sequence = capacity;
    const DecoderModel model = DecoderModel::load(directory, options);
    if (testing::error_of([&] { check_decode_sessions_fit(model, 2); }) == "(no InputError)") continue;
    EXPECT_EQ(testing::error_of([&] { check_decode_sessions_fit(model, 1); }), "(no InputError)");
    break;
  }
  std::string out, err;
  EXPECT_EQ(run_metile("verify-model " + directory.string() + " --tokens 2 --max-seq " + std::to_string(capacity), out, err), 2);
  EXPECT_NE(err.find(fmt::format("metile: error: 2 CPU decode sessions over {} positions (--max-seq) needs about", capacity)),
            std::string::npos)
      << err;
  EXPECT_EQ(err.find('\n'), err.size() - 1) << err;
}

// An empty directory that is a mount point (a mounted volume, a container's bind mount) is a
// directory synth-model may fill: the weights were staged beside it, on the parent's file system, and
// the first rename into it failed with EXDEV ("metile: internal error: ... Invalid cross-device link").
TEST_F(MalformedCheckpoint, SynthesisIntoAnEmptyMountPointWritesThere) {
  const std::filesystem::path volume = root_ / "volume";
  std::filesystem::create_directories(volume);
  if (::mount("metile-test", volume.c_str(), "tmpfs", 0, nullptr) != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs here (" << std::strerror(errno) << "): needs root";
  }
  struct Unmount {
    std::filesystem::path path;
    ~Unmount() { ::umount(path.c_str()); }
  } unmount{volume};
  std::string out, err;
  EXPECT_EQ(run_metile("synth-model " + volume.string() + " --max-shard-mb 0.02", out, err), 0) << err;
  EXPECT_EQ(err, "");
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(volume)) files.push_back(entry.path().filename());
  std::sort(files.begin(), files.end());
  ASSERT_FALSE(files.empty());
  EXPECT_EQ(files.front(), "config.json");  // and nothing staged is left (a hidden name sorts first)
  EXPECT_EQ(files.back(), "model.safetensors.index.json");
  EXPECT_EQ(run_metile("logits " + volume.string() + " --prompt-ids 1,2", out, err), 0) << err;
  for (const auto& entry : std::filesystem::directory_iterator(root_)) {
    EXPECT_EQ(entry.path().filename().string().find(".partial-"), std::string::npos) << entry.path();
  }
}

// A path the system cannot look at (a loop of symbolic links, a name longer than a file name may be)
// is bad input naming the path, exit 2: the model commands and synth-model asked std::filesystem's
// throwing calls, whose filesystem_error reached main as "metile: internal error", exit 1.
TEST_F(MalformedCheckpoint, PathsTheSystemCannotLookAtAreBadInput) {
  const std::filesystem::path directory = synth("model", {});
  std::string out, err;
  const auto expect_bad_input = [&](const std::string& arguments, const std::filesystem::path& named,
                                    const std::string& reason) {
    SCOPED_TRACE(arguments);
    EXPECT_EQ(run_metile(arguments, out, err), 2);
    EXPECT_EQ(err, "metile: error: " + named.string() + ": " + reason + "\n");
    EXPECT_EQ(out, "");
  };
  const std::string loop = "Too many levels of symbolic links";
  std::filesystem::create_symlink("loop", root_ / "loop");  // a link to itself
  expect_bad_input("logits " + (root_ / "loop").string() + " --prompt-ids 1", root_ / "loop", loop);
  expect_bad_input("synth-model " + (root_ / "loop" / "x").string(), root_ / "loop" / "x", loop);
  expect_bad_input("synth-model " + (root_ / "loop" / "x" / "y").string(), root_ / "loop" / "x" / "y", loop);
  // A directory no folder can be made in (/sys refuses even root) is named, not this run's staging folder.
  if (std::filesystem::is_directory("/sys")) {
    EXPECT_EQ(run_metile("synth-model /sys/new_model", out, err), 2);
    EXPECT_TRUE(err.starts_with("metile: error: /sys: cannot write there: ")) << err;
  }
  // A parent that is a file is not a missing directory.
  testing::write_text(root_ / "a_file", "x");
  expect_bad_input("synth-model " + (root_ / "a_file" / "sub").string(), root_ / "a_file", "is not a directory");
  expect_bad_input("synth-model " + (root_ / "none" / "sub").string(), root_ / "none", "parent directory does not exist");
  const std::string long_name(300, 'n');  // past NAME_MAX (255)
  expect_bad_input("synth-model " + (root_ / long_name).string(), root_ / long_name, "File name too long");
  expect_bad_input("verify-model " + (root_ / long_name).string(), root_ / long_name, "File name too long");
  // Each file of a checkpoint in turn, a link to itself (the shards through the index).
  SynthOptions small_shards;
  small_shards.max_shard_mb = 0.02;
  const std::filesystem::path sharded = synth("sharded", small_shards);
  for (const auto& [checkpoint, file] : {std::pair{directory, "config.json"}, std::pair{directory, "model.safetensors"},
                                         std::pair{sharded, "model.safetensors.index.json"}}) {
    const std::filesystem::path broken = root_ / ("broken_" + std::string(file));
    std::filesystem::copy(checkpoint, broken);
    std::filesystem::remove(broken / file);
    std::filesystem::create_symlink(file, broken / file);
    expect_bad_input("logits " + broken.string() + " --prompt-ids 1", broken / file, loop);
  }
  // Beside an index, a model.safetensors the system cannot look at is not taken for absent.
  const std::filesystem::path beside = root_ / "beside_index";
  std::filesystem::copy(sharded, beside);
  std::filesystem::create_symlink("model.safetensors", beside / "model.safetensors");
  expect_bad_input("logits " + beside.string() + " --prompt-ids 1", beside / "model.safetensors", loop);
  // A link whose target is gone (config.json, the index, or the one weight file) is named with its
  // target, not reported as a checkpoint without weight files ("neither model.safetensors nor ...")
  // or without a config ("DIR: no config.json").
  for (const auto& [checkpoint, file] : {std::pair{directory, "config.json"}, std::pair{directory, "model.safetensors"},
                                         std::pair{sharded, "model.safetensors.index.json"}}) {
    const std::filesystem::path dangling = root_ / ("dangling_" + std::string(file));
    std::filesystem::copy(checkpoint, dangling);
    std::filesystem::remove(dangling / file);
    std::filesystem::create_symlink(root_ / "gone" / file, dangling / file);
    expect_bad_input("logits " + dangling.string() + " --prompt-ids 1", dangling / file,
                     "a symbolic link to " + (root_ / "gone" / file).string() + ", which does not exist");
  }
}

// Without a GPU (CI) every --backend cuda command and bench-model is one line and exit 2,
// before the checkpoint is read; bad arguments are one line wherever they are. On a machine
// with a GPU the commands run instead (the GPU suites cover them), and this test is skipped.
TEST_F(MalformedCheckpoint, CudaCommandsWithoutAGpuAreOneLine) {
  const std::filesystem::path directory = synth("model", {});
  std::string out, err;
  const auto metile = [&](const std::string& arguments) { return run_metile(arguments, out, err); };
  // Argument errors come before the device is looked for.
  EXPECT_EQ(metile("bench-model"), 2);
  EXPECT_EQ(err, "metile: error: bench-model: give either MODEL_DIR or --preset NAME\n");
  EXPECT_EQ(metile("bench-model " + directory.string() + " --preset tiny"), 2);
  EXPECT_EQ(err, "metile: error: bench-model: give either MODEL_DIR or --preset NAME\n");
  EXPECT_EQ(metile("bench-model --preset tiny --quantize 5"), 2);
  EXPECT_EQ(err, "metile: error: --quantize must be 4 or 8, got '5'\n");
  EXPECT_EQ(metile("bench-model --preset tiny --decline a,,b"), 2);
  EXPECT_EQ(err, "metile: error: --decline: an empty region kind in 'a,,b'\n");
  // A misspelt kind declined nothing without a word; every kind is named in the message, and the
  // other commands say it before a device is looked for.
  const std::string not_a_kind =
      "metile: error: --decline: 'swigl_mlp' is not a region kind (one of: attention_output_projection, contraction, "
      "contraction_argmax, contraction_epilogue, elementwise_chain, flash_attention, qkv_rope_kv_cache, "
      "residual_add_rms_norm, rope_kv_cache, row_reduction, sibling_contractions, swiglu_mlp)\n";
  for (const std::string& command : {std::string("bench-model --preset tiny"),
                                     "verify-model " + directory.string() + " --backend cuda",
                                     "generate " + directory.string() + " --prompt-ids 1,2 --tokens 3 --backend cuda"}) {
    EXPECT_EQ(metile(command + " --decline swiglu_mlp,swigl_mlp"), 2) << command;
    EXPECT_EQ(err, not_a_kind) << command;
  }
  EXPECT_EQ(metile("bench-model --preset tiny --engines fused,cublas"), 2);
  EXPECT_EQ(err, "metile: error: --engines: unknown engine 'cublas' (fused, fused-pdl, native)\n");
  EXPECT_EQ(metile("bench-model --preset tiny --engines ,"), 2);
  EXPECT_EQ(err, "metile: error: --engines: an empty engine in ','\n");
  EXPECT_EQ(metile("bench-model --preset tiny --format yaml"), 2);
  EXPECT_EQ(err.find('\n'), err.size() - 1) << err;
  EXPECT_EQ(metile("bench-model --preset tiny --tournament-caches lukewarm"), 2);
  EXPECT_NE(err.find("--tournament-caches"), std::string::npos) << err;
  EXPECT_EQ(err.find('\n'), err.size() - 1) << err;
  // The preset and the counts too: they were checked only once a device was open (and a preset written),
  // so without a GPU --decode-steps 0 said "no CUDA device", and a --context near 2^63 overflowed the
  // capacity it asked for into a negative max-seq.
  for (const auto& [arguments, message] :
       {std::pair{"--preset huge", "unknown preset 'huge' (tiny, small, llama3.2-1b, qwen2.5-1.5b or llama3-8b)"},
        std::pair{"--preset tiny --layers 5000", "layers 5000 must be 1..1024"},
        std::pair{"--preset tiny --decode-steps 0", "bench-model: --decode-steps 0 must be at least 1"},
        std::pair{"--preset tiny --context -3", "bench-model: --context -3 must be at least 1"},
        std::pair{"--preset tiny --prefill-tokens 0", "bench-model: --prefill-tokens 0 must be at least 1"},
        std::pair{"--preset tiny --context 9223372036854775807",
                  "bench-model: --context 9223372036854775807, --prefill-tokens 512 and --decode-steps 64 need "
                  "9223372036854775807 cached positions, more than 2^31 (positions are 32-bit integers)"},
        std::pair{"--preset tiny --context 2147483600",
                  "bench-model: --context 2147483600, --prefill-tokens 512 and --decode-steps 64 need 2147483668 "
                  "cached positions, more than 2^31 (positions are 32-bit integers)"},
        // A --max-seq too small for the run: said before any device is looked for (it was found only
        // after the model was on the GPU).
        std::pair{"--preset tiny --context 128 --decode-steps 8 --prefill-tokens 64 --max-seq 100",
                  "bench-model: --context 128, --prefill-tokens 64 and --decode-steps 8 need 140 cached tokens, past "
                  "the KV-cache capacity 100 (--max-seq)"}}) {
    EXPECT_EQ(metile(std::string("bench-model ") + arguments), 2) << arguments;
    EXPECT_EQ(err, fmt::format("metile: error: {}\n", message)) << arguments;
  }
  // The near-tie margin: a fraction in (0, 10], and only with the race it sizes (on unless turned off).
  for (const std::string& arguments : {std::string("--race-near-ties --near-tie-margin 0"),
                                       std::string("--near-tie-margin x"), std::string("--near-tie-margin 0x0.1p0"),
                                       std::string("--near-tie-margin nan"),
                                       std::string("--no-race-near-ties --near-tie-margin 0.3")}) {
    EXPECT_EQ(metile("bench-model --preset tiny " + arguments), 2) << arguments;
    EXPECT_NE(err.find("--near-tie-margin"), std::string::npos) << arguments << ": " << err;
    EXPECT_EQ(err.find('\n'), err.size() - 1) << err;
  }
  // The L2 prefetch's budget: 1..1024 MiB, a decimal number, and only with the prefetch it sizes (off by default).
  for (const std::string& arguments :
       {std::string("--weight-prefetch raced --weight-prefetch-mb 0"), std::string("--weight-prefetch raced --weight-prefetch-mb 2000"),
        std::string("--weight-prefetch always --weight-prefetch-mb nan"), std::string("--weight-prefetch raced --weight-prefetch-mb 0x10"),
        std::string("--weight-prefetch-mb 16"), std::string("--weight-prefetch off --weight-prefetch-mb 16")}) {
    EXPECT_EQ(metile("bench-model --preset tiny " + arguments), 2) << arguments;
    EXPECT_NE(err.find("--weight-prefetch-mb"), std::string::npos) << arguments << ": " << err;
    EXPECT_EQ(err.find('\n'), err.size() - 1) << err;
  }

  if (metile("logits " + directory.string() + " --prompt-ids 1,2 --backend cuda") == 0) {
    GTEST_SKIP() << "a CUDA device is present: --backend cuda runs (the gpu suites test it)";
  }
  // A command with --backend cuda points at --backend cpu; bench-model, which has no CPU backend,
  // names itself and says so instead of pointing at an option it does not take.
  for (const auto& [arguments, prefix, hint] :
       {std::tuple{"logits " + directory.string() + " --prompt-ids 1,2 --backend cuda",
                   "metile: error: --backend cuda: no CUDA device: ", "(--backend cpu runs everywhere)\n"},
        std::tuple{"generate " + directory.string() + " --prompt-ids 1,2 --tokens 3 --backend cuda",
                   "metile: error: --backend cuda: no CUDA device: ", "(--backend cpu runs everywhere)\n"},
        std::tuple{"verify-model " + directory.string() + " --backend cuda --decline swiglu_mlp",
                   "metile: error: --backend cuda: no CUDA device: ", "(--backend cpu runs everywhere)\n"},
        std::tuple{std::string("bench-model --preset tiny --context 16"), "metile: error: bench-model: no CUDA device: ",
                   "(it measures the GPU engine; it has no CPU backend)\n"}}) {
    SCOPED_TRACE(arguments);
    EXPECT_EQ(metile(arguments), 2);
    EXPECT_EQ(out, "");
    EXPECT_EQ(err.rfind(prefix, 0), 0u) << err;
    EXPECT_TRUE(err.ends_with(hint)) << err;
    EXPECT_EQ(err.find('\n'), err.size() - 1) << err;  // one line
  }
}

}  // namespace
}  // namespace metile
