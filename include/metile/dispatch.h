// metile dispatch: measured choice between the native path and fused kernels (docs/architecture.md,
// "Measured dispatch"). Analytical cost only proposes; here every fused candidate must first
// pass a numeric gate against the CPU reference, then beat the native path in an
// order-interleaved tournament with headroom. Decisions persist on disk, and every one of them
// can be reported in a sentence ("region R1: fused (wide), 1.8x over native graph").
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "metile/cuda_runtime.h"
#include "metile/decision.h"
#include "metile/fusion.h"
#include "metile/gemv.h"
#include "metile/graph.h"

namespace metile {

// ---------------------------------------------------------------- mode
// METILE_DISPATCH=native|fused|auto (unset: auto). native never runs a fused kernel; fused runs the
// fastest fused candidate that passes the gate (native where none does); auto measures.
enum class DispatchMode : std::uint8_t { native, fused, automatic };
DispatchMode parse_dispatch_mode(std::string_view text);  // InputError naming the bad value
DispatchMode dispatch_mode_from_environment();
std::string_view dispatch_mode_name(DispatchMode mode);  // "native", "fused", "auto"

// ---------------------------------------------------------------- numeric gate
// Scale-normalized errors of an output against its reference:
//   relative_l2  = ||out - ref||_2 / ||ref||_2
//   relative_max = max |out - ref| / max |ref|
// Both must be within the dtype's threshold (f32 1e-5, f16 2e-3, bf16 1e-2; exact for integers).
// A NaN or infinity passes only where the reference has the same one, at the same place.
struct NumericGateResult {
  bool passed = false;
  double relative_l2 = 0;
  double relative_max = 0;
  double threshold = 0;
  std::string detail;  // why it failed ("relative_l2 3.1e-02 > 1e-02", "NaN at element 17"), or empty
};
double numeric_gate_threshold(DType dtype);
NumericGateResult numeric_gate(const HostTensor& output, const HostTensor& reference);
// Every output of `graph` (a region graph) against the reference: the first failure, else the
// largest relative L2 error. An argmax output whose input is also an output is checked against
// the candidate's own values instead, exactly (argmax_index per row): two right kernels may round
// a near tie apart, so an index is right when it names the largest value the candidate wrote,
// and those values pass the numeric gate against the reference.
NumericGateResult gate_region_outputs(const ComputeGraph& graph, const TensorMap& outputs, const TensorMap& reference);

// ---------------------------------------------------------------- tournament
struct TournamentCandidate {
  std::string name;
  DeviceStep run;
};

struct TournamentOptions {
  int warmup_calls = 5;       // per candidate, before the first round
  int rounds = 7;             // each round times every candidate once, in a rotated (odd rounds: reversed) order
  int calls_per_sample = 20;  // calls between two events
  int samples_per_round = 3;  // a round's figure is the median of its samples
  double quantile = 0.75;     // the score: this quantile of the per-round figures (pessimistic, not the minimum)
  // > 0: cold caches. Before every timed call a kernel reads this many bytes of scratch on the
  // stream (pass at least twice the L2 size), so the candidate reads its weights from DRAM as it
  // does inside a whole decode step, whose bytes are many times the L2; each call is then timed
  // alone, between its own events. 0: calls run back to back, and inputs that fit the L2 (a
  // Llama-3.2-1B MLP's 28 MB in the H200's 50 MB) are read from it: faster than in a model step,
  // and a kernel that hides DRAM latency badly can win such a race.
  std::size_t cold_cache_bytes = 0;
};

struct TournamentResult {
  std::vector<std::string> names;
  std::vector<double> score_ms;                    // per candidate: the quantile of per-round medians, per call
  std::vector<std::vector<double>> round_medians;  // per candidate, per round
  int fastest = -1;
};

TournamentResult run_tournament(const std::vector<TournamentCandidate>& candidates, const CudaStream& stream,
                                const TournamentOptions& options = {});

// The headroom rule: a challenger replaces the incumbent only when incumbent_ms >= challenger_ms * (1 + headroom).
bool beats_with_headroom(double challenger_ms, double incumbent_ms, double headroom);

// ---------------------------------------------------------------- candidates
// The typed identity of a candidate: what it is (the native path or a fused lowering), which
// variant of it, and whether it replays as a CUDA graph. Reports print name(); decisions store
// and match the identity itself, never a prefix of a name.
enum class CandidateKind : std::uint8_t { native, fused };
enum class Replay : std::uint8_t { eager, cuda_graph };
std::string_view candidate_kind_name(CandidateKind kind);  // "native", "fused"

struct CandidateId {
  CandidateKind kind = CandidateKind::native;
  std::string variant;  // "" (the plain native path, the default fused kernel), "wide", "epilogue", "unfused gemv", ...
  Replay replay = Replay::eager;

  static CandidateId native(std::string variant = {}) { return {CandidateKind::native, std::move(variant), Replay::eager}; }
  static CandidateId fused(std::string variant = {}) { return {CandidateKind::fused, std::move(variant), Replay::eager}; }
  CandidateId as_graph() const { return {kind, variant, Replay::cuda_graph}; }
  CandidateId eager() const { return {kind, variant, Replay::eager}; }
  std::string name() const;  // "native", "native graph", "fused wide", "fused register_resident w4 t1 f2 db graph"
  bool operator==(const CandidateId&) const = default;
};

// ---------------------------------------------------------------- decisions
struct DispatchDecision {
  std::string key;
  CandidateId chosen;
  std::vector<std::pair<CandidateId, double>> timings_ms;  // candidate -> score
  std::string report;  // the sentence saying what was chosen and why
};

// Decisions on disk: one JSON file, rewritten atomically (temp + rename) on every store. A file that
// cannot be read as a decision file is set aside (its content is ignored and replaced on the next store).
class DecisionCache {
 public:
  explicit DecisionCache(std::filesystem::path file = default_path());
  // cache_directory()/dispatch.json: $METILE_CACHE_DIR/dispatch.json, else ~/.cache/metile/dispatch.json
  static std::filesystem::path default_path();

  const std::filesystem::path& path() const { return path_; }
  std::optional<DispatchDecision> find(const std::string& key) const;
  void store(const DispatchDecision& decision);
  bool found_corrupt_file() const { return found_corrupt_file_; }
  std::size_t size() const { return decisions_.size(); }

 private:
  std::filesystem::path path_;
  std::vector<DispatchDecision> decisions_;
  bool found_corrupt_file_ = false;
};

// The key of a decision, the same for every client (whole-graph Executable, decode-MLP stages):
// device name, driver and NVRTC versions, the dispatch mode, the hash of every candidate's
// identity and source, and the region's ops, dtypes and shapes.
std::string dispatch_key(const CudaDeviceInfo& device, const ComputeGraph& region_graph,
                         const std::vector<std::pair<CandidateId, std::string>>& candidate_sources, DispatchMode mode);

// ---------------------------------------------------------------- the measured choice
// The one engine behind every measured choice (Executable's regions, the decode-MLP stages).
// Given each candidate's gate result it decides who races, asks `measure` for their scores (a
// tournament on the device; anything in tests), and applies the policy:
//   * a candidate enters only if it passed the gate, or it is the library path (the graph's own
//     semantics through the native library: it stays whatever its figures against the oracle);
//     METILE_DISPATCH=native admits native candidates only;
//   * a stored decision naming an admitted candidate is taken without measuring;
//   * one admitted candidate is taken without measuring; else all admitted race;
//   * a fused candidate replaces the best native one only with the headroom (fused mode: always).
struct DispatchPolicy {
  DispatchMode mode = DispatchMode::automatic;
  double headroom = 0.10;
};
// The headroom a fused candidate needs at a boundary: 5% for a single primitive, 10% for a
// graph or MLP boundary (docs/architecture.md, "Measured dispatch").
double boundary_headroom(std::size_t nodes);

struct MeasuredCandidate {
  CandidateId id;
  NumericGateResult gate;     // of the candidate's eager form
  bool library_path = false;  // admitted whatever its gate result
};

struct MeasuredChoice {
  int chosen = -1;       // index into the candidates; -1 when none was admitted
  int best_native = -1;  // the fastest admitted native candidate (the incumbent)
  int best_fused = -1;   // the fastest admitted fused candidate
  std::vector<double> score_ms;  // per candidate; < 0 where not measured
  bool from_cache = false;
  bool worth_storing = false;  // a measured race whose fused candidates all had their chance
  std::string reason;    // "fused wide, 1.80x over native graph (2.1 us vs 3.8 us)", ...
};

// Scores (ms, lower is better) for the candidates at `entrants` (indices), in that order.
using MeasureCandidates = std::function<std::vector<double>(const std::vector<int>& entrants)>;

MeasuredChoice choose_measured(const std::vector<MeasuredCandidate>& candidates, const DispatchPolicy& policy,
                               const std::optional<DispatchDecision>& stored, const MeasureCandidates& measure);

// The decision to store for a choice (key, chosen identity, every score, the reason).
DispatchDecision decision_of(const std::string& key, const std::vector<MeasuredCandidate>& candidates,
                             const MeasuredChoice& choice);

// ---------------------------------------------------------------- regions
// The region as a graph of its own: its inputs become graph inputs (same names and specs), its
// nodes keep their names and attributes, its outputs are the graph's outputs. Gates and
// tournaments run on this graph, so a region is measured in isolation.
ComputeGraph region_graph(const ComputeGraph& graph, const FusionRegion& region);
// The same region expressed over region_graph(graph, region)'s ids.
FusionRegion region_in_region_graph(const ComputeGraph& graph, const FusionRegion& region, const ComputeGraph& sub);

// A fused lowering of a region: generated source (for the decision key) and how to bind it to the
// device values of the graph it was made for.
struct FusedCandidate {
  CandidateId id;       // fused, with its variant ("", "wide", "epilogue", ...)
  std::string source;   // every source it compiles, for the decision key
  std::string summary;  // one line about the kernel(s)
  int launches = 1;     // kernels (and library calls) per run
  std::function<DeviceStep(DeviceValues& values)> bind;
  // The read-only bytes its bound step streams (a GEMV's weights, repacked or in place), for an
  // L2 prefetch ahead of it (Executable::race_weight_prefetch); unset where there are none to name.
  std::function<std::vector<DeviceByteRange>(DeviceValues& values)> weights;
};
// What one lowering made of a region: its candidates, or the reason it has none.
struct Lowered {
  Decision decision;
  std::vector<FusedCandidate> candidates;  // non-empty exactly when decision.ok
};
// A lowering: a name for reports ("row kernel") and the function. Other modules add their own
// (e.g. the decode MLP) through ExecutableOptions::extra_lowerings.
struct RegionLowering {
  std::string name;
  std::function<Lowered(const ComputeGraph& graph, const FusionRegion& region)> lower;
};
// The built-in lowerings. Row regions: the row-kernel generator, one candidate per variant ("fused",
// "fused wide", ...). Regions with contractions (a matmul with a softmax epilogue, SwiGLU's silu * up
// between projections): the contractions through cuBLASLt and all other ops in one row kernel
// ("fused epilogue", ...), when those ops form a row region that runs between them. Decode-time
// contractions (swiglu_mlp, contraction_epilogue, contraction): the GEMV lowerings above.
Lowered row_region_candidates(const ComputeGraph& graph, const FusionRegion& region);
Lowered contraction_row_candidates(const ComputeGraph& graph, const FusionRegion& region);
// A flash_attention region (one node, src/dispatch/attention_lowering.cpp): the generated decode
// (R <= 16, its default launch shape) or prefill attention kernel, "fused attention decode|prefill"; refused when the node's
// certificate is not verified or the kernels cannot take the problem (dtype, head dims). The node may
// be followed by layout ops that read only it (an attention_output_projection region's first part):
// they run natively after the kernel (views of its output launch nothing).
Lowered flash_attention_candidates(const ComputeGraph& graph, const FusionRegion& region);
// A rope_kv_cache region (rope on q and k, k and v written into their caches; src/fusion/rules.cpp):
// one generated kernel (generate_rope_cache_kernel, codegen.h), "fused rope kv cache", writing each
// cache in place when its output shares the cache's buffer; refused when the region does not have
// exactly that structure (rope_cache_region's reason).
Lowered rope_kv_cache_candidates(const ComputeGraph& graph, const FusionRegion& region);
std::vector<RegionLowering> builtin_lowerings();

// ---------------------------------------------------------------- GEMV lowerings
// Decode-time regions (1..16 activation rows) on the generated GEMV kernels of gemv.h
// (src/dispatch/gemv_lowering.cpp; docs/architecture.md, "Lowering"). The operands come from the
// region's roles, the epilogue from the region's own elementwise ops (GemvEpilogue::from_graph on
// the region graph), so the kernel computes what the graph recorded:
//   swiglu_mlp            gate/up GEMV (epilogue: silu(gate) * up, as written) + down GEMV
//                         (epilogue: the residual add, or a plain store)
//   contraction_epilogue  one GEMV whose epilogue is the region's elementwise ops (residual add, bias)
//   contraction           one unfused matmul / quantized_matmul (the LM head, ...), as a
//                         one-node region the Executable offers (contraction_node_region)
//   contraction_argmax    the same with the argmax of its output (the LM head and greedy
//                         decoding's next tokens): one GEMV writing the values and, by its
//                         argmax_rows join, each row's argmax
//   sibling_contractions  one GEMV over the siblings' weights stacked by rows (q, k, v), each
//                         part's rows written to its own value after its bias add

// A generated GEMV loaded for the current device: the dynamic shared-memory limit raised and,
// for a streamed or split-K kernel, its zeroed workspace allocated. launch() appends the workspace
// to `arguments` (weights ... out, gemv.h's argument order); `programmatic_dependent` launches it
// as a programmatic dependent of the previous kernel on the stream (gemv.h: every generated GEMV
// waits for it before reading x).
struct LoadedGemv {
  GemvKernelSource kernel;
  CompiledKernel compiled;
  std::shared_ptr<DeviceBuffer> workspace;

  static LoadedGemv load(GemvKernelSource kernel, const CompiledProgram& program);
  void launch(const CudaStream& stream, KernelArguments arguments, bool programmatic_dependent = false) const;
};
// Compiles the kernels in parallel (NVRTC needs no device) for the current device's architecture;
// load_gemvs then loads them on this thread, in order.
std::vector<CompiledProgram> compile_gemvs(const std::vector<GemvKernelSource>& kernels);
std::vector<LoadedGemv> load_gemvs(std::vector<GemvKernelSource> kernels);

// The launch shapes one GEMV stage tries, best guesses first: `per_family` register-batch shapes
// from gemv_tuning_candidates (a two-matrix epilogue: the register-resident schedule), the same
// shapes with their weights prefetched into L2 (gemv_l2_prefetch_rounds), for a normalized GEMV the
// same shapes with x staged by cp.async (x_staged_by_async_copy), for affine weights the same shapes
// multiplying in f16 (half_products) where x fits the block's shared memory (and those whose grid is one
// wave only under a tight register bound, bounded: gemv_one_wave_bound), then, where `streamed`, as
// many of the streamed mainloop (a family the problem does not fit is left out; InputError when none
// fits). Shared by the decode-MLP executor and the lowerings, so both race the same kernels.
std::vector<GemvKernelConfig> gemv_stage_configs(const GemvKernelConfig& base, int per_family,
                                                 int multiprocessors = 132, bool streamed = true);
// The variant name of a config in candidate names: "register_resident w4 t1 f2 db" (two
// matrices), "w4 t1 f2 db", "streamed w4 u1 s4 g132x1".
std::string gemv_shape_name(const GemvKernelConfig& config);

// One weight matrix of a GEMV, as values of the graph it was planned on.
struct GemvMatrix {
  GemvWeightFormat format;
  std::int64_t out_features = 0, in_features = 0;  // N, K
  ValueId weight = -1;                // dense: W [N, K] (read in place); affine: the packed codes
  ValueId scales = -1, biases = -1;   // affine only (repacked with the codes when bound)
};
// One sibling of a stacked GEMV (sibling_contractions): its matrix, its bias and the value its
// rows write.
struct GemvRowPart {
  GemvMatrix matrix;
  ValueId bias = -1;    // [N_p]; -1: none (zeros in the stacked bias)
  ValueId output = -1;  // [M, N_p]
};
// One GEMV launch of a lowered region: its matrices (two share x: gate, up), x, the epilogue and
// the values its tensors read, and the value it writes.
struct GemvStage {
  std::vector<GemvMatrix> matrices;
  ValueId input = -1;   // x [M, K]
  ValueId output = -1;  // [M, N]; -1 when row_parts write the output
  ValueId argmax_output = -1;  // next [M] i32 (contraction_argmax): the kernel's argmax_rows join writes it
  // Sibling contractions as one GEMV: matrices holds one matrix (weight -1) that stacks these
  // parts' matrices by rows, made once when bound (DeviceValues::keep_derived); part p's rows
  // write part p's output (GemvKernelConfig::output_splits). With a bias on any part the epilogue
  // is the product rounded to its dtype + the stacked bias [N] (the one epilogue tensor, not in
  // epilogue_tensors).
  std::vector<GemvRowPart> row_parts;
  std::int64_t rows = 0;
  GemvEpilogue epilogue = GemvEpilogue::store();
  std::vector<ValueId> epilogue_tensors;  // in epilogue.tensor_inputs() order
  // The region's RMSNorm of x (rule input prologue, normalized_input_prologue): input is then the
  // norm's x, norm_weight its weight [K], and the kernel normalizes x as it loads it
  // (GemvKernelConfig::x_rms_norm_eps). -1: x is read as it is.
  ValueId norm_weight = -1;
  double norm_eps = 0;
  // qkv_rope_kv_cache: the stacked q, k, v rows rotated and written as attention's inputs
  // (GemvKernelConfig::rope_cache; the stacked rows reordered by gemv_rope_row_order). The parts'
  // outputs are then q, k and v before rope, which nothing writes; the kernel writes q rotated and
  // the caches (in place: the bound step copies a cache whose output has a buffer of its own first).
  std::optional<GemvRopeCacheEpilogue> rope_cache;
  struct RopeCacheValues {
    ValueId positions = -1, q_rotated = -1, k_cache = -1, k_cache_out = -1, v_cache = -1, v_cache_out = -1;
  } rope_values;
  // attention_output_projection: x is the kernel's own decode attention over q and the caches
  // (GemvKernelConfig::attention; input is then the heads merged into one row, which the kernel
  // writes before it reads it).
  std::optional<GemvAttentionPrologue> attention;
  struct AttentionValues {
    ValueId q = -1, k = -1, v = -1, positions = -1;
  } attention_values;
  std::vector<NodeId> nodes;              // the region's nodes this launch computes
  GemvKernelConfig base_config() const;   // register mainloop, default launch shape
};
// How a region maps onto GEMV launches, or why it does not (M > 16, f32, a batched or
// untransposed weight, a value the kernels would not write, a role missing, ...).
struct GemvRegionPlan {
  Decision decision;
  std::vector<GemvStage> stages;  // in launch order; non-empty exactly when decision.ok
};
GemvRegionPlan plan_gemv_swiglu(const ComputeGraph& graph, const FusionRegion& region);
GemvRegionPlan plan_gemv_contraction(const ComputeGraph& graph, const FusionRegion& region);
GemvRegionPlan plan_gemv_siblings(const ComputeGraph& graph, const FusionRegion& region);  // sibling_contractions
GemvRegionPlan plan_gemv_qkv_rope_cache(const ComputeGraph& graph, const FusionRegion& region);  // qkv_rope_kv_cache
// attention_output_projection at decode (one token, the positions mask, a verified certificate): the
// projection's GEMV with the attention prologue. The region's two kernels otherwise (its parts, run
// one after the other, race beside it: lower_region): the flash_attention node with the layout chain
// after it, and the projection with its epilogue as a contraction_epilogue region (roles input: the
// merged heads, weight, addend). Empty when the region does not have the rule's structure.
GemvRegionPlan plan_gemv_attention_projection(const ComputeGraph& graph, const FusionRegion& region);
std::vector<FusionRegion> attention_projection_parts(const ComputeGraph& graph, const FusionRegion& region);
GemvRegionPlan plan_gemv_region(const ComputeGraph& graph, const FusionRegion& region);  // by the region's rule
// The lowerings: each candidate runs the plan's stages with one launch shape per stage (every
// gate/up shape with every down shape for swiglu_mlp). Binding repacks affine weights once
// (DeviceValues::keep_derived: again only when the weights are uploaded again).
// A two-stage region (swiglu_mlp) races every combination of its stages' shapes: per stage the first
// three register shapes, their prefetching twins and, where they fit, their x-async (normalized x) and
// half-products (affine) twins (gemv_stage_configs), without the streamed family, which never won a
// stage race on the H200 (notes/mlp_decode.md; the decode-MLP executor still races it): 6 to 12 shapes
// a stage, 36 to 144 combinations. A one-stage region's candidates do not multiply: four of each
// family, streamed too.
inline constexpr int gemv_lowering_shapes_per_family = 3;
inline constexpr bool gemv_lowering_two_stage_streamed = false;
inline constexpr int gemv_lowering_shapes_per_family_one_stage = 4;
inline constexpr int gemv_lowering_persistent_shapes = 2;  // persistent decode-MLP kernels per swiglu_mlp region
Lowered gemv_swiglu_candidates(const ComputeGraph& graph, const FusionRegion& region);
Lowered gemv_contraction_candidates(const ComputeGraph& graph, const FusionRegion& region);
Lowered gemv_region_candidates(const ComputeGraph& graph, const FusionRegion& region);  // the built-in "gemv"
// A matmul or quantized_matmul node as a region of its own (rule "contraction", roles input and
// weight), so that unfused contractions race their GEMV like any region. When an argmax reads its
// output (the LM head), the argmax joins it (rule "contraction_argmax"): the GEMV can take both.
// When an RMSNorm not in `elsewhere` (other regions' nodes) computes its input and only it reads
// that (the final norm before the LM head), the norm joins too (normalized_input_prologue: roles
// norm_input, norm_weight), and the GEMV normalizes x as it loads it.
FusionRegion contraction_node_region(const ComputeGraph& graph, NodeId node, const std::set<NodeId>& elsewhere = {});
bool is_gemv_contraction_op(const Node& node);  // matmul or quantized_matmul

// ---------------------------------------------------------------- executable
struct ExecutableOptions {
  DispatchMode mode = dispatch_mode_from_environment();
  bool use_decision_cache = true;
  std::filesystem::path decision_cache_file;  // empty: DecisionCache::default_path()
  bool capture_cuda_graph = true;             // run the whole plan as one CUDA graph replay
  // In that replay, each generated GEMV launches as a programmatic dependent of the kernel before it
  // (CudaStream::set_programmatic_dependent_launch): same kernels, same bits, launch gaps hidden.
  bool programmatic_dependent_launch = false;
  TournamentOptions tournament;
  std::uint64_t gate_seed = 0x6d6574696c65;   // inputs of the numeric gate ("metile")
  std::vector<RegionLowering> extra_lowerings;
  // Graph value name -> device address: those values are borrowed, not allocated (the caller's
  // buffer holds at least spec.bytes() and outlives the Executable); run() then needs no host
  // tensor for such an input. InputError when a name is not a value of the plan's graph.
  std::map<std::string, std::uint64_t> external_values;
  // Region kinds (plan rule names: "swiglu_mlp", "flash_attention", ...) whose regions run native
  // with the reason "declined by model verification" (the GPU engine's verify_fused_engine).
  std::set<std::string> declined_rules;
  // > 0: a fused region also binds a second candidate for Executable::race_near_ties
  // (step_race_candidate): the chosen shape's L2-prefetch twin, else the fused candidate its race
  // nearly chose (near_tie_candidate: within this fraction of the chosen one's score). 0: none bound.
  double near_tie_margin = 0;
};

// Device time of one kind of work in one run of an Executable (Executable::profile).
struct StepKindTime {
  std::string kind;  // a region's rule and how it ran ("swiglu_mlp fused"), or an unfused node's op ("rope")
  double ms = 0;
  int steps = 0;     // device steps of that kind in one run
  // What the kind costs inside the replayed graph: the replay's time less that of the same graph
  // captured without this kind's steps (Executable::replay_cost_by_kind); NaN when not measured.
  // A kind that costs nothing (a reshape that moves no byte) measures about 0, either sign: noise.
  // Eager times (ms) overstate latency-bound kernels: inside the replay their launches overlap.
  double replay_ms = std::numeric_limits<double>::quiet_NaN();
  // The weight bytes its steps stream in one run (FusedCandidate::weights: a GEMV's matrices, repacked
  // or in place, and an affine format's scales and biases; not a stacked output bias); 0 where its
  // steps name none (native library calls, attention, row kernels, and a two-part region whose GEMV
  // part ran natively: such a step still counts as its rule's fused kind). Over replay_ms it says how
  // near the copy rate the kind streams.
  std::uint64_t weight_bytes = 0;
};

// Every lowering's candidates for a region (the built-in ones, then the extra ones), or, for each
// lowering that has none, its reason: "row kernel: node 'gate' (matmul) is a contraction op, not a
// row op; contractions around a row kernel: ...". A lowering that accepts a region but offers no
// candidate is reported as refusing it. Generates source only: no device is touched.
struct RegionLowerings {
  std::vector<FusedCandidate> candidates;
  std::string refusals;  // empty when every lowering offered candidates
};
RegionLowerings lower_region(const ComputeGraph& graph, const FusionRegion& region,
                             std::span<const RegionLowering> extra_lowerings = {});
RegionLowerings lower_region(const ComputeGraph& graph, const FusionRegion& region, const ExecutableOptions& options);

// A candidate name's eager form: its CUDA-graph form ("... graph") runs the same kernels, named without
// the suffix (the names near_tie_candidate and its kin return).
std::string eager_candidate_name(const std::string& name);
// The fused candidate a region's race nearly chose: of `timings_ms` (candidate name, score in ms,
// as RegionReport holds them; a name ending in " graph" is the CUDA-graph form of the same kernels),
// the fastest fused one whose kernels are not `chosen`'s, when its score is within `margin` (a
// fraction) of the chosen one's. Its eager name ("fused gemv w8 t1 f2 db"), or nothing.
std::optional<std::string> near_tie_candidate(const std::vector<std::pair<std::string, double>>& timings_ms,
                                              const std::string& chosen, double margin);
// The chosen GEMV shape's L2-prefetch twin, if it was raced: the same shape whose weights are
// requested into L2 before its wait for the previous kernel ("fused gemv w16 t1 f1 db" ->
// "fused gemv w16 t1 f1 db prefetch4", gemv_shape_name: " prefetchN" is the last part of a raced
// twin's name, gemv_stage_configs never makes an x-async one). Its eager name, or nothing; nothing
// for a region of several stages ("gemv A + B"). It gains only where the kernel before it leaves the
// DRAM idle (attention before the o-projection), which a race of the stage alone cannot see: the
// step races it instead (Executable::race_near_ties).
std::optional<std::string> prefetch_twin_candidate(const std::vector<std::pair<std::string, double>>& timings_ms,
                                                   const std::string& chosen);
// What a fused region binds for the race inside the step (ExecutableOptions::near_tie_margin): its
// prefetch twin when it has one (its near tie is then not raced: one alternative a region), else its
// near tie.
std::optional<std::string> step_race_candidate(const std::vector<std::pair<std::string, double>>& timings_ms,
                                               const std::string& chosen, double margin);

// Where Executable::race_weight_prefetch requests weights into the L2, from the weight bytes each
// step of a replay streams (0: no contraction; none: a contraction whose weights are not known, such
// as a native cuBLASLt step, which counts as heavy and gets no prefetch). A GEMV that streams more
// than `budget` bytes (a heavy one) gets its first `budget` bytes requested while the steps right
// before it run: the longest run of steps before it whose GEMVs stream at most `budget` bytes
// together (so the L2 holds at most twice the budget of weights, the run's and the prefetch's). Those steps (q/k/v, attention and the
// o-projection before a decode layer's gate/up) are bound by their latency chains and leave the DRAM
// mostly idle. A heavy GEMV right after another gets none; light GEMVs get none either: measured,
// the o-projection with all its weights requested during attention was no faster (session 22,
// notes/mlp_decode.md), and GEMVs each prefetched one GEMV ahead lost every race (session 7).
struct WeightPrefetchFork {
  std::size_t gemv = 0;     // the step whose weights are requested
  std::size_t fork = 0;     // the first step of the run: the prefetch is enqueued before it
  std::uint64_t bytes = 0;  // how many: the budget (the GEMV streams more)
};
std::vector<WeightPrefetchFork> plan_weight_prefetch(const std::vector<std::optional<std::uint64_t>>& step_weight_bytes,
                                                     std::uint64_t budget);

struct RegionReport {
  int region = -1;  // index in plan.regions; -1: an unfused matmul offered as a region of its own ("contraction")
  std::string rule;
  std::vector<std::string> nodes;
  std::string chosen;       // the chosen candidate's name (chosen_id.name())
  CandidateId chosen_id;
  bool from_cache = false;  // the decision came from the decision cache
  std::vector<std::pair<std::string, NumericGateResult>> gates;  // per candidate (worst output)
  std::vector<std::pair<std::string, double>> timings_ms;
  std::string sentence;     // "region R1 (residual_add_rms_norm): fused, 1.8x over native graph"
};

// A whole plan on the GPU: per region the selected candidate, per unfused node its native step,
// optionally replayed as one CUDA graph. Buffers for every value are allocated once.
class Executable {
 public:
  static Executable build(const FusionPlan& plan, const CudaDevice& device, const ExecutableOptions& options = {});
  ~Executable();
  Executable(Executable&&) noexcept;
  Executable& operator=(Executable&&) noexcept;

  TensorMap run(const TensorMap& inputs);  // upload, enqueue, synchronize, download the outputs
  void enqueue(const CudaStream& stream);  // the device work only (inputs already in values())
  DeviceValues& values();
  const CudaStream& stream() const;
  const std::vector<RegionReport>& reports() const;
  std::string report() const;  // one line per region, then the kernel count
  // race_near_ties's verdicts (also in report()): one line per raced kind, "<kind>: the prefetch twins
  // and near ties raced in the step: X ms with them, Y ms without: kept|not kept"; empty before it ran.
  const std::string& near_tie_verdicts() const;
  // Runs the steps once eagerly on `stream` with events between them (the inputs already in
  // values()) and sums the device time by kind, slowest first. For breakdowns, not for speed.
  std::vector<StepKindTime> profile(const CudaStream& stream);
  // Fills each kind's replay_ms: the replay raced (run_tournament, interleaved rounds) against, for
  // every kind, the same steps captured without that kind's steps, launched as the replay launches
  // them. A timing experiment only: a replay that leaves steps out computes garbage in the values
  // those steps would write (the caller stages inputs whose writes are harmless, as for the races
  // below) and a real run afterwards writes them again. Kinds absent from `times` are ignored.
  void replay_cost_by_kind(std::vector<StepKindTime>& times, const TournamentOptions& tournament);
  int step_count() const;  // device steps per run
  // What reading the step's GEMV weights costs with nothing else done (bench-model's read floors),
  // raced (run_tournament) against the replay as it is: one read-only kernel (DeviceRead) per step
  // that streams weights, in the steps' order, captured as one graph, and one kernel over all of
  // them. A region is one step whatever it launches (the SwiGLU MLP's two GEMVs, attention and the
  // output projection), so the chain has at most as many kernels as the replay: a lower bound. A
  // timing experiment: the replay's writes are the caller's to make harmless (as for
  // replay_cost_by_kind). NaN figures without a captured graph or a step that streams weights.
  struct ReadFloors {
    double replay_ms = std::numeric_limits<double>::quiet_NaN();
    double chain_ms = std::numeric_limits<double>::quiet_NaN();       // one read kernel a step that streams weights
    double one_kernel_ms = std::numeric_limits<double>::quiet_NaN();  // one read kernel over every step's weights
    int kernels = 0;                                                  // the chain's read kernels
    std::uint64_t bytes = 0;                                          // the weights they read
  };
  ReadFloors read_floors(const TournamentOptions& tournament);
  // Captures the same steps a second time with every generated GEMV launched as a programmatic
  // dependent of the kernel before it, races the two replays (run_tournament: same kernels, same
  // bits) and keeps the faster; returns whether that is the dependent one, and report() says so
  // with both times. The replays run on whatever values() holds and write what a run writes: the
  // caller stages inputs whose writes are harmless (the decode engine: the last cache rows).
  // Without a captured graph, or when the options already asked for dependent launches: nothing.
  bool race_programmatic_replay(const TournamentOptions& tournament);
  // Captures the replay again (with or without dependent launches, as it is) with part of the
  // weights of its heavy GEMV steps requested into the L2 by an L2Prefetch on a second stream while
  // the latency-bound steps before each run (plan_weight_prefetch, `l2_budget_bytes`; the bytes its
  // blocks meet first: leading_share); races the two replays as race_programmatic_replay does (same
  // kernels, same bits: a prefetch writes nothing) and keeps the faster; returns whether that is
  // the prefetching one (`keep_without_race`: keeps it untimed). Run it after
  // race_programmatic_replay. Without a captured graph or a GEMV the rule prefetches: nothing.
  bool race_weight_prefetch(const TournamentOptions& tournament, std::uint64_t l2_budget_bytes = std::uint64_t{24} << 20,
                            bool keep_without_race = false);
  // The regions race alone and cold; near ties among their fused candidates can go either way inside
  // the step, where neighbours and programmatic launches change what a kernel costs. For each kind
  // whose regions bound a near tie or a prefetch twin (ExecutableOptions::near_tie_margin), captures
  // the step with those regions running it instead and races the two replays (run_tournament); keeps the other kernels
  // when the replay is at least 1% faster. Run it after race_programmatic_replay and before
  // race_weight_prefetch. The replays run on whatever values() holds and write what a run writes, as
  // for race_programmatic_replay. Returns how many kinds changed their kernels.
  int race_near_ties(const TournamentOptions& tournament);

 private:
  struct State;
  explicit Executable(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace metile
