// handoff_benchmark: what one kernel boundary of a decode step costs inside a CUDA graph, and
// whether an arrival counter hands data on sooner than programmatic dependent launch's wait.
//
// A decode step is a chain of ~160 (Llama-3-8B) kernels, each reading what the one before wrote
// (notes/mlp_decode.md: a boundary costs ~2.6 us of the read chain). This times a chain of `links`
// small kernels, each reading the previous kernel's 8 KiB vector (a GEMV's x) through the L2, summing
// it, and writing its own, in five ways:
//   stream    plain launches: each kernel starts when the one before has completed
//   pdl-wait  programmatic dependent launch, griddepcontrol.wait before reading (what metile does)
//   counter   programmatic dependent launch without the wait: each block adds 1 to its kernel's
//             arrival counter after its stores (fence, atomic), and the next kernel's blocks spin on
//             that counter (ld.acquire.gpu) until every block of the one before has arrived; the
//             counters are zeroed by a memset node at the head of the graph
//   counter-nc the counter, the vector read with ld.global.nc as the GEMVs read x (the PTX memory
//             model does not promise that path sees another kernel's writes made while it runs;
//             the check below is what says whether it did)
//   persistent one kernel runs every link, its blocks all resident: between links the counter alone,
//             no launch, no grid completion (what a boundary costs inside a persistent decode-step kernel
//             that keeps one grid for a whole layer or step); only grids the SMs hold at once are run
// Optionally each block also streams a slice of weights (--weights-mib a kernel; its first loads
// before the wait, as a GEMV's first batches), so that the counter is polled while DRAM is busy.
// Every chain's last vector is checked against the same chain computed on the host after each of 50
// replays (a wrong one exits 1, but for counter-nc, whose wrong replays are counted: the counter's
// memory ordering is what that checks), and the table prints us a link.
//
//   handoff_benchmark [--links N] [--weights-mib A,B] [--blocks-per-sm A,B] [--seed S]
// Prints "no CUDA device: ..." and exits 0 where there is none.
#include <fmt/core.h>

#include <cstdint>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "metile/cuda_runtime.h"
#include "metile/error.h"
#include "../support/benchmark_device.h"
#include "../support/benchmark_options.h"

namespace {

using namespace metile;

constexpr int kWords = 2048;          // the vector handed on: 8 KiB, a Llama-3-8B x in bf16
constexpr int kThreads = 128;
constexpr int kCounterStride = 32;    // u32: one counter a 128-byte line
constexpr int kEarlyVectors = 4;      // 16-byte weight loads a thread issues before the wait
constexpr int kCheckedReplays = 50;
static_assert(kWords % (4 * kThreads) == 0, "every thread reads whole 16-byte pieces of the vector");

constexpr const char* kSource = R"CUDA(
typedef unsigned int u32;
__device__ __forceinline__ u32 mix(u32 x) {
  x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
  return x;
}
// The vector's 16-byte pieces: all of a thread's issued before the first is used, so that a link reads
// the vector in one L2 round trip, as a GEMV's prologue reads x (one at a time, each load's value
// summed before the next load issued, they made every link ~16 round trips long).
__device__ __forceinline__ uint4 load_relaxed(const uint4* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint4 load_read_only(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint4 load_weights(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// kMode 0: stream order; 1: griddepcontrol.wait; 2: the arrival counter of link `index - 1`; 3: the
// counter, with the vector read as the GEMVs read x (ld.global.nc, through the SM's L1/texture path);
// 4: the counter between the links of one persistent kernel (no dependents to launch).
template <int kMode>
__device__ __forceinline__ void link(const u32* in, u32* out, const uint4* weights, u32* arrivals,
                                     int weight_vectors, int index) {
  if (kMode == 1 || kMode == 2 || kMode == 3) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const uint4* slice = weights + (size_t)blockIdx.x * weight_vectors;
  uint4 early[EARLY];
#pragma unroll
  for (int j = 0; j < EARLY; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    early[j] = v < weight_vectors ? load_weights(slice + v) : make_uint4(0u, 0u, 0u, 0u);
  }
  if (kMode == 1) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (kMode >= 2 && index > 0) {
    if (threadIdx.x == 0) {
      const u32* counter = arrivals + (index - 1) * COUNTER_STRIDE;
      // Bounded: a block the GPU never schedules beside the others (a persistent grid on a shared
      // device) traps after ~2 s instead of hanging the run.
      for (long long polls = 0;; ++polls) {
        u32 seen;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
        if (seen >= gridDim.x) break;
        if (polls > (1LL << 26)) __trap();
        __nanosleep(32);
      }
      __threadfence();
    }
    __syncthreads();
  }
  u32 acc = 0;  // the weights are zero: folded in so that their loads are not dead
#pragma unroll
  for (int j = 0; j < EARLY; ++j) acc ^= early[j].x ^ early[j].y ^ early[j].z ^ early[j].w;
  for (int v = threadIdx.x + EARLY * blockDim.x; v < weight_vectors; v += blockDim.x) {
    const uint4 q = load_weights(slice + v);
    acc ^= q.x ^ q.y ^ q.z ^ q.w;
  }
  uint4 pieces[PIECES];  // PIECES = WORDS / 4 / the block's threads
#pragma unroll
  for (int j = 0; j < PIECES; ++j) {
    const uint4* piece = reinterpret_cast<const uint4*>(in) + threadIdx.x + j * blockDim.x;
    pieces[j] = kMode == 3 ? load_read_only(piece) : load_relaxed(piece);
  }
#pragma unroll
  for (int j = 0; j < PIECES; ++j) {
    const u32 i = 4u * (threadIdx.x + j * blockDim.x);
    acc += mix(pieces[j].x ^ (i * 0x9E3779B9u)) + mix(pieces[j].y ^ ((i + 1u) * 0x9E3779B9u)) +
           mix(pieces[j].z ^ ((i + 2u) * 0x9E3779B9u)) + mix(pieces[j].w ^ ((i + 3u) * 0x9E3779B9u));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  __shared__ u32 warp_sums[32];
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
  __syncthreads();
  u32 total = 0;
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += warp_sums[w];
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < WORDS; i += gridDim.x * blockDim.x) out[i] = mix(total + (u32)i);
  if (kMode >= 2) {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(arrivals + index * COUNTER_STRIDE, 1u);
    }
  }
}
extern "C" __global__ void handoff_stream(const u32* in, u32* out, const uint4* w, u32* a, int wv, int index) { link<0>(in, out, w, a, wv, index); }
extern "C" __global__ void handoff_wait(const u32* in, u32* out, const uint4* w, u32* a, int wv, int index) { link<1>(in, out, w, a, wv, index); }
extern "C" __global__ void handoff_counter(const u32* in, u32* out, const uint4* w, u32* a, int wv, int index) { link<2>(in, out, w, a, wv, index); }
extern "C" __global__ void handoff_counter_nc(const u32* in, u32* out, const uint4* w, u32* a, int wv, int index) { link<3>(in, out, w, a, wv, index); }
// Every link in one launch: link i reads vectors[(i - 1) % 2] (the input for link 0), writes vectors[i % 2] and
// streams its own slice of weights, as the chains of separate kernels do. Its grid must be resident at once.
extern "C" __global__ void handoff_persistent(const u32* input, u32* vector0, u32* vector1, const uint4* w, u32* a,
                                              int wv, int links) {
  for (int index = 0; index < links; ++index) {
    const u32* in = index == 0 ? input : ((index - 1) % 2 == 0 ? vector0 : vector1);
    u32* out = index % 2 == 0 ? vector0 : vector1;
    link<4>(in, out, w + (size_t)index * gridDim.x * wv, a, wv, index);
  }
}
)CUDA";

std::uint32_t mix(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// The chain on the host: what every link computes, whatever its grid (the weights are zero).
std::vector<std::uint32_t> chain_on_host(std::vector<std::uint32_t> vector, int links) {
  for (int link = 0; link < links; ++link) {
    std::uint32_t total = 0;
    for (int i = 0; i < kWords; ++i) total += mix(vector[static_cast<std::size_t>(i)] ^ (static_cast<std::uint32_t>(i) * 0x9E3779B9u));
    for (int i = 0; i < kWords; ++i) vector[static_cast<std::size_t>(i)] = mix(total + static_cast<std::uint32_t>(i));
  }
  return vector;
}

struct Mode {
  const char* name;
  const char* kernel;
  bool programmatic;
  bool counters;
  bool persistent;  // one launch runs every link
};
constexpr Mode kModes[] = {{"stream", "handoff_stream", false, false, false},
                           {"pdl-wait", "handoff_wait", true, false, false},
                           {"counter", "handoff_counter", true, true, false},
                           {"counter-nc", "handoff_counter_nc", true, true, false},
                           {"persistent", "handoff_persistent", false, true, true}};
constexpr int kModeCount = static_cast<int>(std::size(kModes));

}  // namespace

int main(int argc, char** argv) {
  int links = 64;
  std::vector<double> weights_mib = {0.0, 2.0};
  std::vector<int> blocks_per_sm = {1, 2, 4};
  std::uint64_t seed = std::random_device{}();
  CLI::App app{"what one kernel boundary costs in a CUDA graph: stream order, PDL's wait, an arrival counter, and "
               "the counter between the links of one persistent kernel",
               "handoff_benchmark"};
  app.add_option("--links", links, "kernels in the chain")->check(CLI::Range(2, 1024))->capture_default_str();
  app.add_option("--weights-mib", weights_mib, "MiB of weights each kernel streams (0: none)")
      ->check(CLI::Range(0.0, 64.0))->delimiter(',')->capture_default_str();
  app.add_option("--blocks-per-sm", blocks_per_sm, "grid sizes, blocks of 128 threads an SM")
      ->check(CLI::Range(1, 16))->delimiter(',')->capture_default_str();
  app.add_option("--seed", seed, "the first vector's seed (default: random, printed)");
  if (const std::optional<int> exit_code = benchmarks::parse_benchmark_options(app, argc, argv)) return *exit_code;
  const std::optional<CudaDevice> device = benchmarks::open_device_or_say_why("handoff_benchmark");
  if (!device) return 0;
  try {
    const int sms = device->info().multiprocessor_count;
    fmt::print("handoff_benchmark on {}\n{} links a chain, {} words handed on, seed {}\n",
               benchmarks::describe_device(device->info()), links, kWords, seed);
    CompileOptions options;
    options.extra = {fmt::format("-DWORDS={}", kWords), fmt::format("-DCOUNTER_STRIDE={}", kCounterStride),
                     fmt::format("-DEARLY={}", kEarlyVectors),
                     fmt::format("-DPIECES={}", kWords / 4 / kThreads)};
    std::vector<CompiledKernel> kernels;
    for (const Mode& mode : kModes) kernels.push_back(compile_cuda(kSource, mode.kernel, options));

    std::mt19937_64 random(seed);
    std::vector<std::uint32_t> first(kWords);
    for (std::uint32_t& word : first) word = static_cast<std::uint32_t>(random());
    const std::vector<std::uint32_t> expected = chain_on_host(first, links);
    DeviceBuffer input = DeviceBuffer::from_vector<std::uint32_t>(first);
    DeviceBuffer vectors[2] = {DeviceBuffer(kWords * 4), DeviceBuffer(kWords * 4)};
    DeviceBuffer arrivals(static_cast<std::size_t>(links) * kCounterStride * 4);
    CudaStream stream;
    bool failed = false;

    // The persistent chain runs only where its whole grid is resident (its blocks spin on each other).
    const int resident_blocks_per_sm = kernels[kModeCount - 1].max_active_blocks_per_multiprocessor(kThreads, 0);
    fmt::print("the persistent kernel: {} blocks of {} threads resident an SM\n", resident_blocks_per_sm, kThreads);
    fmt::print("\n{:>8} {:>12} {:>10} {:>10} {:>10} {:>11} {:>11} {:>15}\n", "blocks", "weights MiB", "stream", "pdl-wait",
               "counter", "counter-nc", "persistent", "wait - persist");
    fmt::print("{:>8} {:>12} {:>10} {:>10} {:>10} {:>11} {:>11} {:>15}\n", "", "a link", "us a link", "us a link", "us a link",
               "us a link", "us a link", "us a link");
    for (const double mib : weights_mib) {
      // Whole 16-byte vectors a block, at least one per thread when there are weights.
      for (const int per_sm : blocks_per_sm) {
        const int blocks = per_sm * sms;
        const auto bytes_per_link = static_cast<std::size_t>(mib * 1048576.0);
        const int weight_vectors = static_cast<int>(bytes_per_link / 16 / static_cast<std::size_t>(blocks));
        DeviceBuffer weights(std::max<std::size_t>(16, static_cast<std::size_t>(links) * blocks * weight_vectors * 16));
        weights.fill_bytes(0);
        std::vector<double> us(kModeCount);
        std::vector<int> wrong(kModeCount, 0);
        std::vector<bool> ran(kModeCount, true);
        for (int m = 0; m < kModeCount; ++m) {
          const Mode& mode = kModes[m];
          if (mode.persistent && per_sm > resident_blocks_per_sm) {
            ran[m] = false;
            continue;
          }
          const CudaGraph graph = CudaGraph::capture(stream, [&](const CudaStream& s) {
            if (mode.counters) arrivals.fill_bytes(0, &s);
            if (mode.persistent) {
              KernelArguments arguments;
              arguments.add_pointer(input);
              arguments.add_pointer(vectors[0]);
              arguments.add_pointer(vectors[1]);
              arguments.add_pointer(weights);
              arguments.add_pointer(arrivals);
              arguments.add_int32(weight_vectors);
              arguments.add_int32(links);
              launch(kernels[static_cast<std::size_t>(m)], {static_cast<unsigned>(blocks)}, {kThreads}, 0, s, arguments);
              return;
            }
            for (int link = 0; link < links; ++link) {
              KernelArguments arguments;
              arguments.add_pointer(link == 0 ? input : vectors[(link - 1) % 2]);
              arguments.add_pointer(vectors[link % 2]);
              arguments.add_pointer(weights.address() + static_cast<std::uint64_t>(link) * blocks * weight_vectors * 16);
              arguments.add_pointer(arrivals);
              arguments.add_int32(weight_vectors);
              arguments.add_int32(link);
              if (mode.programmatic && link > 0) {
                launch_programmatic_dependent(kernels[static_cast<std::size_t>(m)], {static_cast<unsigned>(blocks)}, {kThreads}, 0, s, arguments);
              } else {
                launch(kernels[static_cast<std::size_t>(m)], {static_cast<unsigned>(blocks)}, {kThreads}, 0, s, arguments);
              }
            }
          });
          us[m] = 1e3 * time_on_stream_ms(stream, [&](const CudaStream& s) { graph.replay(s); }, 3, 20, 7) / links;
          // Replays checked one by one: a link that read a stale vector changes every word after it.
          for (int check = 0; check < kCheckedReplays; ++check) {
            vectors[(links - 1) % 2].fill_bytes(0, &stream);
            graph.replay(stream);
            stream.synchronize();
            if (vectors[(links - 1) % 2].to_vector<std::uint32_t>() != expected) ++wrong[m];
          }
        }
        const auto persistent_column = [&](double value) {
          return ran[kModeCount - 1] ? fmt::format("{:.2f}", value) : std::string("-");
        };
        fmt::print("{:>8} {:>12.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>11.2f} {:>11} {:>15}\n", blocks, mib, us[0], us[1], us[2],
                   us[3], persistent_column(us[4]), persistent_column(us[1] - us[4]));
        for (int m = 0; m < kModeCount; ++m) {
          if (wrong[m] == 0) continue;
          fmt::print("  {}: {} of {} checked replays handed on a wrong vector\n", kModes[m].name, wrong[m], kCheckedReplays);
          if (m != 3) failed = true;  // the protocols the memory model promises
        }
      }
    }
    if (failed) {
      fmt::print(stderr, "handoff_benchmark: a chain handed on a wrong vector\n");
      return 1;
    }
  } catch (const std::exception& error) {
    fmt::print(stderr, "handoff_benchmark: {}\n", error.what());
    return 1;
  }
  return 0;
}
