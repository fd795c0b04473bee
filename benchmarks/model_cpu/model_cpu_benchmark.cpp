// CPU decode speed and memory of a decoder model (include/metile/model.h) on this machine.
//   model_cpu_benchmark [--preset small] [--tokens 16] [--max-seq 512] [--model DIR]
// Synthesizes the preset into a temporary directory (or reads --model), then for
// each format (bf16 dense, 8-bit and 4-bit quantized at load) loads the model,
// prefills a 4-token prompt and decodes --tokens tokens greedily on the reference
// executor. Prints one row per format: weights in memory, resident memory after the
// run (VmRSS) and its peak so far (VmHWM), load time, decode tokens/s (wall clock)
// and CPU seconds per token (user + system of all threads: on a shared machine the
// wall clock also counts other people's work; the load average is printed).
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <thread>

#include <fmt/core.h>

#include "../support/benchmark_options.h"
#include "metile/model.h"

namespace {

double cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) * 1e-6;
}

double status_mb(const char* field) {  // VmRSS / VmHWM from /proc/self/status, in MB
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field, 0) == 0) return std::stod(line.substr(std::strlen(field) + 1)) / 1024.0;
  }
  return 0;
}

std::string load_average() {
  std::ifstream file("/proc/loadavg");
  std::string one;
  file >> one;
  return one;
}

}  // namespace

int main(int argc, char** argv) {
  std::string preset = "small", model_dir;
  std::int64_t tokens = 16, max_seq = 512;
  CLI::App app{"CPU decode speed and memory of a checkpoint in bf16, 8-bit and 4-bit", "model_cpu_benchmark"};
  app.add_option("--preset", preset, "synthesize this preset (tiny, small, llama3.2-1b, ...) into a temporary folder")
      ->capture_default_str();
  app.add_option("--model", model_dir, "a checkpoint directory instead of --preset");
  app.add_option("--tokens", tokens, "decode tokens after a 4-token prompt")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--max-seq", max_seq, "KV-cache capacity")
      ->check(CLI::Range(std::int64_t{5}, std::int64_t{1} << 31))
      ->capture_default_str();
  if (const std::optional<int> exit_code = metile::benchmarks::parse_benchmark_options(app, argc, argv)) return *exit_code;
  if (tokens + 4 > max_seq) {
    fmt::print(stderr, "model_cpu_benchmark: error: {} tokens after a 4-token prompt do not fit --max-seq {}\n", tokens,
               max_seq);
    return 2;
  }
  std::filesystem::path temporary;  // the synthesized checkpoint, removed however the run ends
  struct RemoveAtExit {
    const std::filesystem::path& path;
    ~RemoveAtExit() {
      std::error_code ignored;
      if (!path.empty()) std::filesystem::remove_all(path, ignored);
    }
  } remove_at_exit{temporary};
  try {
    std::filesystem::path directory = model_dir;
    if (directory.empty()) {
      temporary = std::filesystem::temp_directory_path() / fmt::format("metile_model_cpu_{}", ::getpid());
      fmt::print(stderr, "model_cpu_benchmark: synthesizing '{}' into {}\n", preset, temporary.string());
      metile::SynthOptions options;
      options.preset = preset;
      options.seed = 1;
      metile::synthesize_model(temporary, options);
      directory = temporary;
    }
    fmt::print("model {} ({}), {} decode tokens after a 4-token prompt, KV capacity {}, {} hardware threads, "
               "load average {}\n",
               model_dir.empty() ? preset : model_dir, directory.string(), tokens, max_seq,
               std::thread::hardware_concurrency(), load_average());
    fmt::print("{:<8} {:>10} {:>12} {:>10} {:>8} {:>12} {:>14} {:>10}\n", "format", "params M", "weights MB",
               "RSS MB", "peak MB", "load s", "tokens/s", "CPU s/token");
    struct Format {
      const char* name;
      std::optional<metile::AffineQuantization> quantize;
    };
    for (const Format& format : {Format{"bf16", {}}, Format{"q8", metile::AffineQuantization{8, 64}},
                                 Format{"q4", metile::AffineQuantization{4, 64}}}) {
      const auto load_start = std::chrono::steady_clock::now();
      const metile::DecoderModel model =
          metile::DecoderModel::load(directory, {metile::DType::bf16, format.quantize, max_seq});
      const double load_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
      metile::DecodeSession session(model);
      const std::vector<std::int32_t> prompt{1, 2, 3, 4};
      session.feed(prompt);
      const double cpu_before = cpu_seconds();
      const auto start = std::chrono::steady_clock::now();
      std::int32_t token = 5;
      for (std::int64_t step = 0; step < tokens; ++step) {
        const std::vector<float> logits = session.feed(std::span<const std::int32_t>(&token, 1));
        token = static_cast<std::int32_t>(metile::argmax_index(logits));
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const double cpu = cpu_seconds() - cpu_before;
      fmt::print("{:<8} {:>10.1f} {:>12.1f} {:>10.1f} {:>8.1f} {:>12.2f} {:>14.2f} {:>10.3f}\n", format.name,
                 static_cast<double>(model.parameter_count()) / 1e6,
                 static_cast<double>(model.weight_bytes()) / 1e6, status_mb("VmRSS:"), status_mb("VmHWM:"),
                 load_seconds, static_cast<double>(tokens) / seconds, cpu / static_cast<double>(tokens));
    }
    fmt::print("load average after the runs: {}\n", load_average());
  } catch (const std::exception& error) {
    fmt::print(stderr, "model_cpu_benchmark: error: {}\n", error.what());
    return 2;
  }
  return 0;
}
