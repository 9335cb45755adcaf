// Constant folding, as jinja2's optimizer does when it compiles a template
// (FoldConstants, jinja_interp.h): evaluated once, at parse time, by the
// interpreter of jinja_interp.cc.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <optional>
#include <stdexcept>

#include "chat/jinja_interp.h"
#include "chat/jinja_unicode.h"

namespace coalesce::chat::jinja {

// An expression of constants only is evaluated once, with the sandbox's
// getitem for slices (so slicing what cannot be sliced is an undefined value,
// not a TypeError); the result replaces the expression where it has a safe
// repr (None, bool, numbers, str, and lists, tuples and dicts of those), and
// a printed constant expression is replaced by its text. Where evaluating
// fails, the expression stays and fails (or not) when rendered.

namespace {

// jinja2's has_safe_repr, and small enough to keep in the template
// (`budget` counts elements and string bytes / 64; a larger result is left
// to the render, which computes the same value under the render's limits).
bool SafeRepr(const Value& v, int64_t* budget, int depth = 0) {
  if (depth > kMaxValueDepth || --*budget < 0) return false;
  switch (v.type()) {
    case Type::kNone:
    case Type::kBool:
    case Type::kInt:
    case Type::kFloat:
      return true;
    case Type::kString:
      *budget -= static_cast<int64_t>(v.str().size() / 64);
      return *budget >= 0;
    case Type::kSeq:
      if (v.seq_kind() == SeqKind::kRange) {
        *budget -= static_cast<int64_t>(v.seq().items.size());
        return *budget >= 0;
      }
      if (v.seq_kind() != SeqKind::kList && v.seq_kind() != SeqKind::kTuple) return false;
      for (const Value& item : v.seq().items) {
        if (!SafeRepr(item, budget, depth + 1)) return false;
      }
      return true;
    case Type::kDict:
      for (const auto& [k, val] : v.dict().entries) {
        if (!SafeRepr(k, budget, depth + 1) || !SafeRepr(val, budget, depth + 1)) return false;
      }
      return true;
    default:
      return false;
  }
}

constexpr int64_t kFoldValueBudget = 1024;
// Evaluation steps all the folding of one template may take.
constexpr int64_t kFoldStepBudget = 1'000'000;

class Folder {
 public:
  Folder() {
    // Folding happens once per template: bounded well below a render's limits
    // (what does not fold is evaluated at render time, under those).
    env_.limits = {16, 10'000, 64 << 10};
  }

  void FoldBody(Body& body) {
    for (auto& s : body) {
      FoldExpr(s->expr);
      FoldExpr(s->cond);
      for (auto& [test, b] : s->branches) {
        FoldExpr(test);
        FoldBody(b);
      }
      for (auto& v : s->with_values) FoldExpr(v);
      if (s->macro != nullptr) {
        for (auto& d : s->macro->defaults) FoldExpr(d);
        FoldBody(s->macro->body);
      }
      FoldBody(s->body);
      FoldBody(s->else_body);
      if (s->kind == StmtKind::kPrint && s->expr->is_const && s->expr->kind != ExprKind::kConst) {
        std::optional<Value> v = Evaluate(*s->expr);
        if (v.has_value()) {
          std::string text = ToStr(*v);
          if (text.size() <= 64 * kFoldValueBudget) {
            Replace(s->expr, Value::TemplateStr(std::move(text)));
          }
        }
      }
    }
  }

 private:
  std::optional<Value> Evaluate(const Expr& e) {
    if (steps_ >= kFoldStepBudget) return std::nullopt;
    Interp interp(env_);
    try {
      Value v = interp.EvalConst(e);
      steps_ += interp.steps();
      return v;
    } catch (const Error&) {
    } catch (const std::bad_alloc&) {
    } catch (const std::length_error&) {
    }
    steps_ += interp.steps();
    return std::nullopt;
  }

  static void Replace(ExprPtr& e, Value v) {
    auto c = std::make_unique<Expr>();
    c->kind = ExprKind::kConst;
    c->line = e->line;
    c->value = std::move(v);
    c->is_const = true;
    e = std::move(c);
  }

  void FoldExpr(ExprPtr& e) {
    if (e == nullptr) return;
    for (auto& c : e->operands) FoldExpr(c);
    for (auto& c : e->call.args) FoldExpr(c);
    for (auto& [k, c] : e->call.kwargs) FoldExpr(c);
    FoldExpr(e->call.dyn_args);
    FoldExpr(e->call.dyn_kwargs);
    if (e->kind == ExprKind::kConst || e->kind == ExprKind::kSlice) return;
    e->is_const = ComputeIsConst(*e);
    // and, or, inline if and comparisons short-circuit: jinja2 folds them
    // when the operands they evaluate are constant, whatever the others are
    // (evaluating a name in const mode fails the attempt).
    const bool short_circuit =
        ((e->kind == ExprKind::kAnd || e->kind == ExprKind::kOr || e->kind == ExprKind::kCompare) &&
         e->operands[0]->is_const) ||
        (e->kind == ExprKind::kCondExpr && e->operands[1]->is_const);
    if (!e->is_const && !short_circuit) return;
    std::optional<Value> v = Evaluate(*e);
    if (!v.has_value()) return;
    e->is_const = true;
    int64_t budget = kFoldValueBudget;
    // What a constant expression gives, the template wrote.
    if (SafeRepr(*v, &budget)) Replace(e, AllOwn(*v));
  }

  RenderEnv env_;
  int64_t steps_ = 0;
};

}  // namespace

void FoldConstants(Template* tmpl) {
  Folder folder;
  folder.FoldBody(tmpl->body);
}

}  // namespace coalesce::chat::jinja
