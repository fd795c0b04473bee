// The three reduction laws as data, their proofs (prove: the four obligations
// discharged by prove_equal) and certificates: JSON, and the check executors
// make before running a node built on a law.
#include <fmt/core.h>

#include <nlohmann/json.hpp>

#include "json_input.h"
#include "metile/discovery.h"

namespace metile {
namespace {

TermRef var(std::string name) { return Term::variable(std::move(name)); }

// The variables of one state or element under a prefix: ("x", {m, l}) -> x.m, x.l.
std::vector<TermRef> variables(const std::string& prefix, const std::vector<LawComponent>& components) {
  std::vector<TermRef> result;
  for (const LawComponent& component : components) result.push_back(var(prefix + "." + component.name));
  return result;
}

std::vector<std::pair<std::string, TermRef>> bind_components(const std::string& prefix, const std::vector<LawComponent>& components,
                                                  const std::vector<TermRef>& values) {
  std::vector<std::pair<std::string, TermRef>> bindings;
  for (std::size_t index = 0; index < components.size(); ++index) {
    bindings.emplace_back(prefix + "." + components[index].name, values[index]);
  }
  return bindings;
}

std::vector<TermRef> apply_bindings(const std::vector<TermRef>& terms, const std::vector<std::pair<std::string, TermRef>>& bindings) {
  std::vector<TermRef> result;
  for (const TermRef& term : terms) result.push_back(substitute(term, bindings));
  return result;
}

std::vector<TermRef> merge(const ReductionLaw& law, const std::vector<TermRef>& left, const std::vector<TermRef>& right) {
  auto bindings = bind_components("a", law.state, left);
  const auto right_bindings = bind_components("b", law.state, right);
  bindings.insert(bindings.end(), right_bindings.begin(), right_bindings.end());
  return apply_bindings(law.merge, bindings);
}

std::vector<TermRef> lift(const ReductionLaw& law, const std::string& element) {
  return apply_bindings(law.lift, bind_components("e", law.element, variables(element, law.element)));
}

Obligation discharge(const ReductionLaw& law, std::string name, const std::vector<TermRef>& lhs,
                     const std::vector<TermRef>& rhs) {
  Obligation obligation;
  obligation.name = std::move(name);
  obligation.holds = true;
  std::string lhs_text = "(";
  std::string rhs_text = "(";
  std::vector<std::string> failures;
  for (std::size_t index = 0; index < law.state.size(); ++index) {
    const EqualityProof proof = prove_equal(lhs[index], rhs[index]);
    const std::string separator = index == 0 ? "" : ", ";
    lhs_text += separator + law.state[index].name + ": " + proof.lhs;
    rhs_text += separator + law.state[index].name + ": " + proof.rhs;
    if (!proof.holds) {
      obligation.holds = false;
      failures.push_back(law.state[index].name + " " + proof.by);
    } else if (proof.by != "normal forms" && obligation.by.empty()) {
      obligation.by = law.state[index].name + " by " + proof.by;
    }
  }
  obligation.lhs = lhs_text + ")";
  obligation.rhs = rhs_text + ")";
  if (!obligation.holds) {
    obligation.by = "fails: ";
    for (std::size_t index = 0; index < failures.size(); ++index) obligation.by += (index ? "; " : "") + failures[index];
  } else if (obligation.by.empty()) {
    obligation.by = "normal forms";
  }
  return obligation;
}

void check_shape(const ReductionLaw& law) {
  const std::size_t size = law.state.size();
  if (law.name.empty() || size == 0 || law.element.empty() || law.identity.size() != size || law.lift.size() != size ||
      law.merge.size() != size || law.pair.size() != size || !law.finalize) {
    throw InputError(fmt::format("law '{}': identity, lift, merge and pair need one term per state component ({}), "
                                 "and a finalize term",
                                 law.name, size));
  }
}

}  // namespace

ReductionLaw sum_law() {
  ReductionLaw law;
  law.name = "sum";
  law.description = "the sum monoid";
  law.state = {{"t", false}};
  law.element = {{"x", false}};
  law.identity = {Term::constant(0)};
  law.lift = {var("e.x")};
  law.merge = {Term::add(var("a.t"), var("b.t"))};
  law.pair = {Term::add(var("e1.x"), var("e2.x"))};
  law.finalize = var("a.t");
  return law;
}

ReductionLaw max_law() {
  ReductionLaw law;
  law.name = "max";
  law.description = "the max monoid";
  law.state = {{"m", false}};
  law.element = {{"x", false}};
  law.identity = {Term::negative_infinity()};
  law.lift = {var("e.x")};
  law.merge = {Term::max(var("a.m"), var("b.m"))};
  law.pair = {Term::max(var("e1.x"), var("e2.x"))};
  law.finalize = var("a.m");
  return law;
}

ReductionLaw stable_weighted_softmax_law() {
  ReductionLaw law;
  law.name = "stable_weighted_softmax";
  law.description = "softmax-weighted sum of value rows: running max m, normalizer l, weighted numerator o";
  law.state = {{"m", false}, {"l", false}, {"o", true}};
  law.element = {{"s", false}, {"v", true}};
  law.identity = {Term::negative_infinity(), Term::constant(0), Term::constant(0)};
  law.lift = {var("e.s"), Term::constant(1), var("e.v")};
  const TermRef merged_max = Term::max(var("a.m"), var("b.m"));
  const TermRef a_rescale = Term::exp(Term::subtract(var("a.m"), merged_max));
  const TermRef b_rescale = Term::exp(Term::subtract(var("b.m"), merged_max));
  law.merge = {merged_max, Term::add(Term::multiply(var("a.l"), a_rescale), Term::multiply(var("b.l"), b_rescale)),
               Term::add(Term::multiply(var("a.o"), a_rescale), Term::multiply(var("b.o"), b_rescale))};
  const TermRef pair_max = Term::max(var("e1.s"), var("e2.s"));
  const TermRef weight_1 = Term::exp(Term::subtract(var("e1.s"), pair_max));
  const TermRef weight_2 = Term::exp(Term::subtract(var("e2.s"), pair_max));
  law.pair = {pair_max, Term::add(weight_1, weight_2),
              Term::add(Term::multiply(weight_1, var("e1.v")), Term::multiply(weight_2, var("e2.v")))};
  law.finalize = Term::divide(var("a.o"), var("a.l"));
  return law;
}

const ReductionLaw* find_law(std::string_view name) {
  static const std::vector<ReductionLaw> laws = {sum_law(), max_law(), stable_weighted_softmax_law()};
  for (const ReductionLaw& law : laws) {
    if (law.name == name) return &law;
  }
  return nullptr;
}

Certificate prove(const ReductionLaw& law) {
  check_shape(law);
  Certificate certificate;
  certificate.law = law.name;
  certificate.theory = std::string(theory_text());
  const std::vector<TermRef> x = variables("x", law.state);
  const std::vector<TermRef> y = variables("y", law.state);
  const std::vector<TermRef> z = variables("z", law.state);
  certificate.obligations.push_back(discharge(law, "left_identity", merge(law, law.identity, x), x));
  certificate.obligations.push_back(discharge(law, "right_identity", merge(law, x, law.identity), x));
  certificate.obligations.push_back(
      discharge(law, "associativity", merge(law, merge(law, x, y), z), merge(law, x, merge(law, y, z))));
  certificate.obligations.push_back(
      discharge(law, "merge_of_lifts", merge(law, lift(law, "e1"), lift(law, "e2")), law.pair));
  certificate.verified = true;
  for (const Obligation& obligation : certificate.obligations) certificate.verified &= obligation.holds;
  return certificate;
}

std::string Certificate::to_json() const {
  nlohmann::ordered_json json;
  json["law"] = law;
  json["theory"] = theory;
  json["obligations"] = nlohmann::ordered_json::array();
  for (const Obligation& obligation : obligations) {
    json["obligations"].push_back(
        {{"name", obligation.name}, {"lhs", obligation.lhs}, {"rhs", obligation.rhs}, {"holds", obligation.holds},
         {"by", obligation.by}});
  }
  json["verified"] = verified;
  return json.dump();
}

Certificate Certificate::from_json(std::string_view text) {
  constexpr std::string_view kWhat = "not a certificate (a JSON object of law, theory, obligations and verified)";
  const nlohmann::json json = parse_json_input(text, kWhat);
  try {
    Certificate certificate;
    certificate.law = json.at("law").get<std::string>();
    certificate.theory = json.at("theory").get<std::string>();
    for (const nlohmann::json& entry : json.at("obligations")) {
      certificate.obligations.push_back({entry.at("name").get<std::string>(), entry.at("lhs").get<std::string>(),
                                         entry.at("rhs").get<std::string>(), entry.at("holds").get<bool>(),
                                         entry.value("by", std::string())});
    }
    certificate.verified = json.at("verified").get<bool>();
    return certificate;
  } catch (const nlohmann::json::exception& error) {
    throw InputError(fmt::format("{}: {}", kWhat, json_error_reason(error)));
  }
}

void require_verified_certificate(const Node& node, std::string_view required_law) {
  const std::string where = fmt::format("node '{}' ({})", node.name, node.op);
  if (!node.attributes.has("certificate")) {
    throw InputError(fmt::format("{}: refused: it carries no certificate (law '{}' must be proved first)", where, required_law));
  }
  Certificate certificate;
  try {
    certificate = Certificate::from_json(node.attributes.get_string("certificate"));
  } catch (const InputError& error) {
    throw InputError(fmt::format("{}: refused: its certificate is unreadable: {}", where, error.what()));
  }
  if (!certificate.verified) {
    std::string failing;
    for (const Obligation& obligation : certificate.obligations) {
      if (!obligation.holds) failing += (failing.empty() ? "" : ", ") + obligation.name;
    }
    throw InputError(fmt::format("{}: refused: the certificate of law '{}' is not verified (fails: {})", where,
                                 certificate.law, failing.empty() ? "unmarked" : failing));
  }
  if (certificate.law != required_law) {
    throw InputError(
        fmt::format("{}: refused: its certificate is for law '{}', the op needs '{}'", where, certificate.law, required_law));
  }
  const ReductionLaw* law = find_law(required_law);
  if (law == nullptr || !(prove(*law) == certificate)) {
    throw InputError(fmt::format("{}: refused: its certificate does not match a fresh proof of law '{}'", where, required_law));
  }
}

void require_verified_certificates(const ComputeGraph& graph) {
  for (const Node& node : graph.nodes()) {
    if (node.op == "flash_attention") require_verified_certificate(node, stable_weighted_softmax_law().name);
  }
}

}  // namespace metile
