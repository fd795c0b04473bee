// The term language of reduction laws (include/metile/discovery.h): factories,
// the printed form, and substitution of variables (how obligations are built
// from a law's operations).
#include <fmt/core.h>

#include <cmath>

#include "metile/discovery.h"

namespace metile {
namespace {

TermRef make(Term::Kind kind, std::vector<TermRef> operands) {
  for (const TermRef& operand : operands) {
    if (!operand) throw InputError("term: an operand is missing");
  }
  auto term = std::make_shared<Term>();
  term->kind = kind;
  term->operands = std::move(operands);
  return term;
}

// Binding strength for printing without redundant parentheses.
int precedence(const Term& term) {
  switch (term.kind) {
    case Term::Kind::add:
    case Term::Kind::subtract: return 1;
    case Term::Kind::multiply:
    case Term::Kind::divide: return 2;
    default: return 3;
  }
}

std::string operand_text(const TermRef& operand, int parent_precedence, bool right_of_non_associative) {
  const std::string text = operand->to_string();
  const int own = precedence(*operand);
  const bool wrap = own < parent_precedence || (right_of_non_associative && own == parent_precedence);
  return wrap ? "(" + text + ")" : text;
}

}  // namespace

TermRef Term::variable(std::string name) {
  if (name.empty()) throw InputError("term: a variable needs a name");
  auto term = std::make_shared<Term>();
  term->kind = Kind::variable;
  term->name = std::move(name);
  return term;
}

TermRef Term::constant(double value) {
  if (!std::isfinite(value)) throw InputError("term: a constant must be finite (use negative_infinity for −inf)");
  auto term = std::make_shared<Term>();
  term->kind = Kind::constant;
  term->value = value;
  return term;
}

TermRef Term::negative_infinity() {
  auto term = std::make_shared<Term>();
  term->kind = Kind::negative_infinity;
  return term;
}

TermRef Term::add(TermRef a, TermRef b) { return make(Kind::add, {std::move(a), std::move(b)}); }
TermRef Term::subtract(TermRef a, TermRef b) { return make(Kind::subtract, {std::move(a), std::move(b)}); }
TermRef Term::multiply(TermRef a, TermRef b) { return make(Kind::multiply, {std::move(a), std::move(b)}); }
TermRef Term::divide(TermRef a, TermRef b) { return make(Kind::divide, {std::move(a), std::move(b)}); }
TermRef Term::max(TermRef a, TermRef b) { return make(Kind::max, {std::move(a), std::move(b)}); }
TermRef Term::exp(TermRef a) { return make(Kind::exp, {std::move(a)}); }

std::string Term::to_string() const {
  switch (kind) {
    case Kind::variable: return name;
    case Kind::constant: return fmt::format("{}", value);
    case Kind::negative_infinity: return "-inf";
    case Kind::max: return fmt::format("max({}, {})", operands[0]->to_string(), operands[1]->to_string());
    case Kind::exp: return fmt::format("exp({})", operands[0]->to_string());
    case Kind::add:
    case Kind::subtract:
    case Kind::multiply:
    case Kind::divide: {
      static constexpr std::string_view symbols[] = {"+", "-", "*", "/"};
      const auto symbol = symbols[static_cast<int>(kind) - static_cast<int>(Kind::add)];
      const bool non_associative = kind == Kind::subtract || kind == Kind::divide;
      return fmt::format("{} {} {}", operand_text(operands[0], precedence(*this), false), symbol,
                         operand_text(operands[1], precedence(*this), non_associative));
    }
  }
  return "?";
}

TermRef substitute(const TermRef& term, const std::vector<std::pair<std::string, TermRef>>& bindings) {
  if (term->kind == Term::Kind::variable) {
    for (const auto& [name, replacement] : bindings) {
      if (name == term->name) return replacement;
    }
    return term;
  }
  if (term->operands.empty()) return term;
  std::vector<TermRef> operands;
  for (const TermRef& operand : term->operands) operands.push_back(substitute(operand, bindings));
  return make(term->kind, std::move(operands));
}

}  // namespace metile
