// The evaluator of parsed templates (jinja_interp.cc) and the builtins it
// calls (jinja_builtins.cc: filters, tests, methods of str/dict/list, the
// globals). Internal to chat/.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "chat/jinja.h"
#include "chat/jinja_ast.h"
#include "chat/jinja_value.h"

namespace coalesce::chat::jinja {

// Variables visible at one point of a template; `parent` is the enclosing
// scope (a for-loop iteration, a macro call and a with block get their own,
// as in jinja2; an if does not).
struct Scope {
  Scope* parent = nullptr;
  std::vector<std::pair<std::string, Value>> vars;
  bool pinned = false;  // a macro defined here may still be called: keep it

  const Value* Find(std::string_view name) const {
    for (const Scope* s = this; s != nullptr; s = s->parent) {
      for (const auto& [k, v] : s->vars) {
        if (k == name) return &v;
      }
    }
    return nullptr;
  }
  void Set(const std::string& name, Value value) {
    for (auto& [k, v] : vars) {
      if (k == name) {
        v = std::move(value);
        return;
      }
    }
    vars.emplace_back(name, std::move(value));
  }
};

struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;

  const Value* Kw(std::string_view name) const {
    for (const auto& [k, v] : kw) {
      if (k == name) return &v;
    }
    return nullptr;
  }
};

// Binds call arguments to a Python signature (parameter names in order):
// Get(i) is the i-th parameter, given by position or keyword; too many
// arguments or an unknown keyword is a TypeError.
class Bound {
 public:
  Bound(std::string_view func, const Args& args, std::vector<std::string_view> names);
  // The argument, or null when not given.
  const Value* Get(size_t i) const { return values_[i]; }
  bool Has(size_t i) const { return values_[i] != nullptr; }
  const Value& Or(size_t i, const Value& fallback) const {
    return values_[i] != nullptr ? *values_[i] : fallback;
  }

 private:
  std::vector<const Value*> values_;
};

class Interp {
 public:
  explicit Interp(const RenderEnv& env);
  ~Interp();

  TrackedText Render(const Template& tmpl);
  // Evaluates an expression of constants as jinja2's optimizer does (see
  // FoldConstants).
  Value EvalConst(const Expr& e);

  // --- used by the builtins ---
  void Step() {
    if (++steps_ + tl_work > limits_.max_steps) StepLimit();
  }
  void Charge(int64_t n) {
    steps_ += n;
    if (steps_ + tl_work > limits_.max_steps) StepLimit();
  }
  // A new str, charged by its length and refused beyond max_output_bytes.
  Value MakeStr(std::string s, bool safe = false);
  // A new str with its own ranges, charged and bounded alike.
  Value MakeStr(TrackedText t);
  // The str `piece`, found at byte `begin` of str `of`, with the own ranges
  // of those bytes of `of` (none if `piece` is not there).
  Value Substr(const Value& of, size_t begin, std::string piece);
  Value MakeSeq(SeqKind kind, std::vector<Value> items);
  [[noreturn]] void StringLimit();
  [[noreturn]] void StepLimit();
  // Folding met a name, a call or a filter that needs the context.
  [[noreturn]] static void NotConstant();

  Value GetAttr(const Value& obj, std::string_view name);
  Value GetItem(const Value& obj, const Value& key);
  Value Call(const Value& callee, const Args& args);
  Value ApplyFilter(std::string_view name, const Value& value, const Args& args);
  bool ApplyTest(std::string_view name, const Value& value, const Args& args);
  Value Arith(BinOp op, const Value& a, const Value& b);
  Value CallMethod(const Value& self, const std::string& name, const Args& args);
  // The Python attribute `name` of `obj` (a bound method, a namespace
  // attribute, a loop property; an unsafe Undefined for what the immutable
  // sandbox forbids), or nullopt when the object has none.
  std::optional<Value> PyAttr(const Value& obj, std::string_view name);
  bool Contains(const Value& container, const Value& item);
  // jinja2's make_attrgetter: "a.b.0" looked up with getitem.
  Value AttrPath(const Value& item, const Value& attribute);
  void TrackMutable(const std::shared_ptr<Object>& obj) { mutables_.push_back(obj); }
  std::optional<int64_t> now_unix_seconds() const { return now_; }
  const RenderLimits& limits() const { return limits_; }
  int line() const { return line_; }
  int64_t steps() const { return steps_ + tl_work; }

  [[noreturn]] static void ThrowUndefined(const Value& undefined);

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  struct DepthGuard {
    explicit DepthGuard(Interp* in) : in(in) {
      if (++in->eval_depth_ > in->max_eval_depth_) in->DepthLimit();
    }
    ~DepthGuard() { --in->eval_depth_; }
    Interp* in;
  };

  [[noreturn]] void DepthLimit();

  Flow ExecBody(const Body& body, Scope* scope);
  Flow Exec(const Stmt& stmt, Scope* scope);
  Flow ExecFor(const Stmt& stmt, Scope* scope);
  TrackedText Capture(const Body& body, Scope* scope);
  void Assign(const Target& target, const Value& value, Scope* scope);
  std::unique_ptr<Scope> NewScope(Scope* parent);
  void ReleaseScope(std::unique_ptr<Scope> scope);

  Value Eval(const Expr& e, Scope* scope);
  Value EvalFilter(const Expr& e, Scope* scope, const Value* block_subject);
  Value EvalSlice(const Value& obj, const Expr& slice, Scope* scope);
  Args EvalArgs(const CallArgs& call, Scope* scope);
  bool CompareOp(CmpOp op, const Value& a, const Value& b);
  Value CallMacro(const CallableObj& macro, const Args& args);
  Value CallGlobal(const std::string& name, const Args& args);

  // Writes `s` to the output; `own` are its bytes that are the template's own.
  void Out(std::string_view s, std::span<const ByteRange> own = {});
  // Writes str(v): a str with its own ranges, anything else with none.
  void Print(const Value& v);

  RenderLimits limits_;
  std::optional<int64_t> now_;
  std::vector<std::pair<std::string, Value>> variables_;
  int64_t steps_ = 0;
  int eval_depth_ = 0;
  int max_eval_depth_;
  int call_depth_ = 0;
  int line_ = 0;             // of the node being evaluated
  bool const_mode_ = false;  // evaluating a constant expression as jinja2 folds it
  TrackedText* out_ = nullptr;
  // Scopes macros close over, kept to the end of the render.
  std::vector<std::unique_ptr<Scope>> pinned_;
  // Namespaces, cyclers and loops: the mutable objects (a cycle of
  // references runs through one of them), emptied at the end.
  std::vector<std::shared_ptr<Object>> mutables_;
};

// jinja2's constant folding, done once after parsing (jinja_interp.cc).
void FoldConstants(Template* tmpl);
// Whether jinja2 can evaluate `e` when it compiles the template (its
// as_const), from its children's is_const (jinja_parser.cc).
bool ComputeIsConst(const Expr& e);

// Python's `format % args` (str.__mod__).
std::string PercentFormat(Interp* in, std::string_view format, const Value& args);
// markupsafe.escape() of a str.
std::string HtmlEscape(std::string_view s);

}  // namespace coalesce::chat::jinja
