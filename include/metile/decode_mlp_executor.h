// metile decode-MLP executor: the decode MLP (decode_mlp.h) on the GPU, where every byte of
// weight read counts (docs/architecture.md, "Measured dispatch"). Candidates per stage (native cuBLASLt or
// unfused GEMV, each also as a CUDA graph; register-resident and scratch-spilled fused GEMV
// kernels from gemv.h) go through the dispatch module's gate, tournament and headroom policy;
// the two chosen callables are then replayed as one warmed CUDA graph.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "metile/cuda_runtime.h"
#include "metile/decode_mlp.h"
#include "metile/dispatch.h"

namespace metile {

// ---------------------------------------------------------------- the MLP executor (CUDA)
struct DecodeMlpOptions {
  DispatchMode mode = dispatch_mode_from_environment();
  TournamentOptions tournament;
  double headroom = 0.10;           // a fused stage must beat the best native candidate by this much
  std::uint64_t gate_seed = 0x6d6c70;
  bool use_decision_cache = true;   // a stored decision skips the tournament (the gate still runs)
  std::filesystem::path decision_cache_file;  // empty: DecisionCache::default_path()
  int tuning_candidates = 12;       // launch shapes per fused schedule (gemv_tuning_candidates; 12: the Llama-3-8B gate/up at M > 8 has 12)
  // When the chosen down stage is a generated GEMV, its graph with down launched as a programmatic
  // dependent of gate/up (prologue and first weight loads overlapping gate/up's tail) races the
  // plain-order graph of the same kernels; the faster one is the executor's graph (it helps the
  // wide Llama-3-8B stages and hurt the narrow models' on the H200). enqueue_serialized() replays
  // the plain-order one.
  bool programmatic_dependent_launch = true;
  // Once both stages are chosen, the persistent kernels (gemv.h: both stages in one launch, a
  // grid-wide barrier between them) race the chosen stages' graph and the native graph on the whole
  // MLP, gated against the float64 MLP; a persistent kernel that wins (with the headroom over
  // native) becomes the executor's graph.
  bool persistent = true;
  // The gate/up shape its stage race nearly chose (near_tie_candidate: a fused shape within this
  // fraction of the chosen one's score) is also raced on the whole MLP, paired with the chosen down
  // stage ("fused stages near tie graph"); when that pair wins, it is the executor's graph and the
  // gate/up report's choice. The stages race alone, and a win of a few percent there did not hold
  // with down after it (Qwen2.5-1.5B at M = 16, session 25). 0: not raced.
  double near_tie_margin = 0.05;
};

// One candidate of a stage (or of the whole MLP). Native: cuBLASLt / dequantize + cuBLASLt (the library path), or the
// unfused GEMV of an affine matrix ("unfused gemv"); each also as a CUDA graph. Fused: a
// generated GEMV with the stage's epilogue ("register_resident w4 t1 f2 db", "residual w4 ...").
struct DecodeMlpCandidate {
  CandidateId id;
  std::string name;   // id.name(): "native", "native graph", "unfused gemv", "fused register_resident w4 t1 f2 db", ...
  std::string kernel; // the generated kernel's config, empty for native cuBLASLt steps
  NumericGateResult gate;  // against the float64 reference rounded to the activation dtype
  double score_ms = -1;    // the tournament's score; < 0 when not timed
};

struct DecodeMlpStageReport {
  std::string stage;  // "gate_up", "down" or "whole"
  std::vector<DecodeMlpCandidate> candidates;
  int chosen = -1;       // index into candidates
  int best_native = -1;  // the fastest native candidate (the incumbent of the headroom rule)
  bool from_cache = false;
  std::string sentence;  // "gate_up: fused scratch_spilled w4 t1 f4, 1.92x over native graph"
  double chosen_ms() const;
  double native_ms() const;
};

// The warmed decode MLP: one CUDA graph replaying the selected gate/up callable and the
// selected down callable on fixed buffers (x, residual in; out out).
class DecodeMlpExecutor {
 public:
  static DecodeMlpExecutor build(const DecodeMlpWeights& weights, std::int64_t rows, const CudaDevice& device,
                                 const DecodeMlpOptions& options = {});
  ~DecodeMlpExecutor();
  DecodeMlpExecutor(DecodeMlpExecutor&&) noexcept;
  DecodeMlpExecutor& operator=(DecodeMlpExecutor&&) noexcept;

  std::int64_t rows() const;
  DeviceTensor& x();
  DeviceTensor& residual();
  const DeviceTensor& out() const;
  const CudaStream& stream() const;
  void enqueue(const CudaStream& stream) const;  // replays the executor's CUDA graph
  // The same chosen kernels in a graph without programmatic dependent launch (plain stream order).
  void enqueue_serialized(const CudaStream& stream) const;
  // Whether the executor's graph launches the down stage as a programmatic dependent, and why not.
  bool programmatic_dependent() const;
  const std::string& programmatic_dependent_reason() const;
  // Uploads x and residual, replays, synchronizes and returns out.
  HostTensor run(const HostTensor& x, const HostTensor& residual);
  // The unfused graph on the native path (both stages' best native candidates, one CUDA graph
  // on the same buffers): what the executor is compared with.
  void enqueue_native(const CudaStream& stream) const;

  const DecodeMlpStageReport& gate_up_report() const;
  const DecodeMlpStageReport& down_report() const;
  // The whole-MLP race ("whole"): native graph, the chosen stages ("fused stages graph"), the gate/up
  // near tie with the chosen down ("fused stages near tie graph", DecodeMlpOptions::near_tie_margin)
  // and the persistent kernels ("fused persistent w8 b2 f1db f2db graph"); persistent() when one of
  // those won.
  const DecodeMlpStageReport& whole_report() const;
  bool persistent() const;
  // For comparison: the fastest persistent kernel that passed the gate (has_persistent(): one did),
  // and the chosen stages' graph (what enqueue() replays unless persistent()).
  bool has_persistent() const;
  void enqueue_persistent(const CudaStream& stream) const;
  void enqueue_stages(const CudaStream& stream) const;
  std::string report() const;  // the two stage sentences and every candidate's gate and time

 private:
  struct State;
  explicit DecodeMlpExecutor(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace metile
