// The normalizer of the law theory (theory_text()): a term becomes a
// polynomial whose canonical text decides equality.
//
//   polynomial = −inf  |  Σ coefficient · monomial            (terms sorted by monomial text)
//   monomial   = Π atom^power · exp(polynomial)                (at most one exp: exp(x)·exp(y) = exp(x + y))
//   atom       = variable | max(polynomial, ...) | (polynomial) under a division
//
// max is kept flat, sorted and duplicate-free, −inf dropped from it (its
// identity), and the part every argument shares moved out of it (max(a + c,
// b + c) = max(a, b) + c). What the normal forms alone cannot show (exp(max(a,
// b)) = max(exp(a), exp(b))) prove_equal settles by cases over the orderings
// of the maxima's arguments.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "metile/discovery.h"

namespace metile {
namespace {

struct Polynomial;

struct Atom {
  std::string text;                        // the variable's name, "max(...)" or "(...)"
  std::vector<Polynomial> max_arguments;   // a max atom's arguments (sorted by text)
};

struct Monomial {
  std::map<std::string, std::pair<std::shared_ptr<const Atom>, int>> factors;  // atom text -> (atom, power)
  std::shared_ptr<const Polynomial> exponent;                                  // null: no exp factor
  std::string text() const;
};

struct Polynomial {
  std::map<std::string, std::pair<Monomial, double>> terms;  // monomial text -> (monomial, coefficient)
  bool minus_infinity = false;
  std::string text() const;
  bool is_zero() const { return !minus_infinity && terms.empty(); }
};

std::string number_text(double value) { return fmt::format("{}", value); }

// Coefficient arithmetic in double, exact or refused: the theory's coefficients are rationals, and a
// rounded sum (1e16 + 1 - 1e16 = 0) or product would make unequal sides equal.
[[noreturn]] void inexact(std::string_view what) {
  throw InputError(fmt::format("{} is not exact in double (coefficients are rationals)", what));
}
double exact_sum(double a, double b) {
  const double sum = a + b;
  const double b_part = sum - a;  // Knuth's two-sum: the rounding error of a + b
  if (!std::isfinite(sum) || (a - (sum - b_part)) + (b - b_part) != 0) inexact(fmt::format("{} + {}", a, b));
  return sum;
}
double exact_product(double a, double b) {
  const double product = a * b;
  if (!std::isfinite(product) || std::fma(a, b, -product) != 0) inexact(fmt::format("{} * {}", a, b));
  return product;
}
double exact_inverse(double a) {
  const double inverse = 1.0 / a;
  if (!std::isfinite(inverse) || std::fma(a, inverse, -1.0) != 0) inexact(fmt::format("1 / {}", a));
  return inverse;
}

std::string Monomial::text() const {
  std::string result;
  for (const auto& [key, factor] : factors) {
    if (!result.empty()) result += "*";
    result += key;
    if (factor.second != 1) result += "^" + std::to_string(factor.second);
  }
  if (exponent) result += (result.empty() ? "" : "*") + std::string("exp(") + exponent->text() + ")";
  return result;
}

std::string Polynomial::text() const {
  if (minus_infinity) return "-inf";
  if (terms.empty()) return "0";
  std::string result;
  for (const auto& [key, entry] : terms) {
    const double coefficient = entry.second;
    const bool negative = coefficient < 0;
    const double magnitude = std::abs(coefficient);
    std::string term = key.empty() ? number_text(magnitude)
                                   : (magnitude == 1 ? key : number_text(magnitude) + "*" + key);
    if (result.empty()) {
      result = (negative ? "-" : "") + term;
    } else {
      result += (negative ? " - " : " + ") + term;
    }
  }
  return result;
}

Polynomial constant_polynomial(double value) {
  Polynomial result;
  if (value != 0) result.terms.emplace("", std::pair{Monomial{}, value});
  return result;
}

Polynomial atom_polynomial(std::shared_ptr<const Atom> atom) {
  Monomial monomial;
  const std::string key = atom->text;
  monomial.factors.emplace(key, std::pair{std::move(atom), 1});
  Polynomial result;
  result.terms.emplace(monomial.text(), std::pair{monomial, 1.0});
  return result;
}

void add_term(Polynomial& into, const Monomial& monomial, double coefficient) {
  const std::string key = monomial.text();
  auto [at, inserted] = into.terms.emplace(key, std::pair{monomial, coefficient});
  if (!inserted) {
    at->second.second = exact_sum(at->second.second, coefficient);
    if (at->second.second == 0) into.terms.erase(at);
  }
}

Polynomial add(const Polynomial& a, const Polynomial& b) {
  if (a.minus_infinity || b.minus_infinity) {
    Polynomial result;
    result.minus_infinity = true;  // −inf + x = −inf for every finite x
    return result;
  }
  Polynomial result = a;
  for (const auto& [key, entry] : b.terms) add_term(result, entry.first, entry.second);
  return result;
}

bool is_positive_constant(const Polynomial& p) {
  return !p.minus_infinity && p.terms.size() == 1 && p.terms.begin()->first.empty() && p.terms.begin()->second.second > 0;
}

Polynomial multiply(const Polynomial& a, const Polynomial& b);

// A monomial product; nullopt when its exponent is −inf (exp(−inf) = 0).
std::optional<Monomial> multiply(const Monomial& a, const Monomial& b) {
  Monomial result = a;
  for (const auto& [key, factor] : b.factors) {
    auto [at, inserted] = result.factors.emplace(key, factor);
    if (!inserted) {
      at->second.second += factor.second;
      if (at->second.second == 0) result.factors.erase(at);
    }
  }
  if (b.exponent) {
    Polynomial exponent = result.exponent ? add(*result.exponent, *b.exponent) : *b.exponent;
    if (exponent.minus_infinity) return std::nullopt;
    result.exponent = exponent.is_zero() ? nullptr : std::make_shared<const Polynomial>(std::move(exponent));
  }
  return result;
}

Polynomial multiply(const Polynomial& a, const Polynomial& b) {
  if (a.is_zero() || b.is_zero()) {
    if (a.minus_infinity || b.minus_infinity) throw InputError("−inf · 0 is outside the theory");
    return {};
  }
  if (a.minus_infinity || b.minus_infinity) {
    const Polynomial& other = a.minus_infinity ? b : a;
    if (other.minus_infinity || !is_positive_constant(other)) {
      throw InputError("−inf times " + other.text() + " is outside the theory (only positive constants keep −inf)");
    }
    return a.minus_infinity ? a : b;
  }
  Polynomial result;
  for (const auto& [key_a, entry_a] : a.terms) {
    for (const auto& [key_b, entry_b] : b.terms) {
      if (auto product = multiply(entry_a.first, entry_b.first)) {
        add_term(result, *product, exact_product(entry_a.second, entry_b.second));
      }
    }
  }
  return result;
}

Polynomial negate(const Polynomial& p) { return multiply(p, constant_polynomial(-1)); }

Polynomial exp_of(const Polynomial& argument) {
  if (argument.minus_infinity) return {};  // exp(−inf) = 0
  if (argument.is_zero()) return constant_polynomial(1);
  Monomial monomial;
  monomial.exponent = std::make_shared<const Polynomial>(argument);
  Polynomial result;
  result.terms.emplace(monomial.text(), std::pair{monomial, 1.0});
  return result;
}

// The max atom a polynomial is exactly (1 · max(...)), for flattening.
const Atom* lone_max_atom(const Polynomial& p) {
  if (p.minus_infinity || p.terms.size() != 1) return nullptr;
  const auto& [monomial, coefficient] = p.terms.begin()->second;
  if (coefficient != 1 || monomial.exponent || monomial.factors.size() != 1) return nullptr;
  const auto& [atom, power] = monomial.factors.begin()->second;
  return power == 1 && !atom->max_arguments.empty() ? atom.get() : nullptr;
}

// What normalizing one side under one case needs: the argument ranking of the
// case (higher wins), and where the maxima's arguments are collected.
struct CaseContext {
  const std::map<std::string, int>* rank = nullptr;
  std::set<std::string>* collected_arguments = nullptr;
};

Polynomial max_of(std::vector<Polynomial> arguments, const CaseContext& context) {
  std::vector<Polynomial> flat;
  for (Polynomial& argument : arguments) {
    if (argument.minus_infinity) continue;  // −inf is the identity of max
    if (const Atom* nested = lone_max_atom(argument)) {
      for (const Polynomial& inner : nested->max_arguments) flat.push_back(inner);
    } else {
      flat.push_back(std::move(argument));
    }
  }
  std::map<std::string, Polynomial> distinct;  // idempotent, commutative: a sorted set
  for (Polynomial& argument : flat) distinct.emplace(argument.text(), std::move(argument));
  if (distinct.empty()) {
    Polynomial result;
    result.minus_infinity = true;
    return result;
  }
  if (distinct.size() == 1) return distinct.begin()->second;
  // Translation invariance: the terms every argument has with the same coefficient move out.
  Polynomial shared;
  const Polynomial& first = distinct.begin()->second;
  for (const auto& term : first.terms) {
    const auto& key = term.first;  // not a structured binding: clang 14 cannot capture those
    const auto& entry = term.second;
    const bool everywhere = std::all_of(distinct.begin(), distinct.end(), [&](const auto& item) {
      const auto found = item.second.terms.find(key);
      return found != item.second.terms.end() && found->second.second == entry.second;
    });
    if (everywhere) add_term(shared, entry.first, entry.second);
  }
  std::vector<Polynomial> reduced;
  std::map<std::string, Polynomial> reduced_distinct;
  for (const auto& [text, argument] : distinct) {
    Polynomial rest = add(argument, negate(shared));
    reduced_distinct.emplace(rest.text(), std::move(rest));
  }
  if (context.collected_arguments != nullptr) {
    for (const auto& [text, argument] : reduced_distinct) context.collected_arguments->insert(text);
  }
  if (context.rank != nullptr) {
    const Polynomial* largest = nullptr;
    int largest_rank = -1;
    bool decided = true;
    for (const auto& [text, argument] : reduced_distinct) {
      const auto found = context.rank->find(text);
      if (found == context.rank->end()) {
        decided = false;
        break;
      }
      if (found->second > largest_rank) {
        largest_rank = found->second;
        largest = &argument;
      }
    }
    if (decided) return add(shared, *largest);
  }
  auto atom = std::make_shared<Atom>();
  atom->text = "max(";
  for (auto& [text, argument] : reduced_distinct) {
    atom->text += (atom->max_arguments.empty() ? "" : ", ") + text;
    atom->max_arguments.push_back(std::move(argument));
  }
  atom->text += ")";
  return add(shared, atom_polynomial(std::move(atom)));
}

Polynomial divide(const Polynomial& numerator, const Polynomial& denominator) {
  if (denominator.minus_infinity || denominator.is_zero()) {
    throw InputError("division by " + denominator.text() + " is outside the theory");
  }
  Polynomial inverse;
  if (denominator.terms.size() == 1) {
    // c · Π atom^p · exp(x)  ->  (1/c) · Π atom^-p · exp(-x)
    const auto& [monomial, coefficient] = denominator.terms.begin()->second;
    Monomial inverted;
    for (const auto& [key, factor] : monomial.factors) inverted.factors.emplace(key, std::pair{factor.first, -factor.second});
    if (monomial.exponent) inverted.exponent = std::make_shared<const Polynomial>(negate(*monomial.exponent));
    inverse.terms.emplace(inverted.text(), std::pair{inverted, exact_inverse(coefficient)});
  } else {
    // A sum in a denominator stays an opaque atom: (p)^-1.
    auto atom = std::make_shared<Atom>();
    atom->text = "(" + denominator.text() + ")";
    Monomial inverted;
    inverted.factors.emplace(atom->text, std::pair{std::shared_ptr<const Atom>(atom), -1});
    inverse.terms.emplace(inverted.text(), std::pair{inverted, 1.0});
  }
  return multiply(numerator, inverse);
}

Polynomial normalize(const Term& term, const CaseContext& context) {
  switch (term.kind) {
    case Term::Kind::variable: {
      auto atom = std::make_shared<Atom>();
      atom->text = term.name;
      return atom_polynomial(std::move(atom));
    }
    case Term::Kind::constant: return constant_polynomial(term.value);
    case Term::Kind::negative_infinity: {
      Polynomial result;
      result.minus_infinity = true;
      return result;
    }
    case Term::Kind::add: return add(normalize(*term.operands[0], context), normalize(*term.operands[1], context));
    case Term::Kind::subtract:
      return add(normalize(*term.operands[0], context), negate(normalize(*term.operands[1], context)));
    case Term::Kind::multiply:
      return multiply(normalize(*term.operands[0], context), normalize(*term.operands[1], context));
    case Term::Kind::divide:
      return divide(normalize(*term.operands[0], context), normalize(*term.operands[1], context));
    case Term::Kind::max:
      return max_of({normalize(*term.operands[0], context), normalize(*term.operands[1], context)}, context);
    case Term::Kind::exp: return exp_of(normalize(*term.operands[0], context));
  }
  throw InputError("term: unknown kind");
}

constexpr std::size_t max_case_arguments = 6;  // 720 orderings

}  // namespace

std::string_view theory_text() {
  static const std::string text =
      "commutative semiring (+, *, 0, 1) over the reals with rational coefficients, a - b = a + (-1)*b, "
      "a / m = a * m^-1 for a single monomial m; max associative, commutative, idempotent, -inf its identity, "
      "max(a + c, b + c) = max(a, b) + c; exp(x + y) = exp(x)*exp(y), exp(0) = 1, exp(-inf) = 0; "
      "-inf + x = -inf and c*(-inf) = -inf for c > 0; variables denote finite reals; "
      "sides are equal when their normal forms are, or, where max occurs, when they are in every strict ordering "
      "of the maxima's arguments (each max replaced by its largest argument; both sides are continuous, so ties follow; "
      "distinct argument texts are distinct atoms of the ordering, so the split is sound but not complete)";
  return text;
}

std::string normal_form(const TermRef& term) { return normalize(*term, {}).text(); }

EqualityProof prove_equal(const TermRef& lhs, const TermRef& rhs) {
  EqualityProof proof;
  std::set<std::string> arguments;
  try {
    const CaseContext collecting{nullptr, &arguments};
    proof.lhs = normalize(*lhs, collecting).text();
    proof.rhs = normalize(*rhs, collecting).text();
  } catch (const InputError& error) {
    proof.lhs = proof.lhs.empty() ? lhs->to_string() : proof.lhs;
    proof.rhs = proof.rhs.empty() ? rhs->to_string() : proof.rhs;
    proof.by = std::string("outside the theory: ") + error.what();
    return proof;
  }
  if (proof.lhs == proof.rhs) {
    proof.holds = true;
    proof.by = "normal forms";
    return proof;
  }
  if (arguments.size() < 2) {
    proof.by = "normal forms differ";
    return proof;
  }
  if (arguments.size() > max_case_arguments) {
    proof.by = fmt::format("normal forms differ; {} max arguments are too many to split into cases", arguments.size());
    return proof;
  }
  std::vector<std::string> order(arguments.begin(), arguments.end());
  std::string names;
  for (const std::string& argument : order) names += (names.empty() ? "" : ", ") + argument;
  do {
    std::map<std::string, int> rank;
    for (std::size_t position = 0; position < order.size(); ++position) rank[order[position]] = static_cast<int>(position);
    const CaseContext case_context{&rank, nullptr};
    std::string lhs_case;
    std::string rhs_case;
    try {
      lhs_case = normalize(*lhs, case_context).text();
      rhs_case = normalize(*rhs, case_context).text();
    } catch (const InputError& error) {
      proof.by = std::string("outside the theory in a case: ") + error.what();
      return proof;
    }
    if (lhs_case != rhs_case) {
      std::string ordering;
      for (std::size_t position = order.size(); position-- > 0;) ordering += order[position] + (position ? " > " : "");
      proof.by = fmt::format("differs where {}: {} vs {}", ordering, lhs_case, rhs_case);
      return proof;
    }
  } while (std::next_permutation(order.begin(), order.end()));
  proof.holds = true;
  proof.by = "cases over the orderings of " + names;
  return proof;
}

}  // namespace metile
