// attention_benchmark: the fused attention kernels (include/metile/attention.h) on the GPU.
//
//   decode   Llama-3-8B heads (32 query, 8 KV, head dim 128, bf16), one token: R = 4 rows per KV
//            head over a K/V cache of 512 / 4096 / 32768 keys, batch 1. Microseconds per call and
//            GB/s over the K and V bytes read, as % of the device-to-device copy bandwidth measured
//            in this run. Calls replay a CUDA graph round-robin over enough K/V copies to exceed the
//            L2 cache, so K and V come from HBM. Each launch shape (warps, keys per split, ring,
//            cluster, L2 prefetch) is timed; "default" is the one FlashAttention picks, and every
//            shape the flash_attention lowering races (decode_attention_variants) is timed by its
//            name. More rows: the positions mask with the token at 4095 in a 32768-slot cache (4096
//            keys read) and at 127 in a 4096-slot and a 512-slot cache (the model engine's short
//            prefix, 128 keys read). Few KV heads at short contexts (issue 13): Qwen2.5-1.5B (12
//            query, 2 KV, head dim 128) and Llama-3.2-1B (32 query, 8 KV, head dim 64), 128 keys,
//            and 128 tokens in a 512-slot cache, in every raced shape.
//   prefill  4096 tokens, causal, the same heads (GQA rows, causal through positions 0..4095):
//            TFLOP/s (4·Hq·S²·D / 2) against a bf16 cuBLASLt 8192³ matmul measured in this run.
//   --torch FILE  the output of .anchors/attention_torch.py (PyTorch SDPA on the same card, same
//            run): the table then prints metile / SDPA ratios.
// Prints "no CUDA device: ..." and exits 0 where there is none.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "metile/attention_runtime.h"
#include "metile/cuda_runtime.h"
#include "../support/benchmark_device.h"
#include "../support/benchmark_options.h"

namespace {

using namespace metile;

// One model's attention heads at batch 1: R = groups rows per KV head.
struct Model {
  std::string name;
  std::int64_t kv_heads, groups, head_dim;
  std::string describe() const {
    return fmt::format("{} (Hq {}, Hkv {}, D {}, bf16)", name, kv_heads * groups, kv_heads, head_dim);
  }
};
const Model llama_3_8b{"Llama-3-8B", 8, 4, 128};
const Model qwen_2_5_1_5b{"Qwen2.5-1.5B", 2, 6, 128};
const Model llama_3_2_1b{"Llama-3.2-1B", 8, 4, 64};

// Random bf16 bits in [-1, 1) (never zeros-only data, which the hardware moves faster), generated quickly.
DeviceBuffer random_bf16(std::int64_t elements, std::uint64_t seed) {
  std::vector<std::uint16_t> bits(static_cast<std::size_t>(elements));
  std::mt19937_64 generator(seed);
  for (auto& b : bits) {
    const float value = static_cast<float>(static_cast<double>(generator() >> 11) * 0x1.0p-52 - 1.0);
    std::uint32_t word = 0;
    std::memcpy(&word, &value, 4);
    b = static_cast<std::uint16_t>(word >> 16);
  }
  return DeviceBuffer::from_vector<std::uint16_t>(bits);
}

struct Timed {
  std::string model, what, kernel;
  std::int64_t keys = 0;
  bool positions = false;
  bool floor = false;  // a floor row (empty or read-only kernel), not attention
  double us = 0, bytes = 0, flops = 0;
};

double gbps(double bytes, double us) { return bytes / (us * 1e3); }

// Replays a CUDA graph of one enqueue per K/V copy; microseconds per enqueue.
double time_rotating(const CudaStream& stream, int copies, const std::function<void(const CudaStream&, int)>& enqueue) {
  const CudaGraph graph = CudaGraph::capture(stream, [&](const CudaStream& s) {
    for (int i = 0; i < copies; ++i) enqueue(s, i);
  });
  const int repetitions = std::max(2, 400 / copies);
  return time_on_stream_ms(stream, [&](const CudaStream& s) { graph.replay(s); }, 2, repetitions, 7) * 1e3 / copies;
}

// What any decode kernel pays in this harness, over the same K/V copies and grid (splits, heads):
// an empty kernel (launch and drain in a graph), and a kernel that only streams K and V (16-byte
// loads, 16 in flight per thread, as the attention kernel holds them) and keeps one word per
// thread so that nothing is optimised away. The attention kernel's fixed cost is its time over these.
constexpr std::string_view floor_kernels = R"CUDA(
typedef unsigned int u32;
extern "C" __global__ void metile_benchmark_empty(u32* out) {}
extern "C" __global__ void __launch_bounds__(256) metile_benchmark_stream(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                                                         u32* __restrict__ out, long long vectors_per_head) {
  const long long per_block = (vectors_per_head + gridDim.x - 1) / gridDim.x;
  const long long begin = blockIdx.y * vectors_per_head + blockIdx.x * per_block;
  const long long end = blockIdx.y * vectors_per_head + min(vectors_per_head, (long long)(blockIdx.x + 1) * per_block);
  u32 folded = 0;
  for (long long i = begin + threadIdx.x; i < end; i += 8 * 256) {
    uint4 x[16];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const long long index = min(i + j * 256, end - 1);
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(x[j].x), "=r"(x[j].y), "=r"(x[j].z), "=r"(x[j].w) : "l"(k + index));
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(x[8 + j].x), "=r"(x[8 + j].y), "=r"(x[8 + j].z), "=r"(x[8 + j].w) : "l"(v + index));
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) folded ^= x[j].x ^ x[j].y ^ x[j].z ^ x[j].w;
  }
  out[(blockIdx.y * gridDim.x + blockIdx.x) * 256 + threadIdx.x] = folded;
}
)CUDA";

// The floors. Besides the default's grid, the read-only kernel also runs on the whole chip (two 8-warp
// blocks an SM, 128 KB of loads in flight per SM): what any one kernel reading these bytes takes in this
// harness, whatever its grid, so the figure the 80 % goal is measured against.
std::vector<Timed> time_floors(const Model& model, const CudaStream& stream, int copies, const std::vector<DeviceBuffer>& k,
                               const std::vector<DeviceBuffer>& v, std::int64_t keys, std::int64_t splits, double bytes,
                               int multiprocessors) {
  const std::int64_t kv_heads = model.kv_heads, head_dim = model.head_dim;
  static const CompiledKernel empty = compile_cuda(floor_kernels, "metile_benchmark_empty");
  static const CompiledKernel stream_only = compile_cuda(floor_kernels, "metile_benchmark_stream");
  const Dim3 grid{static_cast<unsigned>(splits), static_cast<unsigned>(kv_heads), 1}, block{256, 1, 1};
  DeviceBuffer out(static_cast<std::size_t>(splits * kv_heads * 256 * 4));
  // Per head, K's vectors (8 bf16 each) and V's line up one to one.
  const long long vectors_per_head = keys * head_dim / 8;
  Timed launch_only, read_only;
  launch_only.what = fmt::format("floor T={}: empty kernel", keys);
  launch_only.kernel = fmt::format("{} x {} blocks", splits, kv_heads);
  launch_only.us = time_rotating(stream, copies, [&](const CudaStream& s, int) {
    launch(empty, grid, block, 0, s, out.address());
  });
  read_only.what = fmt::format("floor T={}: read K and V only", keys);
  read_only.kernel = launch_only.kernel;
  read_only.keys = keys;
  read_only.bytes = bytes;
  // The read-only kernel over read_splits x kv_heads blocks, each thread's folded word to a sink of its own.
  const auto time_read_only = [&](std::int64_t read_splits) {
    const Dim3 read_grid{static_cast<unsigned>(read_splits), static_cast<unsigned>(kv_heads), 1};
    DeviceBuffer sink(static_cast<std::size_t>(read_splits * kv_heads * 256 * 4));
    return time_rotating(stream, copies, [&](const CudaStream& s, int i) {
      launch(stream_only, read_grid, block, 0, s, k[static_cast<std::size_t>(i)].address(),
             v[static_cast<std::size_t>(i)].address(), sink.address(), vectors_per_head);
    });
  };
  read_only.us = time_read_only(splits);
  Timed whole_chip = read_only;
  const std::int64_t chip_splits = std::max<std::int64_t>(1, (2 * multiprocessors + kv_heads - 1) / kv_heads);
  whole_chip.what = fmt::format("floor T={}: read K and V, whole chip", keys);
  whole_chip.kernel = fmt::format("{} x {} blocks", chip_splits, kv_heads);
  whole_chip.us = time_read_only(chip_splits);
  launch_only.keys = keys;
  launch_only.floor = read_only.floor = whole_chip.floor = true;
  launch_only.model = read_only.model = whole_chip.model = model.name;
  for (const Timed& row : {launch_only, read_only, whole_chip}) {
    fmt::print(stderr, "  {:<34} {:<58} {:8.2f} us\n", row.what, row.kernel, row.us);
  }
  return {launch_only, read_only, whole_chip};
}

std::vector<Timed> time_decode(const CudaDevice& device, const CudaStream& stream, const Model& model, std::int64_t keys,
                               bool positions_mask, std::int64_t last_position) {
  const std::int64_t kv_heads = model.kv_heads, groups = model.groups, head_dim = model.head_dim;
  const AttentionProblem problem = AttentionProblem::grouped_query(
      DType::bf16, kv_heads, groups, 1, keys, head_dim, positions_mask ? AttentionMask::positions : AttentionMask::none);
  const std::int64_t keys_read = positions_mask ? last_position + 1 : keys;
  const double bytes_read = static_cast<double>(kv_heads * keys_read * head_dim * 2 * 2);
  // Enough copies that one replay streams at least 3x the L2 through (the small models' 128-key
  // caches are 64-128 KB: up to 2048 copies).
  const std::int64_t copy_bytes = problem.key_value_bytes();
  const int copies = static_cast<int>(std::clamp<std::int64_t>(3 * device.info().l2_cache_bytes / copy_bytes + 1, 2, 2048));
  std::vector<DeviceBuffer> k, v;
  for (int i = 0; i < copies; ++i) {
    k.push_back(random_bf16(kv_heads * keys * head_dim, 10 + 2 * i));
    v.push_back(random_bf16(kv_heads * keys * head_dim, 11 + 2 * i));
  }
  const DeviceBuffer q = random_bf16(kv_heads * groups * head_dim, 1);
  DeviceBuffer out(static_cast<std::size_t>(kv_heads * groups * head_dim * 2));
  const std::vector<std::int32_t> position_values = {static_cast<std::int32_t>(last_position)};
  const DeviceBuffer positions = DeviceBuffer::from_vector<std::int32_t>(position_values);

  const int multiprocessors = device.info().multiprocessor_count;
  struct Shape {
    std::string name;
    FlashAttentionOptions options;
  };
  std::vector<Shape> shapes;
  // Every shape the flash_attention lowering races, by its name ("default" first).
  for (const DecodeVariant& variant : decode_attention_variants(problem)) {
    shapes.push_back({variant.name.empty() ? "default" : variant.name, variant.options});
  }
  // Llama-3-8B's history: the 8-warp global merge with its split halved and doubled (full caches),
  // the ring, 4 warps (one and two blocks per multiprocessor), clusters (a head's splits merged
  // through distributed shared memory, at most 16 splits); at long caches each register-path
  // shape also with the L2 prefetch.
  const struct {
    int warps, stages;
    bool cluster;
    int blocks_per_multiprocessor;
  } variants[] = {{8, 0, false, 1}, {8, 3, false, 1}, {4, 0, false, 1}, {4, 0, false, 2}, {8, 0, true, 1}, {4, 0, true, 1}};
  for (const auto& variant : variants) {
    if (model.name != llama_3_8b.name) break;
    const int blocks = variant.cluster ? static_cast<int>(std::min<std::int64_t>(multiprocessors, kMaxClusterSplits * kv_heads))
                                       : multiprocessors * variant.blocks_per_multiprocessor;
    const std::int64_t base = decode_keys_per_split(problem, variant.warps, blocks);
    // The 8-warp global merge: its split halved and doubled too.
    const bool global_merge = variant.warps == 8 && variant.stages == 0 && !variant.cluster;
    if (positions_mask && !global_merge) continue;
    std::vector<std::int64_t> splits = {base};
    if (!positions_mask && global_merge) {
      splits.push_back(base * 2);
      if (base >= 32 * variant.warps) splits.push_back((base / 2 + 15) / 16 * 16);
    }
    for (const std::int64_t keys_per_split : splits) {
      for (const bool prefetch : {false, true}) {
        if (prefetch && (variant.stages != 0 || keys <= kLongestOneSplit)) continue;
        FlashAttentionOptions options;
        options.decode_warps = variant.warps;
        options.keys_per_split = keys_per_split;
        options.decode_stages = variant.stages;
        options.decode_cluster = variant.cluster;
        options.decode_l2_prefetch = prefetch;
        shapes.push_back({"", options});
      }
    }
  }
  // Each kernel once (the default is one of the history's shapes at some lengths: its name stays).
  std::vector<std::string> seen;
  std::vector<Timed> rows;
  std::int64_t default_splits = 1;
  for (const Shape& shape : shapes) {
    const AttentionKernelSource source =
        generate_decode_attention_kernel(decode_attention_config(problem, shape.options, multiprocessors));
    const std::string identity = fmt::format("{} {} {}", source.kernel_name, source.splits, source.keys_per_split);
    if (std::find(seen.begin(), seen.end(), identity) != seen.end()) continue;
    seen.push_back(identity);
    if (shape.name == "default") default_splits = source.splits;
    // A variant that fails to build or launch is reported and skipped; the rest still run.
    std::optional<FlashAttention> built;
    try {
      built.emplace(FlashAttention::build(problem, shape.options));
      // One launch outside the graph capture: a launch error is caught here, not mid-capture.
      built->enqueue(stream, q.address(), k[0].address(), v[0].address(), positions.address(), out.address());
      stream.synchronize();
    } catch (const std::exception& error) {
      fmt::print(stderr, "  {} decode T={} {}: {}\n", model.name, keys, source.summary, error.what());
      continue;
    }
    const FlashAttention& attention = *built;
    Timed timed;
    timed.model = model.name;
    timed.what = fmt::format("decode T={}{}{}", keys, positions_mask ? fmt::format(" pos={}", last_position) : "",
                             shape.name.empty() ? "" : " (" + shape.name + ")");
    timed.kernel = attention.kernel().summary;
    timed.keys = keys;
    timed.positions = positions_mask;
    timed.bytes = bytes_read;
    timed.us = time_rotating(stream, copies, [&](const CudaStream& s, int i) {
      attention.enqueue(s, q.address(), k[static_cast<std::size_t>(i)].address(), v[static_cast<std::size_t>(i)].address(),
                        positions.address(), out.address());
    });
    fmt::print(stderr, "  {:<13} {:<40} {:<62} {:8.2f} us\n", model.name, timed.what, timed.kernel, timed.us);
    rows.push_back(timed);
  }
  if (!positions_mask) {
    // The floors on the default's grid (Llama-3-8B: as before, the 8-warp global merge's).
    const std::int64_t splits = model.name == llama_3_8b.name
                                    ? (keys + decode_keys_per_split(problem, 8, multiprocessors) - 1) /
                                          decode_keys_per_split(problem, 8, multiprocessors)
                                    : default_splits;
    for (const Timed& row : time_floors(model, stream, copies, k, v, keys, splits, bytes_read, multiprocessors)) rows.push_back(row);
  }
  return rows;
}

std::vector<Timed> time_prefill(const CudaStream& stream, std::int64_t tokens) {
  const std::int64_t kv_heads = llama_3_8b.kv_heads, groups = llama_3_8b.groups, head_dim = llama_3_8b.head_dim;
  const AttentionProblem problem =
      AttentionProblem::grouped_query(DType::bf16, kv_heads, groups, tokens, tokens, head_dim, AttentionMask::positions);
  std::vector<std::int32_t> position_values(static_cast<std::size_t>(tokens));
  for (std::int64_t s = 0; s < tokens; ++s) position_values[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(s);
  const DeviceBuffer positions = DeviceBuffer::from_vector<std::int32_t>(position_values);
  const DeviceBuffer q = random_bf16(kv_heads * groups * tokens * head_dim, 2);
  const DeviceBuffer k = random_bf16(kv_heads * tokens * head_dim, 3), v = random_bf16(kv_heads * tokens * head_dim, 4);
  DeviceBuffer out(static_cast<std::size_t>(kv_heads * groups * tokens * head_dim * 2));
  std::vector<Timed> rows;
  for (int warps : {4, 8}) {
    FlashAttentionOptions options;
    options.prefill_warps = warps;
    const FlashAttention attention = FlashAttention::build(problem, options);
    Timed timed;
    timed.what = fmt::format("prefill S={} causal{}", tokens, warps == 4 ? " (default)" : "");
    timed.kernel = attention.kernel().summary;
    timed.flops = 4.0 * kv_heads * groups * static_cast<double>(tokens) * tokens * head_dim / 2;
    timed.us = time_on_stream_ms(stream, [&](const CudaStream& s) {
                 attention.enqueue(s, q.address(), k.address(), v.address(), positions.address(), out.address());
               }, 2, 10, 5) * 1e3;
    fmt::print(stderr, "  {:<34} {:<58} {:8.1f} us\n", timed.what, timed.kernel, timed.us);
    rows.push_back(timed);
  }
  return rows;
}

double matmul_tflops(const CudaStream& stream) {
  const std::int64_t n = 8192;
  const DeviceBuffer a = random_bf16(n * n, 5), b = random_bf16(n * n, 6);
  DeviceBuffer c(static_cast<std::size_t>(n * n * 2));
  CublasLtMatmul matmul;
  MatmulProblem problem;
  problem.dtype = DType::bf16;
  problem.m = problem.n = problem.k = n;
  const double ms = time_on_stream_ms(stream, [&](const CudaStream& s) { matmul.run(problem, a.address(), b.address(), c.address(), s); },
                                      3, 10, 5);
  return 2.0 * n * n * n / (ms * 1e-3) / 1e12;
}

// The SDPA figures of .anchors/attention_torch.py's output: "decode SDPA T=  4096:  X us ..." and
// "prefill SDPA causal S=4096:  X us ...".
std::map<std::string, double> read_torch_figures(const std::string& path) {
  std::map<std::string, double> figures;
  std::ifstream file(path);
  const std::regex decode(R"(decode SDPA T=\s*(\d+):\s*([0-9.]+) us)"), prefill(R"(prefill SDPA causal S=\s*(\d+):\s*([0-9.]+) us)"),
      copy(R"(COPY_BW_GBS\s+([0-9.]+))");
  std::string line;
  std::smatch match;
  while (std::getline(file, line)) {
    if (std::regex_search(line, match, decode)) figures["decode " + match[1].str()] = std::stod(match[2].str());
    if (std::regex_search(line, match, prefill)) figures["prefill " + match[1].str()] = std::stod(match[2].str());
    if (std::regex_search(line, match, copy)) figures["copy"] = std::stod(match[1].str());
  }
  return figures;
}

}  // namespace

int main(int argc, char** argv) {
  std::string torch_path;
  CLI::App app{"fused attention kernels on the GPU against PyTorch's SDPA", "attention_benchmark"};
  // A missing file was read as no figures at all, after the device had been opened and measured.
  app.add_option("--torch", torch_path, "the output of .anchors' attention script, for its columns")->check(CLI::ExistingFile);
  if (const std::optional<int> exit_code = benchmarks::parse_benchmark_options(app, argc, argv)) return *exit_code;
  const std::optional<CudaDevice> device = benchmarks::open_device_or_say_why("attention_benchmark");
  if (!device) return 0;
  try {
    const CudaDeviceInfo& info = device->info();
    CudaStream stream;
    const double copy_gbps = measure_copy_bandwidth_gbps(stream);
    fmt::print(stderr, "device: {}; copy {:.0f} GB/s\n", benchmarks::describe_device(info), copy_gbps);
    const std::map<std::string, double> torch = torch_path.empty() ? std::map<std::string, double>{}
                                                                    : read_torch_figures(torch_path);
    std::vector<Timed> decode;
    auto add = [&decode](std::vector<Timed> rows) { decode.insert(decode.end(), rows.begin(), rows.end()); };
    for (std::int64_t keys : {512, 4096, 32768}) add(time_decode(*device, stream, llama_3_8b, keys, false, 0));
    // The positions mask: a token at 4095 in a 32768-slot cache, and the model engine's short
    // prefix (128 tokens in a 4096-slot cache); splits follow the largest position.
    add(time_decode(*device, stream, llama_3_8b, 32768, true, 4095));
    add(time_decode(*device, stream, llama_3_8b, 4096, true, 127));
    // The same 128 tokens in a 512-slot cache (bench-model's decode step).
    add(time_decode(*device, stream, llama_3_8b, 512, true, 127));
    // Few KV heads (issue 13): 128 keys, and 128 tokens in a 512-slot cache, in every raced shape.
    for (const Model& model : {qwen_2_5_1_5b, llama_3_2_1b}) {
      add(time_decode(*device, stream, model, 128, false, 0));
      add(time_decode(*device, stream, model, 512, true, 127));
    }
    const std::vector<Timed> prefill = time_prefill(stream, 4096);
    const double matmul = matmul_tflops(stream);

    fmt::print("\ndevice: {} ({} SMs), copy bandwidth (1 GiB, read + write) {:.0f} GB/s, bf16 cuBLASLt 8192^3 {:.0f} TFLOP/s\n",
               info.name, info.multiprocessor_count, copy_gbps, matmul);
    if (torch.count("copy")) fmt::print("PyTorch's copy bandwidth in the same call: {:.0f} GB/s\n", torch.at("copy"));
    for (const Model& model : {llama_3_8b, qwen_2_5_1_5b, llama_3_2_1b}) {
      fmt::print("\n{:<40} {:<62} {:>9} {:>8} {:>6} {:>9} {:>8}\n", "decode " + model.describe(), "kernel", "us", "GB/s",
                 "%copy", "SDPA us", "xSDPA");
      for (const Timed& row : decode) {
        if (row.model != model.name) continue;
        // The SDPA anchor runs Llama-3-8B's heads only.
        const std::string key = fmt::format("decode {}", row.keys);
        const bool has_torch = model.name == llama_3_8b.name && torch.count(key) > 0 && !row.positions && !row.floor;
        fmt::print("{:<40} {:<62} {:9.2f} {:8.0f} {:5.1f}% {:>9} {:>8}\n", row.what, row.kernel, row.us,
                   gbps(row.bytes, row.us), 100 * gbps(row.bytes, row.us) / copy_gbps,
                   has_torch ? fmt::format("{:.2f}", torch.at(key)) : "-",
                   has_torch ? fmt::format("{:.2f}x", torch.at(key) / row.us) : "-");
      }
    }
    fmt::print("\n{:<40} {:<62} {:>9} {:>8} {:>6} {:>9} {:>8}\n", "prefill " + llama_3_8b.describe(), "kernel", "us",
               "TFLOP/s", "%mm", "SDPA us", "xSDPA");
    for (const Timed& row : prefill) {
      const double tflops = row.flops / (row.us * 1e-6) / 1e12;
      const bool has_torch = torch.count("prefill 4096") > 0;
      fmt::print("{:<40} {:<62} {:9.1f} {:8.1f} {:5.1f}% {:>9} {:>8}\n", row.what, row.kernel, row.us, tflops,
                 100 * tflops / matmul, has_torch ? fmt::format("{:.1f}", torch.at("prefill 4096")) : "-",
                 has_torch ? fmt::format("{:.2f}x", torch.at("prefill 4096") / row.us) : "-");
    }
    // The issue's goal: >= 80% of copy bandwidth at 4096 and beyond, with the best launch shape.
    for (std::int64_t keys : {4096, 32768}) {
      double best = 0;
      for (const Timed& row : decode) {
        if (row.model == llama_3_8b.name && row.keys == keys && !row.positions && !row.floor) {
          best = std::max(best, 100 * gbps(row.bytes, row.us) / copy_gbps);
        }
      }
      fmt::print("goal decode T={}: >= 80% of copy bandwidth: best {:.1f}% -> {}\n", keys, best, best >= 80 ? "met" : "NOT met");
    }
  } catch (const std::exception& error) {
    fmt::print(stderr, "metile: error: {}\n", error.what());
    return 1;
  }
  return 0;
}
