// The evaluator: statements, expressions, scopes, attribute and item access
// as jinja2's sandbox does them, operators with Python's semantics, and the
// limits that bound a hostile template.
#include "chat/jinja_interp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <optional>
#include <stdexcept>

#include "absl/status/status.h"
#include "chat/jinja_unicode.h"

namespace coalesce::chat::jinja {
namespace {

[[noreturn]] void Overflow() {
  ThrowRuntime("OverflowError", "integer result out of the 64-bit range of chat templates");
}

const char* OpSymbol(BinOp op) {
  switch (op) {
    case BinOp::kAdd:
      return "+";
    case BinOp::kSub:
      return "-";
    case BinOp::kMul:
      return "*";
    case BinOp::kDiv:
      return "/";
    case BinOp::kFloorDiv:
      return "//";
    case BinOp::kMod:
      return "%";
    case BinOp::kPow:
      return "** or pow()";
  }
  return "?";
}

// Python's float divmod.
void FloatDivmod(double a, double b, double* div, double* mod) {
  double m = std::fmod(a, b);
  double d = (a - m) / b;
  if (m != 0) {
    if ((b < 0) != (m < 0)) {
      m += b;
      d -= 1.0;
    }
  } else {
    m = std::copysign(0.0, b);
  }
  double floordiv;
  if (d != 0) {
    floordiv = std::floor(d);
    if (d - floordiv > 0.5) floordiv += 1.0;
  } else {
    floordiv = std::copysign(0.0, a / b);
  }
  *div = floordiv;
  *mod = m;
}

int64_t IntPow(int64_t base, int64_t exp) {
  int64_t result = 1;
  while (exp > 0) {
    if (exp & 1) {
      if (__builtin_mul_overflow(result, base, &result)) Overflow();
    }
    exp >>= 1;
    if (exp > 0 && __builtin_mul_overflow(base, base, &base)) Overflow();
  }
  return result;
}

}  // namespace

Bound::Bound(std::string_view func, const Args& args, std::vector<std::string_view> names)
    : values_(names.size(), nullptr) {
  if (args.pos.size() > names.size()) {
    ThrowTypeError(Cat(func, "() takes at most ", names.size(), " argument",
                       names.size() == 1 ? "" : "s", " (", args.pos.size(), " given)"));
  }
  for (size_t i = 0; i < args.pos.size(); ++i) values_[i] = &args.pos[i];
  for (const auto& [k, v] : args.kw) {
    const auto it = std::find(names.begin(), names.end(), k);
    if (it == names.end()) {
      ThrowTypeError(Cat(func, "() got an unexpected keyword argument ", ReprString(k)));
    }
    const size_t j = static_cast<size_t>(it - names.begin());
    if (values_[j] != nullptr) {
      ThrowTypeError(Cat(func, "() got multiple values for argument ", ReprString(k)));
    }
    values_[j] = &v;
  }
}

Interp::Interp(const RenderEnv& env)
    : limits_(env.limits),
      now_(env.now_unix_seconds),
      variables_(env.variables),
      max_eval_depth_(std::max(16, 16 * env.limits.max_depth)) {
  tl_work = 0;
}

Interp::~Interp() {
  // Break the reference cycles that can only run through mutable objects.
  for (const auto& obj : mutables_) {
    if (auto* ns = dynamic_cast<NamespaceObj*>(obj.get())) ns->attrs.clear();
    if (auto* cycler = dynamic_cast<CyclerObj*>(obj.get())) cycler->items.clear();
    if (auto* loop = dynamic_cast<LoopObj*>(obj.get())) {
      loop->items.clear();
      loop->last_changed = Value();
    }
  }
}

void Interp::StepLimit() {
  ThrowLimit(Cat("max_steps exceeded: the template took more than ", limits_.max_steps,
                 " steps (nodes evaluated, loop iterations, work in filters)"));
}

void Interp::DepthLimit() {
  ThrowLimit(
      Cat("max_depth exceeded: macro calls, statements and expressions nest "
          "deeper than ",
          max_eval_depth_, " levels (16 x max_depth)"));
}

void Interp::ThrowUndefined(const Value& undefined) {
  std::string hint = undefined.undefined_hint();
  if (hint.empty()) hint = "value is undefined";
  ThrowRuntime(undefined.undefined_unsafe() ? "SecurityError" : "UndefinedError", hint);
}

void Interp::NotConstant() { throw Error{Error::Kind::kRuntime, "not a constant expression"}; }

void Interp::StringLimit() {
  ThrowLimit(Cat("max_output_bytes exceeded: the template built a string of more than ",
                 limits_.max_output_bytes, " bytes"));
}

Value Interp::MakeStr(std::string s, bool safe) {
  if (s.size() > limits_.max_output_bytes) StringLimit();
  Charge(static_cast<int64_t>(s.size() / 16));
  return Value::Str(std::move(s), safe);
}

Value Interp::MakeStr(TrackedText t) {
  if (t.text.size() > limits_.max_output_bytes) StringLimit();
  Charge(static_cast<int64_t>(t.text.size() / 16));
  return Value::Str(std::move(t.text), false, std::move(t.own));
}

Value Interp::Substr(const Value& of, size_t begin, std::string piece) {
  // A piece that is not where it is said to be (text that was not valid
  // UTF-8 and came back changed) has none of the template's own text.
  if (of.str().compare(begin, piece.size(), piece) != 0)
    return MakeStr(std::move(piece), of.safe());
  std::vector<ByteRange> own = OwnWithin(of.own(), begin, begin + piece.size());
  Charge(static_cast<int64_t>(piece.size() / 16));
  return Value::Str(std::move(piece), of.safe(), std::move(own));
}

Value Interp::MakeSeq(SeqKind kind, std::vector<Value> items) {
  Charge(static_cast<int64_t>(items.size()));
  return Value::Seq(kind, std::move(items));
}

void Interp::Out(std::string_view s, std::span<const ByteRange> own) {
  out_->Append(s, own);
  Charge(static_cast<int64_t>(s.size() / 32));
  if (out_->text.size() > limits_.max_output_bytes) {
    ThrowLimit(Cat("max_output_bytes exceeded: the output is longer than ",
                   limits_.max_output_bytes, " bytes"));
  }
}

void Interp::Print(const Value& v) {
  if (v.is_string()) {
    Out(v.str(), v.own());
    return;
  }
  std::string text;
  AppendStr(&text, v);
  Out(text);
}

std::unique_ptr<Scope> Interp::NewScope(Scope* parent) {
  auto scope = std::make_unique<Scope>();
  scope->parent = parent;
  return scope;
}

void Interp::ReleaseScope(std::unique_ptr<Scope> scope) {
  if (scope->pinned) pinned_.push_back(std::move(scope));
}

// ---------------------------------------------------------------------------
// Statements

TrackedText Interp::Render(const Template& tmpl) {
  Scope globals;
  for (const char* name : {"range", "dict", "lipsum", "cycler", "joiner", "namespace",
                           "raise_exception", "strftime_now"}) {
    auto fn = std::make_shared<CallableObj>();
    fn->kind = CallableObj::Kind::kGlobal;
    fn->name = name;
    globals.vars.emplace_back(name, Value::Object(Type::kCallable, std::move(fn)));
  }
  Scope vars;
  vars.parent = &globals;
  for (const auto& [name, value] : variables_) vars.Set(name, value);
  Scope root;
  root.parent = &vars;
  TrackedText out;
  out_ = &out;
  ExecBody(tmpl.body, &root);
  return out;
}

Interp::Flow Interp::ExecBody(const Body& body, Scope* scope) {
  DepthGuard guard(this);
  for (const auto& stmt : body) {
    const Flow flow = Exec(*stmt, scope);
    if (flow != Flow::kNormal) return flow;
  }
  return Flow::kNormal;
}

TrackedText Interp::Capture(const Body& body, Scope* scope) {
  TrackedText buffer;
  TrackedText* saved = out_;
  out_ = &buffer;
  try {
    ExecBody(body, scope);
  } catch (...) {
    out_ = saved;
    throw;
  }
  out_ = saved;
  return buffer;
}

Interp::Flow Interp::Exec(const Stmt& s, Scope* scope) {
  Step();
  line_ = s.line;
  switch (s.kind) {
    case StmtKind::kData: {
      const ByteRange all{0, s.text.size()};
      Out(s.text, std::span<const ByteRange>(&all, 1));
      return Flow::kNormal;
    }
    case StmtKind::kPrint:
      Print(Eval(*s.expr, scope));
      return Flow::kNormal;
    case StmtKind::kIf:
      for (const auto& [test, body] : s.branches) {
        if (test == nullptr || Truthy(Eval(*test, scope))) return ExecBody(body, scope);
      }
      return Flow::kNormal;
    case StmtKind::kFor:
      return ExecFor(s, scope);
    case StmtKind::kSet:
      Assign(s.target, Eval(*s.expr, scope), scope);
      return Flow::kNormal;
    case StmtKind::kSetBlock: {
      auto inner = NewScope(scope);
      TrackedText text = Capture(s.body, inner.get());
      ReleaseScope(std::move(inner));
      Value v = MakeStr(std::move(text));
      if (s.expr != nullptr) v = EvalFilter(*s.expr, scope, &v);
      Assign(s.target, v, scope);
      return Flow::kNormal;
    }
    case StmtKind::kMacro: {
      auto fn = std::make_shared<CallableObj>();
      fn->kind = CallableObj::Kind::kMacro;
      fn->name = s.macro->name;
      fn->macro = s.macro.get();
      fn->closure = scope;
      scope->pinned = true;
      scope->Set(s.macro->name, Value::Object(Type::kCallable, std::move(fn)));
      return Flow::kNormal;
    }
    case StmtKind::kBreak:
      return Flow::kBreak;
    case StmtKind::kContinue:
      return Flow::kContinue;
    case StmtKind::kWith: {
      auto inner = NewScope(scope);
      for (size_t i = 0; i < s.with_targets.size(); ++i) {
        Assign(s.with_targets[i], Eval(*s.with_values[i], scope), inner.get());
      }
      const Flow flow = ExecBody(s.body, inner.get());
      ReleaseScope(std::move(inner));
      return flow;
    }
    case StmtKind::kFilterBlock: {
      auto inner = NewScope(scope);
      Value text = MakeStr(Capture(s.body, inner.get()));
      ReleaseScope(std::move(inner));
      Print(EvalFilter(*s.expr, scope, &text));
      return Flow::kNormal;
    }
    case StmtKind::kScope: {
      auto inner = NewScope(scope);
      const Flow flow = ExecBody(s.body, inner.get());
      ReleaseScope(std::move(inner));
      return flow;
    }
  }
  return Flow::kNormal;
}

Interp::Flow Interp::ExecFor(const Stmt& s, Scope* scope) {
  const Value iterable = Eval(*s.expr, scope);
  // A generator that fails part way fails when the loop gets there.
  std::shared_ptr<const Error> deferred;
  std::vector<Value> items;
  if (iterable.is_seq() && iterable.seq().deferred != nullptr) {
    deferred = iterable.seq().deferred;
    items = iterable.seq().items;
  } else {
    items = Iterate(iterable);
  }
  // jinja2 runs the else block unless an iteration reached the end of the
  // body (so also after a break, or when every iteration ended in continue).
  auto run_else = [&]() {
    if (s.else_body.empty()) return;
    auto inner = NewScope(scope);
    ExecBody(s.else_body, inner.get());
    ReleaseScope(std::move(inner));
  };
  auto loop = std::make_shared<LoopObj>();
  loop->pending = std::move(items);
  loop->deferred = std::move(deferred);
  if (s.cond != nullptr) {
    loop->accept = [this, &s, scope](const Value& item) {
      Step();
      auto tmp = NewScope(scope);
      Assign(s.target, item, tmp.get());
      const bool keep = Truthy(Eval(*s.cond, tmp.get()));
      ReleaseScope(std::move(tmp));
      return keep;
    };
  }
  mutables_.push_back(loop);
  // Once the loop is over its condition cannot run (its scope is gone):
  // what was not examined is dropped.
  struct Finish {
    ~Finish() {
      loop->accept = nullptr;
      loop->deferred = nullptr;
      loop->pending.clear();
      loop->has_changed = false;
      loop->last_changed = Value();
    }
    LoopObj* loop;
  } finish{loop.get()};
  const Value loop_value = Value::Object(Type::kLoop, loop);
  bool completed = false;
  for (size_t i = 0; loop->Fill(i); ++i) {
    Step();
    loop->index0 = static_cast<int64_t>(i);
    auto iter = NewScope(scope);
    iter->vars.reserve(2);
    Assign(s.target, loop->items[i], iter.get());
    iter->Set("loop", loop_value);
    const Flow flow = ExecBody(s.body, iter.get());
    ReleaseScope(std::move(iter));
    if (flow == Flow::kNormal) completed = true;
    if (flow == Flow::kBreak) break;
  }
  if (!completed) run_else();
  return Flow::kNormal;
}

void Interp::Assign(const Target& target, const Value& value, Scope* scope) {
  switch (target.kind) {
    case Target::Kind::kName:
      scope->Set(target.name, value);
      return;
    case Target::Kind::kNsAttr: {
      const Value* ns = scope->Find(target.name);
      if (ns == nullptr || ns->type() != Type::kNamespace) {
        ThrowRuntime("TemplateRuntimeError", "cannot assign attribute on non-namespace object");
      }
      ns->ns().Set(target.attr, value);
      return;
    }
    case Target::Kind::kTuple: {
      const std::vector<Value> items = Iterate(value);
      const size_t want = target.items.size();
      if (items.size() > want) {
        ThrowRuntime("ValueError", Cat("too many values to unpack (expected ", want, ")"));
      }
      if (items.size() < want) {
        ThrowRuntime("ValueError", Cat("not enough values to unpack (expected ", want, ", got ",
                                       items.size(), ")"));
      }
      for (size_t i = 0; i < want; ++i) Assign(target.items[i], items[i], scope);
      return;
    }
  }
}

// ---------------------------------------------------------------------------
// Expressions

Args Interp::EvalArgs(const CallArgs& call, Scope* scope) {
  Args args;
  args.pos.reserve(call.args.size());
  for (const auto& a : call.args) args.pos.push_back(Eval(*a, scope));
  if (call.dyn_args != nullptr) {
    for (Value& v : Iterate(Eval(*call.dyn_args, scope))) args.pos.push_back(std::move(v));
  }
  for (const auto& [k, a] : call.kwargs) args.kw.emplace_back(k, Eval(*a, scope));
  if (call.dyn_kwargs != nullptr) {
    const Value d = Eval(*call.dyn_kwargs, scope);
    if (!d.is_dict()) {
      ThrowTypeError(Cat("argument after ** must be a mapping, not ", PyTypeName(d)));
    }
    for (const auto& [k, v] : d.dict().entries) {
      if (!k.is_string()) ThrowTypeError("keywords must be strings");
      args.kw.emplace_back(k.str(), v);
    }
  }
  return args;
}

Value Interp::EvalFilter(const Expr& e, Scope* scope, const Value* block_subject) {
  const Value subject = e.operands[0] == nullptr
                            ? *block_subject
                            : (e.operands[0]->kind == ExprKind::kFilter
                                   ? EvalFilter(*e.operands[0], scope, block_subject)
                                   : Eval(*e.operands[0], scope));
  const Args args = EvalArgs(e.call, scope);
  line_ = e.line;
  return ApplyFilter(e.name, subject, args);
}

Value Interp::Eval(const Expr& e, Scope* scope) {
  DepthGuard guard(this);
  Step();
  line_ = e.line;
  switch (e.kind) {
    case ExprKind::kConst:
      return e.value;
    case ExprKind::kName: {
      if (const_mode_) NotConstant();
      const Value* v = scope->Find(e.name);
      if (v != nullptr) return *v;
      return Value::Undefined(Cat(ReprString(e.name), " is undefined"));
    }
    case ExprKind::kGetattr: {
      const Value obj = Eval(*e.operands[0], scope);
      line_ = e.line;
      return GetAttr(obj, e.name);
    }
    case ExprKind::kGetitem: {
      const Value obj = Eval(*e.operands[0], scope);
      if (e.operands[1]->kind == ExprKind::kSlice) return EvalSlice(obj, *e.operands[1], scope);
      const Value key = Eval(*e.operands[1], scope);
      line_ = e.line;
      return GetItem(obj, key);
    }
    case ExprKind::kSlice:
      ThrowRuntime("TemplateRuntimeError", "a slice outside of []");
    case ExprKind::kList:
    case ExprKind::kTuple: {
      std::vector<Value> items;
      items.reserve(e.operands.size());
      for (const auto& o : e.operands) items.push_back(Eval(*o, scope));
      return MakeSeq(e.kind == ExprKind::kList ? SeqKind::kList : SeqKind::kTuple,
                     std::move(items));
    }
    case ExprKind::kDict: {
      auto dict = std::make_shared<DictObj>();
      for (size_t i = 0; i + 1 < e.operands.size(); i += 2) {
        Value k = Eval(*e.operands[i], scope);
        Value v = Eval(*e.operands[i + 1], scope);
        dict->Set(std::move(k), std::move(v));
      }
      return Value::Dict(std::move(dict));
    }
    case ExprKind::kNeg:
    case ExprKind::kPos: {
      const Value v = Eval(*e.operands[0], scope);
      if (v.is_undefined()) ThrowUndefined(v);
      const bool neg = e.kind == ExprKind::kNeg;
      if (v.is_intlike()) {
        if (!neg) return Value::Int(v.int_value());
        if (v.int_value() == std::numeric_limits<int64_t>::min()) Overflow();
        return Value::Int(-v.int_value());
      }
      if (v.type() == Type::kFloat) return Value::Float(neg ? -v.float_value() : v.float_value());
      ThrowTypeError(
          Cat("bad operand type for unary ", neg ? "-" : "+", ": '", PyTypeName(v), "'"));
    }
    case ExprKind::kNot:
      return Value::Bool(!Truthy(Eval(*e.operands[0], scope)));
    case ExprKind::kBinary: {
      const Value a = Eval(*e.operands[0], scope);
      const Value b = Eval(*e.operands[1], scope);
      line_ = e.line;
      return Arith(e.bin_op, a, b);
    }
    case ExprKind::kAnd: {
      Value a = Eval(*e.operands[0], scope);
      if (!Truthy(a)) return a;
      return Eval(*e.operands[1], scope);
    }
    case ExprKind::kOr: {
      Value a = Eval(*e.operands[0], scope);
      if (Truthy(a)) return a;
      return Eval(*e.operands[1], scope);
    }
    case ExprKind::kCompare: {
      Value left = Eval(*e.operands[0], scope);
      for (size_t i = 0; i < e.cmp_ops.size(); ++i) {
        Value right = Eval(*e.operands[i + 1], scope);
        line_ = e.line;
        if (!CompareOp(e.cmp_ops[i], left, right)) return Value::Bool(false);
        left = std::move(right);
      }
      return Value::Bool(true);
    }
    case ExprKind::kConcat: {
      TrackedText s;
      for (const auto& o : e.operands) {
        const Value v = Eval(*o, scope);
        if (v.is_string()) {
          s.AppendStr(v);
        } else {
          std::string printed;
          AppendStr(&printed, v);
          s.Append(printed);
        }
        if (s.text.size() > limits_.max_output_bytes) StringLimit();
      }
      return MakeStr(std::move(s));
    }
    case ExprKind::kCondExpr: {
      if (Truthy(Eval(*e.operands[1], scope))) return Eval(*e.operands[0], scope);
      if (e.operands[2] != nullptr) return Eval(*e.operands[2], scope);
      return Value::Undefined(Cat("the inline if-expression on line ", e.line,
                                  " evaluated to false and no else section was defined."));
    }
    case ExprKind::kCall: {
      if (const_mode_) NotConstant();
      const Value callee = Eval(*e.operands[0], scope);
      const Args args = EvalArgs(e.call, scope);
      line_ = e.line;
      return Call(callee, args);
    }
    case ExprKind::kFilter:
      return EvalFilter(e, scope, nullptr);
    case ExprKind::kTest: {
      const Value subject = Eval(*e.operands[0], scope);
      const Args args = EvalArgs(e.call, scope);
      line_ = e.line;
      return Value::Bool(ApplyTest(e.name, subject, args));
    }
  }
  return Value();
}

namespace {

// Python's slice.indices(len): the normalized start, stop and step.
void SliceBounds(int64_t len, const Value& start_v, const Value& stop_v, const Value& step_v,
                 int64_t* start, int64_t* stop, int64_t* step) {
  *step = step_v.is_none() ? 1 : step_v.int_value();
  if (*step == 0) ThrowRuntime("ValueError", "slice step cannot be zero");
  const int64_t lower = *step < 0 ? -1 : 0;
  const int64_t upper = *step < 0 ? len - 1 : len;
  auto adjust = [&](const Value& v, int64_t dflt) {
    if (v.is_none()) return dflt;
    int64_t x = v.int_value();
    if (x < 0) {
      x += len;
      if (x < lower) x = lower;
    } else if (x > upper) {
      x = upper;
    }
    return x;
  };
  *start = adjust(start_v, *step < 0 ? upper : lower);
  *stop = adjust(stop_v, *step < 0 ? lower : upper);
}

// The positions a slice selects.
std::vector<int64_t> SliceIndices(int64_t len, const Value& start_v, const Value& stop_v,
                                  const Value& step_v) {
  int64_t start, stop, step;
  SliceBounds(len, start_v, stop_v, step_v, &start, &stop, &step);
  std::vector<int64_t> out;
  if (step > 0) {
    for (int64_t i = start; i < stop; i += step) out.push_back(i);
  } else {
    for (int64_t i = start; i > stop; i += step) out.push_back(i);
  }
  return out;
}

}  // namespace

Value Interp::EvalSlice(const Value& obj, const Expr& slice, Scope* scope) {
  // jinja2 slices with Python's own subscript, not the sandbox's getitem:
  // errors are TypeErrors, not undefined values.
  Value bounds[3];
  for (int i = 0; i < 3; ++i) {
    bounds[i] = slice.operands[i] == nullptr ? Value::None() : Eval(*slice.operands[i], scope);
  }
  line_ = slice.line;
  if (obj.is_undefined()) ThrowUndefined(obj);
  const bool sliceable = obj.is_string() || (obj.is_seq() && (obj.seq_kind() == SeqKind::kList ||
                                                              obj.seq_kind() == SeqKind::kTuple ||
                                                              obj.seq_kind() == SeqKind::kRange));
  if (const_mode_) {
    // The sandbox's getitem: a failed subscript is an undefined value.
    const bool bounds_ok = std::all_of(std::begin(bounds), std::end(bounds), [](const Value& b) {
      return b.is_none() || b.is_intlike();
    });
    if (!sliceable || !bounds_ok) {
      return Value::Undefined(Cat(ObjectTypeRepr(obj), " has no element slice(", Repr(bounds[0]),
                                  ", ", Repr(bounds[1]), ", ", Repr(bounds[2]), ")"));
    }
  }
  if (obj.is_dict()) ThrowTypeError("unhashable type: 'slice'");
  if (!sliceable) ThrowTypeError(Cat("'", PyTypeName(obj), "' object is not subscriptable"));
  for (const Value& b : bounds) {
    if (!b.is_none() && !b.is_intlike()) {
      ThrowTypeError("slice indices must be integers or None or have an __index__ method");
    }
  }
  if (obj.is_string()) {
    const std::u32string cps = DecodeUtf8(obj.str());
    const auto idx =
        SliceIndices(static_cast<int64_t>(cps.size()), bounds[0], bounds[1], bounds[2]);
    std::u32string out;
    out.reserve(idx.size());
    for (int64_t i : idx) out.push_back(cps[static_cast<size_t>(i)]);
    Charge(static_cast<int64_t>(cps.size()));
    return MakeStr(EncodeUtf8(out), obj.safe());
  }
  const auto& items = obj.seq().items;
  const auto idx =
      SliceIndices(static_cast<int64_t>(items.size()), bounds[0], bounds[1], bounds[2]);
  std::vector<Value> out;
  out.reserve(idx.size());
  for (int64_t i : idx) out.push_back(items[static_cast<size_t>(i)]);
  if (obj.seq_kind() == SeqKind::kRange) {
    // A slice of a range is a range.
    const SeqObj& r = obj.seq();
    int64_t start, stop, step;
    SliceBounds(static_cast<int64_t>(items.size()), bounds[0], bounds[1], bounds[2], &start, &stop,
                &step);
    Charge(static_cast<int64_t>(out.size()));
    return Value::Range(r.start + start * r.step, r.start + stop * r.step, r.step * step,
                        std::move(out));
  }
  return MakeSeq(obj.seq_kind() == SeqKind::kTuple ? SeqKind::kTuple : SeqKind::kList,
                 std::move(out));
}

bool Interp::CompareOp(CmpOp op, const Value& a, const Value& b) {
  switch (op) {
    case CmpOp::kEq:
      return Equal(a, b);
    case CmpOp::kNe:
      return !Equal(a, b);
    case CmpOp::kLt:
      return Compare(a, b, "<");
    case CmpOp::kLe:
      return Compare(a, b, "<=");
    case CmpOp::kGt:
      return Compare(a, b, ">");
    case CmpOp::kGe:
      return Compare(a, b, ">=");
    case CmpOp::kIn:
      return Contains(b, a);
    case CmpOp::kNotIn:
      return !Contains(b, a);
  }
  return false;
}

bool Interp::Contains(const Value& container, const Value& item) {
  switch (container.type()) {
    case Type::kUndefined:
      return false;  // iterates as nothing
    case Type::kString:
      if (!item.is_string()) {
        ThrowTypeError(
            Cat("'in <string>' requires string as left operand, not ", PyTypeName(item)));
      }
      Charge(static_cast<int64_t>(container.str().size() / 16));
      return container.str().find(item.str()) != std::string::npos;
    case Type::kSeq:
      for (const Value& v : container.seq().items) {
        if (Equal(v, item)) return true;
      }
      if (container.seq().deferred != nullptr) throw *container.seq().deferred;
      return false;
    case Type::kDict:
      return container.dict().Find(item) != nullptr;
    default:
      ThrowTypeError(Cat("argument of type '", PyTypeName(container), "' is not iterable"));
  }
}

Value Interp::Arith(BinOp op, const Value& a, const Value& b) {
  // str % x is str.__mod__ whatever x is (an Undefined is one argument).
  if (a.is_string() && op == BinOp::kMod) return MakeStr(PercentFormat(this, a.str(), b), a.safe());
  if (a.is_undefined()) ThrowUndefined(a);
  if (b.is_undefined()) ThrowUndefined(b);
  auto unsupported = [&]() {
    ThrowTypeError(Cat("unsupported operand type(s) for ", OpSymbol(op), ": '", PyTypeName(a),
                       "' and '", PyTypeName(b), "'"));
  };
  if (a.is_number() && b.is_number()) {
    const bool ints = a.is_intlike() && b.is_intlike();
    const int64_t x = a.int_value(), y = b.int_value();
    const double fx = a.float_value(), fy = b.float_value();
    int64_t r;
    switch (op) {
      case BinOp::kAdd:
        if (!ints) return Value::Float(fx + fy);
        if (__builtin_add_overflow(x, y, &r)) Overflow();
        return Value::Int(r);
      case BinOp::kSub:
        if (!ints) return Value::Float(fx - fy);
        if (__builtin_sub_overflow(x, y, &r)) Overflow();
        return Value::Int(r);
      case BinOp::kMul:
        if (!ints) return Value::Float(fx * fy);
        if (__builtin_mul_overflow(x, y, &r)) Overflow();
        return Value::Int(r);
      case BinOp::kDiv:
        if (fy == 0)
          ThrowRuntime("ZeroDivisionError", ints ? "division by zero" : "float division by zero");
        return Value::Float(fx / fy);
      case BinOp::kFloorDiv:
      case BinOp::kMod: {
        const bool div = op == BinOp::kFloorDiv;
        if (ints) {
          if (y == 0) {
            ThrowRuntime("ZeroDivisionError",
                         div ? "integer division or modulo by zero" : "integer modulo by zero");
          }
          if (x == std::numeric_limits<int64_t>::min() && y == -1) {
            if (div) Overflow();
            return Value::Int(0);
          }
          int64_t q = x / y, m = x % y;
          if (m != 0 && ((m < 0) != (y < 0))) {
            m += y;
            --q;
          }
          return Value::Int(div ? q : m);
        }
        if (fy == 0) {
          ThrowRuntime("ZeroDivisionError", div ? "float floor division by zero" : "float modulo");
        }
        double q, m;
        FloatDivmod(fx, fy, &q, &m);
        return Value::Float(div ? q : m);
      }
      case BinOp::kPow:
        if (ints && y >= 0) return Value::Int(IntPow(x, y));
        if (fx == 0 && fy < 0) {
          ThrowRuntime("ZeroDivisionError", "0.0 cannot be raised to a negative power");
        }
        if (fx < 0 && fy != std::floor(fy)) {
          ThrowRuntime("ValueError", "complex results are not supported in chat templates");
        }
        {
          const double p = std::pow(fx, fy);
          if (std::isinf(p) && std::isfinite(fx) && std::isfinite(fy)) {
            ThrowRuntime("OverflowError", "(34, 'Numerical result out of range')");
          }
          return Value::Float(p);
        }
    }
  }
  if (a.is_string() && b.is_string()) {
    if (op == BinOp::kAdd) {
      if (a.str().size() + b.str().size() > limits_.max_output_bytes) StringLimit();
      if (a.safe() || b.safe()) {
        // markupsafe: Markup + str escapes the str.
        const std::string left = a.safe() ? a.str() : HtmlEscape(a.str());
        const std::string right = b.safe() ? b.str() : HtmlEscape(b.str());
        return MakeStr(left + right, true);
      }
      TrackedText s;
      s.text.reserve(a.str().size() + b.str().size());
      s.AppendStr(a);
      s.AppendStr(b);
      return MakeStr(std::move(s));
    }
    if (op == BinOp::kMod) return MakeStr(PercentFormat(this, a.str(), b), a.safe());
    unsupported();
  }
  if (a.is_string() && op == BinOp::kMod) return MakeStr(PercentFormat(this, a.str(), b), a.safe());
  if (op == BinOp::kMul &&
      ((a.is_string() && b.is_intlike()) || (a.is_intlike() && b.is_string()))) {
    const Value& s = a.is_string() ? a : b;
    const int64_t n = a.is_string() ? b.int_value() : a.int_value();
    if (n <= 0 || s.str().empty()) return MakeStr("", s.safe());
    if (static_cast<uint64_t>(n) > limits_.max_output_bytes / s.str().size()) StringLimit();
    std::string out;
    out.reserve(s.str().size() * static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out += s.str();
    return MakeStr(std::move(out), s.safe());
  }
  const auto is_list_or_tuple = [](const Value& v) {
    return v.is_seq() && (v.seq_kind() == SeqKind::kList || v.seq_kind() == SeqKind::kTuple);
  };
  if (op == BinOp::kAdd && is_list_or_tuple(a)) {
    if (!b.is_seq() || b.seq_kind() != a.seq_kind()) {
      ThrowTypeError(Cat("can only concatenate ", PyTypeName(a), " (not \"", PyTypeName(b),
                         "\") to ", PyTypeName(a)));
    }
    std::vector<Value> items = a.seq().items;
    items.insert(items.end(), b.seq().items.begin(), b.seq().items.end());
    return MakeSeq(a.seq_kind(), std::move(items));
  }
  if (op == BinOp::kMul &&
      ((is_list_or_tuple(a) && b.is_intlike()) || (a.is_intlike() && is_list_or_tuple(b)))) {
    const Value& s = a.is_seq() ? a : b;
    const int64_t n = a.is_seq() ? b.int_value() : a.int_value();
    const auto& items = s.seq().items;
    if (n <= 0 || items.empty()) return MakeSeq(s.seq_kind(), {});
    if (static_cast<uint64_t>(n) > static_cast<uint64_t>(limits_.max_steps) / items.size())
      StepLimit();
    Charge(static_cast<int64_t>(items.size()) * n);
    std::vector<Value> out;
    out.reserve(items.size() * static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out.insert(out.end(), items.begin(), items.end());
    return Value::Seq(s.seq_kind(), std::move(out));
  }
  if (op == BinOp::kAdd && a.is_string()) {
    ThrowTypeError(Cat("can only concatenate str (not \"", PyTypeName(b), "\") to str"));
  }
  unsupported();
  return Value();
}

// ---------------------------------------------------------------------------
// Attributes, items, calls

Value Interp::GetAttr(const Value& obj, std::string_view name) {
  if (obj.is_undefined()) ThrowUndefined(obj);
  if (auto attr = PyAttr(obj, name)) return *std::move(attr);
  if (obj.is_dict()) {
    if (const Value* v = obj.dict().FindStr(name)) return *v;
  }
  return Value::Undefined(
      Cat(ReprString(ObjectTypeRepr(obj)), " has no attribute ", ReprString(name)));
}

Value Interp::GetItem(const Value& obj, const Value& key) {
  if (obj.is_undefined()) ThrowUndefined(obj);
  switch (obj.type()) {
    case Type::kDict:
      if (IsHashable(key)) {
        if (const Value* v = obj.dict().Find(key)) return *v;
      }
      break;
    case Type::kSeq: {
      const SeqKind kind = obj.seq_kind();
      if ((kind == SeqKind::kList || kind == SeqKind::kTuple || kind == SeqKind::kRange) &&
          key.is_intlike()) {
        const auto& items = obj.seq().items;
        int64_t i = key.int_value();
        const auto n = static_cast<int64_t>(items.size());
        if (i < 0) i += n;
        if (i >= 0 && i < n) return items[static_cast<size_t>(i)];
      }
      break;
    }
    case Type::kString:
      if (key.is_intlike()) {
        const std::string& s = obj.str();
        int64_t i = key.int_value();
        if (IsAscii(s)) {
          const auto n = static_cast<int64_t>(s.size());
          if (i < 0) i += n;
          if (i >= 0 && i < n) return Value::Str(s.substr(static_cast<size_t>(i), 1), obj.safe());
        } else {
          const std::u32string cps = DecodeUtf8(s);
          Charge(static_cast<int64_t>(cps.size() / 16));
          const auto n = static_cast<int64_t>(cps.size());
          if (i < 0) i += n;
          if (i >= 0 && i < n) {
            std::string c;
            AppendUtf8(&c, cps[static_cast<size_t>(i)]);
            return Value::Str(std::move(c), obj.safe());
          }
        }
      }
      break;
    default:
      break;
  }
  if (key.is_string()) {
    if (auto attr = PyAttr(obj, key.str())) return *std::move(attr);
    return Value::Undefined(
        Cat(ReprString(ObjectTypeRepr(obj)), " has no attribute ", ReprString(key.str())));
  }
  return Value::Undefined(Cat(ObjectTypeRepr(obj), " has no element ", Repr(key)));
}

Value Interp::AttrPath(const Value& item, const Value& attribute) {
  if (attribute.is_none()) return item;
  if (!attribute.is_string()) return GetItem(item, attribute);
  Value v = item;
  std::string_view path = attribute.str();
  while (true) {
    const size_t dot = path.find('.');
    const std::string_view part = path.substr(0, dot);
    bool digits = !part.empty();
    for (char c : part) digits &= c >= '0' && c <= '9';
    if (digits && part.size() < 18) {
      v = GetItem(v, Value::Int(std::stoll(std::string(part))));
    } else {
      v = GetItem(v, Value::Str(std::string(part)));
    }
    if (dot == std::string_view::npos) return v;
    path = path.substr(dot + 1);
  }
}

Value Interp::Call(const Value& callee, const Args& args) {
  switch (callee.type()) {
    case Type::kUndefined:
      ThrowUndefined(callee);
    case Type::kCallable: {
      const auto& fn = callee.object<CallableObj>();
      switch (fn.kind) {
        case CallableObj::Kind::kMacro:
          return CallMacro(fn, args);
        case CallableObj::Kind::kGlobal:
          return CallGlobal(fn.name, args);
        case CallableObj::Kind::kMethod:
          return CallMethod(fn.self, fn.name, args);
      }
      break;
    }
    case Type::kJoiner: {
      Bound b("joiner", args, {});
      auto& joiner = callee.object<JoinerObj>();
      if (!joiner.used) {
        joiner.used = true;
        return Value::Str("");
      }
      return Value::Str(joiner.sep);
    }
    case Type::kLoop:
      ThrowTypeError("The loop must have the 'recursive' marker to be called recursively.");
    default:
      break;
  }
  ThrowTypeError(Cat("'", PyTypeName(callee), "' object is not callable"));
}

Value Interp::CallMacro(const CallableObj& fn, const Args& args) {
  const MacroStmt& m = *fn.macro;
  if (call_depth_ >= limits_.max_depth) {
    ThrowLimit(Cat("max_depth exceeded: macro calls nest deeper than ", limits_.max_depth));
  }
  const size_t n = m.params.size();
  if (args.pos.size() > n && !m.catch_varargs) {
    ThrowTypeError(Cat("macro ", ReprString(m.name), " takes not more than ", n, " argument(s)"));
  }
  auto local = NewScope(fn.closure);
  std::vector<const Value*> bound(n, nullptr);
  for (size_t i = 0; i < std::min(n, args.pos.size()); ++i) bound[i] = &args.pos[i];
  auto extra_kwargs = std::make_shared<DictObj>();
  for (const auto& [k, v] : args.kw) {
    const auto it = std::find(m.params.begin(), m.params.end(), k);
    if (it != m.params.end()) {
      const size_t j = static_cast<size_t>(it - m.params.begin());
      if (bound[j] != nullptr) {
        ThrowTypeError(
            Cat("macro ", ReprString(m.name), " got multiple values for argument ", ReprString(k)));
      }
      bound[j] = &v;
    } else if (m.catch_kwargs) {
      extra_kwargs->Set(Value::Str(k), v);
    } else {
      ThrowTypeError(
          Cat("macro ", ReprString(m.name), " takes no keyword argument ", ReprString(k)));
    }
  }
  const size_t first_default = n - m.defaults.size();
  for (size_t i = 0; i < n; ++i) {
    if (bound[i] != nullptr) {
      local->Set(m.params[i], *bound[i]);
    } else if (i >= first_default) {
      local->Set(m.params[i], Eval(*m.defaults[i - first_default], local.get()));
    } else {
      local->Set(m.params[i],
                 Value::Undefined(Cat("parameter ", ReprString(m.params[i]), " was not provided")));
    }
  }
  if (m.catch_varargs) {
    std::vector<Value> rest;
    for (size_t i = n; i < args.pos.size(); ++i) rest.push_back(args.pos[i]);
    local->Set("varargs", Value::Tuple(std::move(rest)));
  }
  if (m.catch_kwargs) local->Set("kwargs", Value::Dict(extra_kwargs));
  ++call_depth_;
  TrackedText text;
  try {
    text = Capture(m.body, local.get());
  } catch (...) {
    --call_depth_;
    ReleaseScope(std::move(local));
    throw;
  }
  --call_depth_;
  ReleaseScope(std::move(local));
  return MakeStr(std::move(text));
}

// ---------------------------------------------------------------------------

Value Interp::EvalConst(const Expr& e) {
  Scope empty;
  TrackedText out;
  out_ = &out;
  const_mode_ = true;
  return Eval(e, &empty);
}

absl::StatusOr<std::string> RenderTemplate(const Template& tmpl, const RenderEnv& env) {
  absl::StatusOr<TrackedText> out = RenderTemplateTracked(tmpl, env);
  if (!out.ok()) return out.status();
  return std::move(out->text);
}

absl::StatusOr<TrackedText> RenderTemplateTracked(const Template& tmpl, const RenderEnv& env) {
  try {
    Interp interp(env);
    try {
      return interp.Render(tmpl);
    } catch (Error& e) {
      if (e.line == 0) e.line = interp.line();
      throw;
    }
  } catch (const Error& e) {
    switch (e.kind) {
      case Error::Kind::kRaised:
        return absl::InvalidArgumentError(e.message);
      case Error::Kind::kLimit:
        return absl::ResourceExhaustedError(Cat("chat template, line ", e.line, ": ", e.message));
      default:
        return absl::InvalidArgumentError(
            Cat("chat template error, line ", e.line, ": ", e.message));
    }
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("chat template: out of memory");
  } catch (const std::length_error&) {
    return absl::ResourceExhaustedError("chat template: out of memory");
  }
}

}  // namespace coalesce::chat::jinja
