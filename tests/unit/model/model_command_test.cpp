// The model commands' output (tools/metile/model_commands.cpp) on a tiny synthetic checkpoint:
// `metile logits --format json`, with and without --all-positions, against the same prompt fed
// in this process (DecodeSession, the CPU path the command runs); `metile generate`'s rate, which
// one token does not have, its sampling and its end-of-sequence stop.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>
#include <thread>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "model_test_support.h"

namespace metile {
namespace {

using Json = nlohmann::json;

class ModelCommand : public testing::ModelDirectoryTest {};

TEST_F(ModelCommand, LogitsJsonGivesTheLastOrEveryPosition) {
  const std::filesystem::path directory = synth("model", {});
  std::mt19937_64 generator(testing::model_test_seed());
  const DecoderModel model = DecoderModel::load(directory);
  const std::int64_t vocab = model.config().vocab_size;
  const std::vector<std::int32_t> prompt = testing::random_tokens(generator, 5, vocab);
  std::string ids;
  for (std::int32_t token : prompt) ids += (ids.empty() ? "" : ",") + std::to_string(token);
  DecodeSession session(model);
  const std::vector<float> expected = session.feed(prompt);  // every position's, row after row
  ASSERT_EQ(expected.size(), prompt.size() * static_cast<std::size_t>(vocab));

  std::string out, err;
  ASSERT_EQ(run_metile("logits " + directory.string() + " --prompt-ids " + ids + " --format json", out, err), 0) << err;
  const Json last = Json::parse(out);
  ASSERT_EQ(run_metile("logits " + directory.string() + " --prompt-ids " + ids + " --format json --all-positions", out, err),
            0)
      << err;
  const Json every = Json::parse(out);
  ASSERT_EQ(last["logits"].size(), static_cast<std::size_t>(vocab));
  ASSERT_EQ(every["logits"].size(), expected.size());
  for (std::size_t index = 0; index < expected.size(); ++index) {
    EXPECT_EQ(every["logits"][index].get<double>(), static_cast<double>(expected[index])) << "element " << index;
  }
  const std::size_t last_row = expected.size() - static_cast<std::size_t>(vocab);
  for (std::size_t column = 0; column < static_cast<std::size_t>(vocab); ++column) {
    EXPECT_EQ(last["logits"][column].get<double>(), static_cast<double>(expected[last_row + column])) << column;
  }
  EXPECT_EQ(every["argmax"], last["argmax"]);
  ASSERT_EQ(last["argmax"].size(), prompt.size());
  for (std::size_t row = 0; row < prompt.size(); ++row) {
    const std::vector<double> values(expected.begin() + static_cast<std::ptrdiff_t>(row * vocab),
                                     expected.begin() + static_cast<std::ptrdiff_t>((row + 1) * vocab));
    EXPECT_EQ(last["argmax"][row].get<std::int64_t>(), testing::brute_force_argmax(values)) << "row " << row;
  }

  EXPECT_EQ(run_metile("logits " + directory.string() + " --prompt-ids 1 --all-positions", out, err), 2);
  EXPECT_EQ(err, "metile: error: --all-positions needs --format json\n");
  EXPECT_EQ(out, "");
}

// A logit that is not finite (here a NaN row of the output projection, the model's own) is the string
// "NaN" in --format json: nlohmann wrote null, which a reader takes for "absent", and JSON has no NaN.
TEST_F(ModelCommand, NonFiniteLogitsAreNamedInJson) {
  const std::filesystem::path directory = synth("model", {});
  TensorMap tensors = read_safetensors(directory / "model.safetensors");
  const std::string head = tensors.contains("lm_head.weight") ? "lm_head.weight" : "model.embed_tokens.weight";
  HostTensor& weight = tensors.at(head);
  const std::int64_t row = 7, width = weight.spec().shape[1];
  for (std::int64_t column = 0; column < width; ++column) {
    weight.store(row * width + column, std::numeric_limits<double>::quiet_NaN());
  }
  write_safetensors(directory / "model.safetensors", tensors);
  const DecoderModel model = DecoderModel::load(directory);
  const std::vector<std::int32_t> prompt = {1, 2};
  const std::vector<float> expected = DecodeSession(model).feed(prompt);
  const std::size_t vocab = expected.size() / 2;
  std::string out, err;
  ASSERT_EQ(run_metile("logits " + directory.string() + " --prompt-ids 1,2 --format json", out, err), 0) << err;
  const Json json = Json::parse(out);  // strict JSON
  ASSERT_EQ(json["logits"].size(), vocab);
  for (std::size_t column = 0; column < vocab; ++column) {
    const float value = expected[vocab + column];
    if (std::isnan(value)) {
      EXPECT_EQ(json["logits"][column], "NaN") << column;
    } else {
      EXPECT_EQ(json["logits"][column].get<double>(), static_cast<double>(value)) << column;
    }
  }
  EXPECT_TRUE(std::isnan(expected[vocab + static_cast<std::size_t>(row)]));
  // verify-model fails on such a model, naming the reference's own NaN (no plan is to blame), in JSON too.
  ASSERT_EQ(run_metile("verify-model " + directory.string() + " --tokens 3 --format json", out, err), 1) << err;
  const Json verdict = Json::parse(out);
  EXPECT_EQ(verdict["passed"], false);
  EXPECT_EQ(verdict["figures"]["nonfinite_reference_positions"], 3) << out;
}

// The first token comes from the prompt's step; the rate counts decode steps, so one token has none
// (it printed 0.00 tokens/s, which reads as a stall).
TEST_F(ModelCommand, GenerateGivesNoRateForOneToken) {
  const std::filesystem::path directory = synth("model", {});
  std::string out, err;
  ASSERT_EQ(run_metile("generate " + directory.string() + " --prompt-ids 1,2 --tokens 1 --format json", out, err), 0) << err;
  const Json one = Json::parse(out);
  EXPECT_EQ(one["tokens"].size(), 1u);
  EXPECT_TRUE(one["tokens_per_second"].is_null()) << out;
  EXPECT_NE(err.find("1 token after a 2-token prompt, n/a tokens/s"), std::string::npos) << err;
  ASSERT_EQ(run_metile("generate " + directory.string() + " --prompt-ids 1,2 --tokens 3 --format json", out, err), 0) << err;
  const Json three = Json::parse(out);
  EXPECT_EQ(three["tokens"].size(), 3u);
  ASSERT_TRUE(three["tokens_per_second"].is_number()) << out;
  EXPECT_GT(three["tokens_per_second"].get<double>(), 0);
  // verify-model times positions - 1 decode steps: none for one position.
  ASSERT_EQ(run_metile("verify-model " + directory.string() + " --tokens 1 --format json", out, err), 0) << err;
  const Json verified = Json::parse(out);
  EXPECT_TRUE(verified["tokens_per_second"]["reference"].is_null()) << out;
  EXPECT_TRUE(verified["tokens_per_second"]["planned"].is_null()) << out;
}

// generate --temperature: the tokens generate() draws in this process with the same options and seed
// (the command is one front end of it), the choice named on stderr; the sampling options refused one
// line each, and without a temperature (0 is greedy, where they would mean nothing).
TEST_F(ModelCommand, GenerateSamplesAsTheLibraryDoes) {
  const std::filesystem::path directory = synth("model", {});
  const DecoderModel model = DecoderModel::load(directory);
  const std::vector<std::int32_t> prompt = {3, 1, 4};
  const SamplingOptions sampling{0.8, 20, 0.9, testing::model_test_seed()};
  DecodeSession session(model);
  const Generation expected = generate(session, prompt, 6, sampling);
  std::string out, err;
  const std::string command = "generate " + directory.string() + " --prompt-ids 3,1,4 --tokens 6 --format json";
  ASSERT_EQ(run_metile(command + " --temperature 0.8 --top-k 20 --top-p 0.9 --seed " + std::to_string(sampling.seed),
                       out, err),
            0)
      << err;
  EXPECT_EQ(Json::parse(out)["tokens"].get<std::vector<std::int32_t>>(), expected.tokens);
  EXPECT_NE(err.find("sampled at temperature 0.8, top-k 20, top-p 0.9, seed " + std::to_string(sampling.seed)),
            std::string::npos)
      << err;
  ASSERT_EQ(run_metile(command, out, err), 0) << err;
  EXPECT_NE(err.find("(bf16 on cpu, greedy)"), std::string::npos) << err;
  for (const auto& [options, message] : std::vector<std::pair<std::string, std::string>>{
           {" --temperature -1", "--temperature -1 must be a finite number >= 0 (0: greedy)"},
           {" --temperature 1 --top-k -3", "--top-k -3 must be >= 0 (0: every token)"},
           {" --temperature 1 --top-p 0", "--top-p 0 must be in (0, 1] (1: every token)"},
           {" --top-k 5", "--top-k, --top-p and --seed pick among sampled tokens: give --temperature above 0 too "
                          "(0, or one a double rounds to 0, is greedy)"},
           {" --temperature 1e-999 --top-k 5", "--top-k, --top-p and --seed pick among sampled tokens: give "
                                               "--temperature above 0 too (0, or one a double rounds to 0, is greedy)"},
           {" --temperature 1 --seed -1", "--seed must be an integer from 0 to 2^64 - 1, got '-1'"}}) {
    EXPECT_EQ(run_metile(command + options, out, err), 2) << options;
    EXPECT_EQ(err.rfind("metile: error: " + message, 0), 0u) << options << ": " << err;
    EXPECT_EQ(out, "") << options;
  }
}

// generate ends after the checkpoint's end-of-sequence token (generation_config.json's eos_token_id here),
// keeping it, and says so; --ignore-eos gives every --tokens. The oracle is the library's generation
// without stop tokens, cut after the first token the stop set holds (one drawn from that generation).
TEST_F(ModelCommand, GenerateEndsAtTheEndOfSequenceTokenUnlessIgnored) {
  const std::filesystem::path directory = synth("model", {});
  const std::vector<std::int32_t> prompt = {2, 7, 1};
  const DecoderModel model = DecoderModel::load(directory);
  DecodeSession session(model);
  const std::vector<std::int32_t> unstopped = generate_greedy(session, prompt, 10).tokens;
  std::mt19937_64 generator(testing::model_test_seed() + 3);
  const std::int32_t eos = unstopped[generator() % unstopped.size()];
  const std::size_t end = std::find(unstopped.begin(), unstopped.end(), eos) - unstopped.begin();
  testing::write_text(directory / "generation_config.json", fmt::format(R"({{"eos_token_id": [100000, {}]}})", eos));
  std::string out, err;
  const std::string command = "generate " + directory.string() + " --prompt-ids 2,7,1 --tokens 10 --format json";
  ASSERT_EQ(run_metile(command, out, err), 0) << err;
  EXPECT_EQ(Json::parse(out)["tokens"].get<std::vector<std::int32_t>>(),
            std::vector<std::int32_t>(unstopped.begin(), unstopped.begin() + static_cast<std::ptrdiff_t>(end) + 1));
  EXPECT_TRUE(Json::parse(out)["stopped_at_eos"].get<bool>());
  // "1 token" where the stop token is the first one generated.
  EXPECT_NE(err.find(fmt::format("{} token{} after a 3-token prompt, ended by end-of-sequence token {},", end + 1,
                                 end == 0 ? "" : "s", eos)),
            std::string::npos)
      << err;
  ASSERT_EQ(run_metile(command + " --ignore-eos", out, err), 0) << err;
  EXPECT_EQ(Json::parse(out)["tokens"].get<std::vector<std::int32_t>>(), unstopped);
  EXPECT_FALSE(Json::parse(out)["stopped_at_eos"].get<bool>());
  EXPECT_EQ(err.find("end-of-sequence"), std::string::npos) << err;
  // A generation_config.json that is not one is a warning, not a failure: logits needs no end of sequence.
  testing::write_text(directory / "generation_config.json", "{\"eos_token_id\": [1,");
  ASSERT_EQ(run_metile("logits " + directory.string() + " --prompt-ids 2,7,1", out, err), 0) << err;
  EXPECT_EQ(err.rfind("metile: warning: " + (directory / "generation_config.json").string() + ": ", 0), 0u) << err;
  EXPECT_NE(err.find("; generation ends at config.json's eos_token_id instead (none)\n"), std::string::npos) << err;
}

// --quantize keeps a matrix dense when its columns are not whole groups (as MLX does), and says so:
// the tiny preset's hidden size is 64, its intermediate size a multiple of 128 or not.
TEST_F(ModelCommand, QuantizingNamesTheMatricesItLeavesDense) {
  const std::filesystem::path directory = synth("model", {});
  const DecoderModel model = DecoderModel::load(directory);
  const ModelConfig& config = model.config();
  std::string out, err;
  ASSERT_EQ(run_metile("logits " + directory.string() + " --prompt-ids 1 --quantize 4 --group-size 64", out, err), 0) << err;
  EXPECT_EQ(err.find("note:"), std::string::npos) << "64 divides every width: " << err;
  ASSERT_EQ(run_metile("logits " + directory.string() + " --prompt-ids 1 --quantize 4 --group-size 128", out, err), 0) << err;
  ASSERT_EQ(config.hidden_size % 128, 64) << "the test expects hidden 64 (mod 128)";
  EXPECT_NE(err.find("metile: note: --quantize leaves q/k/v, gate/up, the embedding, the LM head"), std::string::npos) << err;
  EXPECT_NE(err.find(std::to_string(config.hidden_size) + " columns are not a multiple of --group-size 128"),
            std::string::npos)
      << err;
  EXPECT_EQ(err.find("the down projection") != std::string::npos, config.intermediate_size % 128 != 0) << err;
  // What it left dense is what the model holds dense.
  LoadOptions options;
  options.quantize = AffineQuantization{4, 128};
  const DecoderModel quantized = DecoderModel::load(directory, options);
  EXPECT_FALSE(quantized.is_quantized("model.layers.0.mlp.up_proj"));
  EXPECT_EQ(quantized.is_quantized("model.layers.0.mlp.down_proj"), config.intermediate_size % 128 == 0);
  // synth-model --quantize writes the same matrices dense, and says so the same way.
  ASSERT_EQ(run_metile("synth-model " + (root_ / "q128").string() + " --quantize 4 --group-size 128", out, err), 0) << err;
  EXPECT_NE(err.find("metile: note: --quantize leaves q/k/v, gate/up, the embedding, the LM head"), std::string::npos) << err;
  const DecoderModel written = DecoderModel::load(root_ / "q128");
  EXPECT_FALSE(written.is_quantized("model.layers.0.mlp.up_proj"));
  EXPECT_EQ(written.is_quantized("model.layers.0.mlp.down_proj"), config.intermediate_size % 128 == 0);
}

// One interrupt sent twice (`timeout -s INT`: to the process, then to its process group) is one: the
// second copy, a moment after the first, ended the process before it removed its staging folder, and a
// rerun into the same directory found it "not empty". The copies here are sent 50 ms apart once the
// staging folder exists (back to back, the kernel may merge them into one pending signal); the command
// must leave the directory as it found it, empty.
TEST_F(ModelCommand, SynthModelInterruptedTwiceQuicklyLeavesNothing) {
  const std::filesystem::path directory = root_ / "interrupted";
  std::filesystem::create_directory(directory);
  const std::filesystem::path errors = root_ / "interrupted.err";
  const pid_t child = start_metile({"synth-model", directory.string(), "--preset", "small"}, errors);
  ASSERT_GE(child, 0);
  const auto started = std::chrono::steady_clock::now();
  while (std::filesystem::is_empty(directory) && std::chrono::steady_clock::now() - started < std::chrono::seconds(60)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_FALSE(std::filesystem::is_empty(directory)) << "no staging folder within 60 s";
  ::kill(child, SIGINT);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ::kill(child, SIGINT);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "it finished before the interrupt: nothing tested";
  EXPECT_TRUE(std::filesystem::is_empty(directory)) << testing::read_text(errors);
}

// A new directory of a valid 250-byte name: its staging directory beside it (".NAME.partial-PID")
// went past NAME_MAX, and synth-model failed with "File name too long".
TEST_F(ModelCommand, SynthModelWritesADirectoryOfAnyValidName) {
  const std::filesystem::path directory = root_ / std::string(250, 'm');
  std::string out, err;
  ASSERT_EQ(run_metile("synth-model " + directory.string() + " --preset tiny", out, err), 0) << err;
  EXPECT_EQ(DecoderModel::load(directory).config().hidden_size, 64);
  for (const auto& entry : std::filesystem::directory_iterator(root_)) {  // no staging directory is left beside it
    EXPECT_FALSE(entry.path().filename().string().starts_with(".")) << entry.path();
  }
}

// --config-spelling is decimal, as every integer option: CLI11 alone read "010" as octal 8 ("config
// spelling 8 is not 4 or 5", a number the user never wrote) and wrote a transformers-5 config for "0x5".
TEST_F(ModelCommand, ConfigSpellingIsDecimal) {
  std::string out, err;
  for (const std::string spelling : {"0x5", "0x4", "0b101"}) {
    EXPECT_EQ(run_metile("synth-model " + (root_ / "hex").string() + " --config-spelling " + spelling, out, err), 2)
        << spelling;
    EXPECT_EQ(err, fmt::format("metile: error: --config-spelling: '{}' is not a decimal integer (see metile --help)\n",
                               spelling));
    EXPECT_FALSE(std::filesystem::exists(root_ / "hex")) << spelling;
  }
  EXPECT_EQ(run_metile("synth-model " + (root_ / "octal").string() + " --config-spelling 010", out, err), 2);
  EXPECT_EQ(err, "metile: error: config spelling 10 is not 4 or 5\n");
  ASSERT_EQ(run_metile("synth-model " + (root_ / "five").string() + " --config-spelling 005", out, err), 0) << err;
  EXPECT_NE(testing::read_text(root_ / "five" / "config.json").find("\"rope_parameters\""), std::string::npos);
}

// --group-size without --quantize would change nothing (the weights stay as the checkpoint has them),
// so every command that takes it refuses it alone, with exit 2 and nothing on stdout.
TEST_F(ModelCommand, GroupSizeWithoutQuantizeIsRefused) {
  const std::filesystem::path directory = synth("model", {});
  const std::string model = directory.string();
  for (const std::string& command :
       {"logits " + model + " --prompt-ids 1", "generate " + model + " --prompt-ids 1", "verify-model " + model,
        "bench-model " + model, "synth-model " + (root_ / "alone").string()}) {
    std::string out, err;
    EXPECT_EQ(run_metile(command + " --group-size 32", out, err), 2) << command;
    EXPECT_NE(err.find("--group-size requires --quantize"), std::string::npos) << command << ": " << err;
    EXPECT_EQ(out, "") << command;
  }
  EXPECT_FALSE(std::filesystem::exists(root_ / "alone"));
}

// With --backend cuda a mistake in an argument read "no CUDA device" on a machine without one (the GPU was
// looked for first): every argument is checked before the device, so each command says what is wrong,
// on any machine, with exit 2 and nothing on stdout.
TEST_F(ModelCommand, ArgumentsAreCheckedBeforeTheDevice) {
  const std::filesystem::path directory = synth("model", {});
  const std::string model = directory.string();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"logits " + model + " --prompt-ids 1 --backend cuda --quantize 3", "--quantize must be 4 or 8, got '3'"},
      {"logits " + model + " --prompt-ids 1 --backend cuda --max-seq -5", "--max-seq -5 is negative"},
      {"generate " + model + " --prompt-ids 1 --tokens 2 --backend cuda --quantize 4 --group-size 33", "group"},
      {"verify-model " + model + " --backend cuda --quantize 9", "--quantize must be 4 or 8, got '9'"},
      {"logits /nonexistent --prompt-ids 1 --backend cuda", "/nonexistent: not a model directory (no such directory)"},
      {"bench-model " + model + " --max-seq -4", "--max-seq -4 is negative"},
      {"bench-model " + model + " --max-seq 99999999999", "at most 2^31 positions"},
      {"bench-model /etc/passwd", "/etc/passwd: not a model directory (not a directory)"},
  };
  for (const auto& [command, expected] : cases) {
    std::string out, err;
    EXPECT_EQ(run_metile(command, out, err), 2) << command;
    EXPECT_NE(err.find(expected), std::string::npos) << command << ": " << err;
    EXPECT_EQ(err.find("no CUDA device"), std::string::npos) << command << ": " << err;
    EXPECT_EQ(out, "") << command;
  }
}

}  // namespace
}  // namespace metile
