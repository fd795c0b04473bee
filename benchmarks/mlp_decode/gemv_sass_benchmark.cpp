// gemv_sass_benchmark: how many SASS instructions the affine GEMV mainloops issue per 32-bit weight
// word, per lane (issue 15: the 4-bit kernels are instruction-bound). Needs no GPU: each kernel of
// the Llama-3-8B decode MLP (or --model's) at M = 1 (gate/up and down, 4-bit and 8-bit g64, bf16) is generated,
// compiled by NVRTC for sm_90, and its cubin's mainloop (the `#pragma unroll 1` batch loop: the
// backward branch whose body holds the most HMMA) is counted by opcode.
//
//   gemv_sass_benchmark           the shapes the decode MLP races first (notes/mlp_decode.md)
//   gemv_sass_benchmark --all     every register-batch tuning candidate
//   --opcodes                     also what the 'other' column is made of, per kernel
//   --norm                        gate/up with the RMSNorm prologue, as a swiglu_mlp region runs it
//   --model NAME                  another model's MLP: llama3-8b (the default), llama3.2-1b, qwen2.5-1.5b
//                                 (without --all: the same two shapes, chosen for Llama-3-8B)
//   --rows M                      M activation rows (1..16; default 1): what M = 16 adds per weight word
//   --half                        each shape's half-products twin too (GemvKernelConfig::half_products)
//   --sequence                    also each mainloop as one character an instruction: L a global load
//                                 (LDG), m an HMMA, s a shared-memory load, '.' anything else: where ptxas
//                                 put the batch's loads relative to its math
//   --timeline                    compiled with the block timeline (METILE_TIMELINE_BASE, gemv_timeline_benchmark):
//                                 what its stamps cost in registers and in the loop
//   --qkv                         the model's q/k/v GEMV instead (the RMSNorm prologue, rope and the cache
//                                 writes in its epilogue), every register-batch candidate, 4-bit and 8-bit g64
//
// The toolchain here has no disassembler, so the cubin is read directly (cubin_kernel_instructions,
// metile/cuda_runtime.h); a BRA's byte offset is bits 16..23 (times 4) and
// 34..81 (times 1024, signed). The opcode numbers were identified on ptxas 13.0 probes; the table
// checks itself: a loop whose HMMA count is not the mma count the configuration implies is reported.
#include <fmt/core.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <future>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "metile/cuda_runtime.h"
#include "metile/gemv.h"
#include "../support/decode_mlp_stages.h"

namespace metile {
namespace {

constexpr unsigned kMma = 0x03C;

std::string opcode_name(unsigned base) {
  static const std::map<unsigned, std::string> names = {
      {0x03C, "HMMA"}, {0x012, "LOP3"}, {0x019, "SHF"}, {0x016, "PRMT"}, {0x03E, "F2FP"}, {0x023, "FFMA"},
      {0x021, "FADD"}, {0x020, "FMUL"}, {0x181, "LDG"}, {0x184, "LDS"}, {0x024, "IMAD"}, {0x025, "IMAD.WIDE"},
      {0x010, "IADD3"}, {0x00C, "ISETP"}, {0x011, "LEA"}, {0x147, "BRA"}, {0x118, "NOP"}};
  const auto found = names.find(base);
  return found == names.end() ? fmt::format("op{:03x}", base) : found->second;
}

// [first, last] of the loop (a backward branch at `last`) whose body holds the most HMMA.
std::pair<std::size_t, std::size_t> mainloop(const std::vector<CubinInstruction>& text) {
  std::pair<std::size_t, std::size_t> best{0, 0};
  int best_mma = -1;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i].opcode() != 0x947) continue;
    std::int64_t high = static_cast<std::int64_t>(((text[i].high & 0x3FFFFu) << 30) | (text[i].low >> 34));
    if (high >> 47) high -= std::int64_t{1} << 48;
    const std::int64_t offset = high * 1024 + static_cast<std::int64_t>(((text[i].low >> 16) & 0xFFu) << 2);
    const std::int64_t target = static_cast<std::int64_t>(i + 1) * 16 + offset;
    if (target < 0 || target >= static_cast<std::int64_t>(i) * 16) continue;  // forward, or a jump to itself
    const std::size_t first = static_cast<std::size_t>(target / 16);
    int mma = 0;
    for (std::size_t k = first; k <= i; ++k) mma += text[k].base() == kMma;
    if (mma > best_mma || (mma == best_mma && i - first < best.second - best.first)) {
      best = {first, i};
      best_mma = mma;
    }
  }
  return best;
}

// Per lane and loop trip: the 32-bit weight words read and the mma the source issues.
struct LoopWork {
  int words = 0, mma = 0;
};
LoopWork loop_work(const GemvKernelConfig& config) {
  const int bits = config.format.bits;
  const int columns_per_load = 32 * (bits == 8 ? 2 : 4);
  const int loads = config.format.columns_per_iteration() / columns_per_load;
  const int chunks = config.format.columns_per_iteration() / 32;
  const int products = config.epilogue.product_count();
  const int row_halves = static_cast<int>((config.rows + 7) / 8);
  const int batches = config.shared_stages == 0 && config.double_buffered ? 2 : 1;
  const int iterations = config.iterations_in_flight * batches;
  LoopWork work;
  work.words = iterations * products * config.tiles_per_block * loads * 2 * 4;
  // 4-bit: one mma per chunk and step (two per word pair); 8-bit: two words per chunk, same mma count.
  work.mma = iterations * (products * config.tiles_per_block + (config.shared_group_sums ? 0 : 1)) * chunks * 2 * row_halves;
  return work;
}

std::string shape_name(const GemvKernelConfig& config) {
  return fmt::format("{} w{}{} f{}{}{}{}",
                     config.rope_cache ? "q/k/v" : config.epilogue.product_count() == 2 ? "gate/up" : "down",
                     config.warps_per_block,
                     config.tiles_per_block > 1 ? fmt::format(" t{}", config.tiles_per_block) : std::string(),
                     config.iterations_in_flight,
                     config.shared_stages >= 2 ? fmt::format(" staged s{}", config.shared_stages)
                                               : std::string(config.double_buffered ? " db" : " batch"),
                     std::string(config.shared_group_sums ? " sums" : "") + (config.x_staged_by_async_copy ? " x-async" : "") +
                         (config.x_with_batch ? " x-batch" : "") + (config.half_products ? " half" : ""),
                     config.resident_blocks_per_multiprocessor > 0
                         ? fmt::format(" r{}", config.resident_blocks_per_multiprocessor)
                         : std::string());
}

struct MlpShape {
  std::string name, label;
  std::int64_t hidden = 0, intermediate = 0;
  std::int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
};
const std::vector<MlpShape>& mlp_shapes() {
  static const std::vector<MlpShape> shapes = {{"llama3-8b", "Llama-3-8B", 4096, 14336, 32, 8, 128},
                                               {"llama3.2-1b", "Llama-3.2-1B", 2048, 8192, 32, 8, 64},
                                               {"qwen2.5-1.5b", "Qwen2.5-1.5B", 1536, 8960, 12, 2, 128}};
  return shapes;
}

// The q/k/v GEMV of a decode step (one matrix over the stacked weights, the norm before it, rope
// and the cache writes after it), every register-batch candidate.
std::vector<GemvKernelConfig> qkv_configs(const MlpShape& model) {
  std::vector<GemvKernelConfig> configs;
  // Affine only: the table's words per lane assume an affine load (dense kernels are counted elsewhere).
  for (const GemvWeightFormat format : {GemvWeightFormat::affine(4, 64, DType::bf16), GemvWeightFormat::affine(8, 64, DType::bf16)}) {
    GemvKernelConfig qkv;
    qkv.format = format;
    qkv.in_features = model.hidden;
    qkv.out_features = (model.q_heads + 2 * model.kv_heads) * model.head_dim;
    qkv.output_splits = {model.q_heads * model.head_dim, model.kv_heads * model.head_dim, model.kv_heads * model.head_dim};
    qkv.x_rms_norm_eps = 1e-5;
    GemvRopeCacheEpilogue rope{model.q_heads, model.kv_heads, model.head_dim, 4096, {}};
    rope.rope.set("theta", 500000.0);
    rope.rope.set("dims", model.head_dim);
    rope.inputs_before_wait = true;
    qkv.rope_cache = rope;
    for (const GemvKernelConfig& config : gemv_tuning_candidates(qkv, 132)) {
      if (config.shared_stages == 0) configs.push_back(config);
    }
    // The same with x staged in shared memory by cp.async (gemv_stage_configs races that twin).
    const std::size_t register_shapes = configs.size();
    for (std::size_t c = 0; c < register_shapes; ++c) {
      if (configs[c].format != format || configs[c].resident_blocks_per_multiprocessor == 0) continue;
      GemvKernelConfig staged = configs[c];
      staged.x_staged_by_async_copy = true;
      configs.push_back(staged);
    }
  }
  return configs;
}

int run(bool all, bool opcodes, bool sequence, bool norm, bool qkv, bool half, bool timeline, std::int64_t rows,
        const MlpShape& model) {
  const std::int64_t hidden = model.hidden, intermediate = model.intermediate;
  std::vector<GemvKernelConfig> configs;
  if (qkv) configs = qkv_configs(model);
  for (int bits : {4, 8}) {
    if (qkv) break;
    const GemvWeightFormat format = GemvWeightFormat::affine(bits, 64, DType::bf16);
    auto [gate_up, down] = benchmarks::decode_mlp_stage_configs(format, rows, hidden, intermediate);
    if (norm) gate_up.x_rms_norm_eps = 1e-5;  // the gate/up stage only: down's x is the gated product
    for (const GemvKernelConfig& base : {gate_up, down}) {
      const std::vector<GemvKernelConfig> candidates = gemv_tuning_candidates(base, 132);
      for (const GemvKernelConfig& config : candidates) {
        // The decode MLP's choices on the H200 (notes/mlp_decode.md): gate/up w4 f2 batch, down w8 db.
        const bool chosen = config.shared_stages == 0 && !config.shared_group_sums &&
                            (base.epilogue.product_count() == 2 ? config.warps_per_block == 4 && !config.double_buffered
                                                                : config.warps_per_block == 8 && config.double_buffered &&
                                                                      config.iterations_in_flight == 2);
        if (all || chosen) configs.push_back(config);
      }
    }
  }
  if (half) {  // each shape, then its half-products twin where it has one
    std::vector<GemvKernelConfig> with_twins;
    for (const GemvKernelConfig& config : configs) {
      with_twins.push_back(config);
      for (const GemvKernelConfig& twin :
           gemv_half_twins({&config, 1})) {
        with_twins.push_back(twin);
      }
    }
    configs = std::move(with_twins);
  }
  fmt::print(stderr, "compiling {} kernels for sm_90 with NVRTC\n", configs.size());
  std::vector<std::future<CompiledProgram>> programs;
  for (const GemvKernelConfig& config : configs) {
    programs.push_back(std::async(std::launch::async, [kernel = generate_gemv_kernel(config), timeline] {
      CompileOptions options;
      options.architecture = "sm_90";
      options.extra = {"--ptxas-options=-v"};  // the register count
      options.use_cache = false;                // ptxas reports only on a real compile
      CompiledProgram plain = compile_cuda_program(kernel.source, kernel.kernel_name, options);
      if (!timeline) return plain;
      // Bound to the blocks an SM the plain kernel's registers give (65536 a multiprocessor, 8 a step).
      std::smatch used;
      if (!std::regex_search(plain.log, used, std::regex(R"(Used (\d+) registers)"))) return plain;
      const int registers = (std::stoi(used[1].str()) + 7) / 8 * 8;
      const int blocks = std::min<int>({65536 / (registers * static_cast<int>(kernel.block_threads)),
                                        2048 / static_cast<int>(kernel.block_threads), 32});
      return compile_cuda_program(gemv_timeline_source(kernel, 0x7f0000000000ull, blocks), kernel.kernel_name, options);
    }));
  }
  const std::vector<std::string> columns = {"HMMA", "LOP3", "SHF", "PRMT", "F2FP", "FFMA", "FADD", "FMUL", "LDG", "LDS"};
  fmt::print("{:<22} {:<28} {:>4} {:>5} {:>5} {:>5} {:>6}", fmt::format("format ({} M={})", model.label, rows), "shape", "regs",
             "spill", "instr", "words", "/word");
  for (const std::string& column : columns) fmt::print(" {:>5}", column);
  fmt::print(" {:>5}\n", "other");
  int mismatched = 0;
  for (std::size_t index = 0; index < configs.size(); ++index) {
    const GemvKernelConfig& config = configs[index];
    const CompiledProgram program = programs[index].get();
    const std::vector<CubinInstruction> text = cubin_kernel_instructions(program.cubin, generate_gemv_kernel(config).kernel_name);
    const auto [first, last] = mainloop(text);
    std::map<std::string, int> counts;
    for (std::size_t k = first; k <= last; ++k) ++counts[opcode_name(text[k].base())];
    const LoopWork work = loop_work(config);
    const int total = static_cast<int>(last - first + 1);
    int other = total;
    std::smatch registers;
    const bool reported = std::regex_search(program.log, registers, std::regex(R"(Used (\d+) registers)"));
    // Local-memory bytes a thread stores to spill (ptxas: "N bytes spill stores").
    std::smatch spills;
    const bool spill_reported = std::regex_search(program.log, spills, std::regex(R"((\d+) bytes spill stores)"));
    fmt::print("{:<22} {:<28} {:>4} {:>5} {:>5} {:>5} {:>6.2f}", config.format.to_string(), shape_name(config),
               reported ? registers[1].str() : "?", spill_reported ? spills[1].str() : "?", total, work.words,
               static_cast<double>(total) / work.words);
    for (const std::string& column : columns) {
      other -= counts[column];
      fmt::print(" {:>5.2f}", static_cast<double>(counts[column]) / work.words);
    }
    fmt::print(" {:>5.2f}\n", static_cast<double>(other) / work.words);
    if (opcodes) {  // what 'other' is made of, most frequent first
      std::vector<std::pair<int, std::string>> rest;
      for (const auto& [name, count] : counts)
        if (std::find(columns.begin(), columns.end(), name) == columns.end()) rest.emplace_back(count, name);
      std::sort(rest.rbegin(), rest.rend());
      fmt::print("  other:");
      for (const auto& [count, name] : rest) fmt::print(" {} {:.2f}", name, static_cast<double>(count) / work.words);
      fmt::print("\n");
    }
    if (sequence) {
      std::string characters;
      for (std::size_t k = first; k <= last; ++k) {
        const std::string name = opcode_name(text[k].base());
        characters += name == "LDG" ? 'L' : name == "HMMA" ? 'm' : name == "LDS" ? 's' : '.';
      }
      fmt::print("  loop: {}\n", characters);
    }
    if (counts["HMMA"] != work.mma) {
      ++mismatched;
      fmt::print("  ^ the loop holds {} HMMA, the configuration issues {}: the opcode table or the loop is wrong here\n",
                 counts["HMMA"], work.mma);
    }
  }
  fmt::print("(instructions per 32-bit weight word per lane, in the mainloop's body; 'words': words per lane per trip)\n");
  return mismatched == 0 ? 0 : 1;
}

}  // namespace
}  // namespace metile

int main(int argc, char** argv) {
  bool all = false, opcodes = false, sequence = false, norm = false, qkv = false, half = false, timeline = false;
  std::int64_t rows = 1;
  const metile::MlpShape* model = &metile::mlp_shapes().front();
  const char* usage = "usage: gemv_sass_benchmark [--all] [--opcodes] [--sequence] [--norm] [--qkv] [--half] [--timeline] [--rows M] [--model llama3-8b|llama3.2-1b|qwen2.5-1.5b]";
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--all") == 0) {
      all = true;
    } else if (std::strcmp(argv[i], "--opcodes") == 0) {
      opcodes = true;
    } else if (std::strcmp(argv[i], "--sequence") == 0) {
      sequence = true;
    } else if (std::strcmp(argv[i], "--norm") == 0) {
      norm = true;
    } else if (std::strcmp(argv[i], "--qkv") == 0) {
      qkv = true;
    } else if (std::strcmp(argv[i], "--half") == 0) {
      half = true;
    } else if (std::strcmp(argv[i], "--timeline") == 0) {
      timeline = true;
    } else if (std::strcmp(argv[i], "--rows") == 0 && i + 1 < argc) {
      char* end = nullptr;
      rows = std::strtoll(argv[++i], &end, 10);
      if (*end != '\0' || rows < 1 || rows > 16) {
        fmt::print(stderr, "metile: error: --rows takes 1..16, not '{}' ({})\n", argv[i], usage);
        return 2;
      }
    } else if (std::strcmp(argv[i], "--model") == 0 && i + 1 < argc) {
      const std::string name = argv[++i];
      const auto& shapes = metile::mlp_shapes();
      const auto found = std::find_if(shapes.begin(), shapes.end(), [&](const auto& shape) { return shape.name == name; });
      if (found == shapes.end()) {
        fmt::print(stderr, "metile: error: unknown model '{}' ({})\n", name, usage);
        return 2;
      }
      model = &*found;
    } else {
      fmt::print(stderr, "metile: error: unknown argument '{}' ({})\n", argv[i], usage);
      return 2;
    }
  }
  try {
    if (qkv && rows != 1) {
      fmt::print(stderr, "metile: error: --qkv counts the decode step's q/k/v at M = 1 ({})\n", usage);
      return 2;
    }
    return metile::run(all, opcodes, sequence, norm, qkv, half, timeline, rows, *model);
  } catch (const std::exception& error) {
    fmt::print(stderr, "metile: error: {}\n", error.what());
    return 1;
  }
}
