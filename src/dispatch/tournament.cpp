// The order-interleaved tournament. Clocks drift and caches warm, so no candidate always goes
// first: round r starts at candidate r (rotation) and odd rounds run in reverse. Each round's
// figure is a median of samples; a candidate's score is a pessimistic quantile of its rounds, so
// one lucky round cannot win the race. With cold caches (TournamentOptions::cold_cache_bytes) every
// timed call starts after a flush of the L2, as a kernel of a whole decode step does.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>

#include "metile/dispatch.h"

namespace metile {
namespace {

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : 0.5 * (values[middle - 1] + values[middle]);
}

double quantile(std::vector<double> values, double q) {
  std::sort(values.begin(), values.end());
  const double position = q * static_cast<double>(values.size() - 1);
  const auto below = static_cast<std::size_t>(std::floor(position));
  const std::size_t above = std::min(below + 1, values.size() - 1);
  return values[below] + (position - static_cast<double>(below)) * (values[above] - values[below]);
}

// Reads all of `scratch` (nothing written but one word that a constant guards), so the L2 then
// holds clean lines of it and none of the next candidate's inputs. A memset would leave the L2
// full of dirty lines whose write-backs the next candidate pays for: with one, the races picked
// kernels that ran 13% slower in the decode step (Llama-3.2-1B, session 6 call 2).
CompiledKernel read_through_l2_kernel() {
  return compile_cuda(R"CUDA(
extern "C" __global__ void __launch_bounds__(512) metile_read_through_l2(const uint4* __restrict__ data,
                                                                       unsigned long long vectors, unsigned* sink) {
  unsigned folded = 0;
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < vectors; i += stride) {
    const uint4 v = data[i];
    folded ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (folded == 0x9E3779B9u) *sink = folded;
}
)CUDA",
                      "metile_read_through_l2");
}

void read_through_l2(const CompiledKernel& kernel, const DeviceBuffer& scratch, const DeviceBuffer& sink,
                     const CudaStream& stream) {
  const unsigned long long vectors = scratch.size_bytes() / 16;
  launch(kernel, Dim3{1024, 1, 1}, Dim3{512, 1, 1}, 0, stream, scratch, vectors, sink);
}

}  // namespace

TournamentResult run_tournament(const std::vector<TournamentCandidate>& candidates, const CudaStream& stream,
                                const TournamentOptions& options) {
  if (candidates.empty()) throw InputError("run_tournament: no candidates");
  if (options.rounds < 1 || options.calls_per_sample < 1 || options.samples_per_round < 1 || options.quantile < 0 ||
      options.quantile > 1) {
    throw InputError("run_tournament: rounds, calls per sample and samples per round must be >= 1, the quantile in [0, 1]");
  }
  const std::size_t count = candidates.size();
  for (const TournamentCandidate& candidate : candidates) {
    for (int i = 0; i < options.warmup_calls; ++i) candidate.run(stream);
  }
  stream.synchronize();

  TournamentResult result;
  result.round_medians.assign(count, {});
  CudaEvent start;
  CudaEvent end;
  DeviceBuffer scratch, sink;
  CompiledKernel flush;
  std::vector<CudaEvent> call_starts, call_ends;
  if (options.cold_cache_bytes > 0) {
    scratch = DeviceBuffer(options.cold_cache_bytes / 16 * 16);
    sink = DeviceBuffer(16);
    flush = read_through_l2_kernel();
    call_starts.resize(static_cast<std::size_t>(options.calls_per_sample));
    call_ends.resize(static_cast<std::size_t>(options.calls_per_sample));
  }
  // One sample's milliseconds per call: back to back between two events, or (cold caches) each
  // call after its own flush, between its own events.
  const auto sample_ms = [&](const TournamentCandidate& candidate) {
    if (options.cold_cache_bytes == 0) {
      start.record(stream);
      for (int call = 0; call < options.calls_per_sample; ++call) candidate.run(stream);
      end.record(stream);
      end.synchronize();
      return static_cast<double>(CudaEvent::elapsed_ms(start, end)) / options.calls_per_sample;
    }
    for (std::size_t call = 0; call < call_starts.size(); ++call) {
      read_through_l2(flush, scratch, sink, stream);
      call_starts[call].record(stream);
      candidate.run(stream);
      call_ends[call].record(stream);
    }
    call_ends.back().synchronize();
    double total = 0;
    for (std::size_t call = 0; call < call_starts.size(); ++call) {
      total += static_cast<double>(CudaEvent::elapsed_ms(call_starts[call], call_ends[call]));
    }
    return total / options.calls_per_sample;
  };
  for (int round = 0; round < options.rounds; ++round) {
    std::vector<std::size_t> order(count);
    for (std::size_t i = 0; i < count; ++i) order[i] = (i + static_cast<std::size_t>(round)) % count;
    if (round % 2 == 1) std::reverse(order.begin(), order.end());
    for (std::size_t index : order) {
      std::vector<double> samples;
      for (int sample = 0; sample < options.samples_per_round; ++sample) samples.push_back(sample_ms(candidates[index]));
      result.round_medians[index].push_back(median(samples));
    }
  }
  for (std::size_t i = 0; i < count; ++i) {
    result.names.push_back(candidates[i].name);
    result.score_ms.push_back(quantile(result.round_medians[i], options.quantile));
  }
  result.fastest = static_cast<int>(std::min_element(result.score_ms.begin(), result.score_ms.end()) - result.score_ms.begin());
  return result;
}

bool beats_with_headroom(double challenger_ms, double incumbent_ms, double headroom) {
  return challenger_ms > 0 && incumbent_ms >= challenger_ms * (1.0 + headroom);
}

}  // namespace metile
