// metile discovery module: proof-carrying rewrites. A reduction law (a finite
// summary state with identity, lift, merge, pair summary and finalize, written
// as terms) is proved by normalizing both sides of each of its obligations in a
// small stated theory; the certificate lists every obligation with both normal
// forms. The attention rewrite replaces matmul → [scale] → [mask] → softmax →
// matmul chains by one flash_attention node carrying the certificate of the
// stable weighted-softmax law, which the executors check before running it.
//
//   ComputeGraph ──► rewrite_attention (candidates, conflict selection, certificates) ──► ComputeGraph'
//                ──► plan_graph_fusion (each certified node its own region) ──► FusionPlan
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "metile/decision.h"
#include "metile/fusion.h"
#include "metile/graph.h"

namespace metile {

// ---------------------------------------------------------------- terms

// A term of the law language: real-valued expressions over named variables.
// Immutable and shared; build them with the factories.
struct Term;
using TermRef = std::shared_ptr<const Term>;

struct Term {
  enum class Kind { variable, constant, negative_infinity, add, subtract, multiply, divide, max, exp };
  Kind kind = Kind::constant;
  std::string name;  // variable
  double value = 0;  // constant
  std::vector<TermRef> operands;

  static TermRef variable(std::string name);
  static TermRef constant(double value);
  static TermRef negative_infinity();
  static TermRef add(TermRef a, TermRef b);
  static TermRef subtract(TermRef a, TermRef b);
  static TermRef multiply(TermRef a, TermRef b);
  static TermRef divide(TermRef a, TermRef b);
  static TermRef max(TermRef a, TermRef b);
  static TermRef exp(TermRef a);

  std::string to_string() const;  // as written: "a.l * exp(a.m - max(a.m, b.m))"
};

// The term with every variable named in `bindings` replaced by its term.
TermRef substitute(const TermRef& term, const std::vector<std::pair<std::string, TermRef>>& bindings);

// ---------------------------------------------------------------- the theory and its normalizer

// The stated theory the normalizer decides equalities in (printed in every certificate).
std::string_view theory_text();

// The canonical text of a term's normal form: two terms equal in the theory's
// normal-form fragment have the same text. Throws InputError for a term outside
// the theory (−inf times a non-positive value, division by a sum, ...).
std::string normal_form(const TermRef& term);

struct EqualityProof {
  std::string lhs;  // normal forms
  std::string rhs;
  bool holds = false;
  std::string by;   // "normal forms", "cases over the orderings of a, b" or why it failed
};
// Normalizes both sides; when the forms differ and max occurs, normalizes again
// under every strict ordering of the maxima's arguments (at most 6 of them).
EqualityProof prove_equal(const TermRef& lhs, const TermRef& rhs);

// ---------------------------------------------------------------- reduction laws

// One component of a law's state or of one element it summarizes. A per-lane
// component is a vector (a weighted numerator, a value row) whose lanes all
// follow the same term with the scalar components shared.
struct LawComponent {
  std::string name;
  bool per_lane = false;
};

// A reduction law as data. Variables in the terms: merge reads the left state
// as "a.<component>" and the right one as "b.<component>"; lift reads one
// element as "e.<part>"; pair reads two elements as "e1.<part>", "e2.<part>";
// finalize reads "a.<component>" and gives one value per lane.
struct ReductionLaw {
  std::string name;
  std::string description;
  std::vector<LawComponent> state;
  std::vector<LawComponent> element;
  std::vector<TermRef> identity;  // per state component
  std::vector<TermRef> lift;      // per state component
  std::vector<TermRef> merge;     // per state component
  std::vector<TermRef> pair;      // per state component: the summary of two elements
  TermRef finalize;
};

ReductionLaw sum_law();      // "sum": state (t), identity 0, merge a.t + b.t
ReductionLaw max_law();      // "max": state (m), identity −inf, merge max(a.m, b.m)
// "stable_weighted_softmax": state (m running max, l normalizer, o weighted numerator per lane),
// element (s score, v value row); merge rescales each side by exp(m_side − max(a.m, b.m));
// finalize o / l. flash_attention is built on it.
ReductionLaw stable_weighted_softmax_law();
// The laws a certificate may name, looked up by name (nullptr when unknown).
const ReductionLaw* find_law(std::string_view name);

// ---------------------------------------------------------------- certificates

struct Obligation {
  std::string name;  // "left_identity", "right_identity", "associativity", "merge_of_lifts"
  std::string lhs;   // normal form of each side, one state tuple "(m: ..., l: ..., o: ...)"
  std::string rhs;
  bool holds = false;
  std::string by;
  bool operator==(const Obligation&) const = default;
};

struct Certificate {
  std::string law;
  std::string theory;
  std::vector<Obligation> obligations;
  bool verified = false;  // every obligation holds

  // {"law", "theory", "obligations": [{"name", "lhs", "rhs", "holds", "by"}], "verified"}, one line.
  std::string to_json() const;
  // Throws InputError when the text is not a certificate.
  static Certificate from_json(std::string_view text);
  bool operator==(const Certificate&) const = default;
};

// Produces the four obligations (left and right identity, associativity of the
// merge, merge of two lifted elements equals the pair summary) and discharges
// each with prove_equal on every state component.
Certificate prove(const ReductionLaw& law);

// The check every executor makes before running a node that carries a
// certificate (attribute "certificate"): present, verified, for `required_law`,
// and equal to a fresh proof of that law. Throws InputError, one line naming the node.
void require_verified_certificate(const Node& node, std::string_view required_law);

// require_verified_certificate for every flash_attention node of `graph` (law
// stable_weighted_softmax): what the executors will refuse is refused when plan_with_discovery or
// `metile plan` plans the graph, so that neither shows a forged or unproved certificate as a kernel
// to run (plan_graph_fusion, in the fusion module, plans what it is given and only describes it).
void require_verified_certificates(const ComputeGraph& graph);

// ---------------------------------------------------------------- evaluating a law

// Evaluates a law's terms on doubles. A state is a flat vector: each component
// one value, or `lanes` values for a per-lane one, in the law's order; an
// element likewise. Subtraction of equal values is 0 even for −inf (so merging
// two identities gives the identity); subterms that read no per-lane variable
// are evaluated once per call, not once per lane.
class LawEvaluator {
 public:
  LawEvaluator(const ReductionLaw& law, std::int64_t lanes);
  ~LawEvaluator();
  LawEvaluator(LawEvaluator&&) noexcept;
  LawEvaluator& operator=(LawEvaluator&&) noexcept;

  std::size_t state_size() const;
  std::size_t element_size() const;
  std::vector<double> identity() const;
  void lift(std::span<const double> element, std::span<double> state) const;
  // left = merge(left, right)
  void merge_into(std::span<double> left, std::span<const double> right) const;
  void finalize(std::span<const double> state, std::span<double> out) const;  // `lanes` values

 private:
  struct Programs;
  std::unique_ptr<Programs> programs_;
};

// ---------------------------------------------------------------- the attention rewrite

// One chain found in the graph, whether rewritten or not.
struct AttentionMatch {
  std::vector<NodeId> nodes;  // ascending: scores matmul, scales, mask, softmax, output matmul
  NodeId output_matmul = -1;
  ValueId q = -1, k = -1, v = -1, positions = -1;
  double scale = 1;
  std::string mask = "none";  // "none" | "causal" | "positions"
  std::int64_t offset = 0;    // causal only
  std::int64_t avoided_bytes = 0;  // the score and probability tensors, each written once and read once
  bool selected = false;
};

struct AttentionRefusal {
  NodeId node = -1;    // the softmax (or the op where the chain broke)
  std::string reason;  // "softmax axis is not the key axis", "scores escape to a graph output", ...
};

struct AttentionRewrite {
  ComputeGraph graph;  // the rewritten graph (the input itself when nothing was rewritten)
  std::vector<AttentionMatch> candidates;
  std::vector<ConflictComponent> components;  // from the planner's conflict selection
  std::vector<AttentionRefusal> refusals;
  Certificate certificate;  // of the law the nodes carry
  // For a person: per candidate and refusal one line.
  std::vector<std::string> summary(const ComputeGraph& original) const;
};

// Finds every chain, selects among overlapping candidates with the planner's
// conflict selection (weights: avoided bytes) and replaces each selected chain
// by one flash_attention node named like the output matmul (so consumers and
// graph outputs are unchanged), carrying attrs scale, mask, offset and the
// certificate. A law whose certificate is not verified rewrites nothing (every
// chain is refused with that reason). `admit`, where given, may refuse a chain
// before selection (plan_with_discovery: the target's cost model finds no saving).
AttentionRewrite rewrite_attention(const ComputeGraph& graph,
                                   const ReductionLaw& law = stable_weighted_softmax_law(),
                                   const std::function<Decision(const AttentionMatch&)>& admit = {});

// The definition a flash_attention node stands for, as plain ops: inputs "q", "k", "v" (and
// "positions" for the positions mask), matmul(q, k, transpose_right) -> scale -> [mask] ->
// softmax -> matmul(·, v) as output "out". The device's native path runs this graph (cuBLASLt and
// unfused kernels). InputError when the node's certificate is not verified: nothing built on an
// unproved law runs.
ComputeGraph flash_attention_as_plain_ops(const ComputeGraph& graph, NodeId flash_attention_node);

// require_verified_certificates on the graph given (InputError for a flash_attention node it could
// not run), without_dead_nodes (graph.h), rewrite_attention, then plan_graph_fusion of the rewritten graph; each
// flash_attention region's benefit is the planner's estimate for the chain it
// replaced, a chain whose estimate is no saving on the target stays unrewritten
// (refused with the figure), and plan.rewrites says what was removed, rewritten or refused and why.
FusionPlan plan_with_discovery(const ComputeGraph& graph, const FusionTarget& target = FusionTarget::h200(),
                               const RuleSet& rules = default_rules());

}  // namespace metile
