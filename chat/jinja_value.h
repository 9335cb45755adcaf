// The values of the chat template interpreter: what Python objects a
// jinja2 template sees (None, bool, int, float, str, list, tuple, dict and
// jinja2's Undefined, Namespace, loop, Markup), with Python's semantics for
// str(), repr(), ==, <, truth and json.dumps.
//
// Values are immutable and cheap to copy (shared_ptr); only a namespace is
// mutable, as in jinja2. Internal to chat/: the interpreter signals
// errors with jinja::Error exceptions, which never leave the room (ParseTemplate
// and RenderTemplate, jinja.h, return them as a Status).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/byte_range.h"

namespace coalesce::chat::jinja {

// String concatenation that takes std::string_view (this Abseil's StrCat
// takes only absl::string_view).
namespace cat_internal {
inline void Put(std::string* out, std::string_view s) { out->append(s); }
inline void Put(std::string* out, const char* s) { out->append(s); }
inline void Put(std::string* out, const std::string& s) { out->append(s); }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                                           !std::is_same_v<T, char>,
                                       int> = 0>
void Put(std::string* out, T v) {
  out->append(std::to_string(v));
}
}  // namespace cat_internal
template <typename... A>
std::string Cat(const A&... a) {
  std::string out;
  (cat_internal::Put(&out, a), ...);
  return out;
}
template <typename... A>
void CatAppend(std::string* out, const A&... a) {
  (cat_internal::Put(out, a), ...);
}

// How deeply lists, dicts and namespaces may nest inside one another (also
// what keeps printing, comparing and destroying a value from recursing
// without bound).
inline constexpr int kMaxValueDepth = 200;

// An error raised while parsing or rendering. `line` 0 means "the line of the
// node being evaluated" (filled in by the interpreter).
struct Error {
  enum class Kind {
    kSyntax,   // the template does not parse
    kRuntime,  // a Python/jinja2 exception at render time (TypeError, ...)
    kRaised,   // raise_exception(message): `message` is the template's own text
    kLimit,    // a ChatTemplateLimits bound was exceeded
  };
  Kind kind;
  std::string message;
  int line = 0;
};

// Work done inside value operations (elements compared, printed, hashed,
// iterated), counted per thread so the interpreter can charge it to
// ChatTemplateLimits::max_steps.
inline thread_local int64_t tl_work = 0;
inline void CountWork(int64_t n) { tl_work += n; }

// Throws Error{kRuntime, "<py_type>: <message>"}.
[[noreturn]] void ThrowRuntime(std::string_view py_type, std::string_view message);
[[noreturn]] void ThrowTypeError(std::string_view message);
[[noreturn]] void ThrowLimit(std::string message);

class Object {
 public:
  virtual ~Object() = default;
};

enum class Type : uint8_t {
  kUndefined,
  kNone,
  kBool,
  kInt,
  kFloat,
  kString,
  kSeq,        // list, tuple and the other ordered sequences (SeqKind)
  kDict,       // dict (insertion ordered)
  kNamespace,  // jinja2's namespace(): mutable attributes
  kCallable,   // a macro, a global function or a bound method
  kLoop,       // a for loop's `loop`
  kCycler,     // cycler(...)
  kJoiner,     // joiner(...)
};

// What kind of Python object a kSeq value is: they iterate alike but print,
// index and compare differently.
enum class SeqKind : uint8_t {
  kList,
  kTuple,
  kGenerator,  // what map, select, items, ... return: no len(), no indexing
  kRange,      // range(...): prints as range(a, b)
  kKeys,       // dict.keys()
  kValues,     // dict.values()
  kItems,      // dict.items()
  kReversed,   // reversed(list)
};

class SeqObj;
class DictObj;
class NamespaceObj;

class Value {
 public:
  Value() : type_(Type::kUndefined), i_(0) {}

  // An undefined value; `hint` is the message of the error any use of it
  // raises ("'x' is undefined"); `unsafe` makes that a SecurityError.
  static Value Undefined(std::string hint = {}, bool unsafe = false);
  static Value None() { return Value(Type::kNone); }
  static Value Bool(bool b) {
    Value v(Type::kBool);
    v.i_ = b;
    return v;
  }
  static Value Int(int64_t i) {
    Value v(Type::kInt);
    v.i_ = i;
    return v;
  }
  static Value Float(double f) {
    Value v(Type::kFloat);
    v.f_ = f;
    return v;
  }
  // A str; `safe` marks markupsafe's Markup (the `safe` and `escape` filters).
  static Value Str(std::string s, bool safe = false);
  // A str of which the bytes `own` are the template's own text (see
  // TrackedText).
  static Value Str(std::string s, bool safe, std::vector<ByteRange> own);
  // A str the template wrote itself, all of it (a literal).
  static Value TemplateStr(std::string s);
  static Value Seq(SeqKind kind, std::vector<Value> items);
  // range(start, stop, step) and its items.
  static Value Range(int64_t start, int64_t stop, int64_t step, std::vector<Value> items);
  static Value List(std::vector<Value> items) { return Seq(SeqKind::kList, std::move(items)); }
  static Value Tuple(std::vector<Value> items) { return Seq(SeqKind::kTuple, std::move(items)); }
  static Value Dict(std::shared_ptr<DictObj> dict);
  static Value Object(Type type, std::shared_ptr<jinja::Object> object);

  Type type() const { return type_; }
  bool is_undefined() const { return type_ == Type::kUndefined; }
  bool is_none() const { return type_ == Type::kNone; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_bool() const { return type_ == Type::kBool; }
  // int or bool (a bool is an int in Python).
  bool is_intlike() const { return type_ == Type::kInt || type_ == Type::kBool; }
  bool is_number() const { return is_intlike() || type_ == Type::kFloat; }
  bool is_seq() const { return type_ == Type::kSeq; }
  bool is_dict() const { return type_ == Type::kDict; }

  bool bool_value() const { return i_ != 0; }
  int64_t int_value() const { return i_; }  // kInt or kBool
  double float_value() const {
    return type_ == Type::kFloat ? f_ : static_cast<double>(i_);
  }  // any number
  const std::string& str() const;
  // The bytes of str() that are the template's own text.
  std::span<const ByteRange> own() const;
  bool safe() const { return safe_; }
  const SeqObj& seq() const;
  // For the producer of a fresh sequence only (values are shared).
  SeqObj& seq_mutable() const;
  SeqKind seq_kind() const;
  const DictObj& dict() const;
  NamespaceObj& ns() const;
  const std::string& undefined_hint() const;
  bool undefined_unsafe() const;
  template <typename T>
  T& object() const {
    return *static_cast<T*>(obj_.get());
  }
  const jinja::Object* identity() const { return obj_.get(); }
  const std::shared_ptr<jinja::Object>& shared() const { return obj_; }

 private:
  explicit Value(Type t) : type_(t), i_(0) {}
  Type type_;
  bool safe_ = false;
  union {
    int64_t i_;
    double f_;
  };
  std::shared_ptr<jinja::Object> obj_;
};

class StrObj final : public Object {
 public:
  explicit StrObj(std::string s, std::vector<ByteRange> own = {})
      : s(std::move(s)), own(std::move(own)) {}
  std::string s;
  std::vector<ByteRange> own;  // see TrackedText
};

// Text and which of its bytes are the template's own: written by the
// template itself (its data, its string literals, constant expressions, and
// the strs its caller gives as such: ChatTemplate's bos_token, eos_token and
// roles), rather than taken from the other variables it renders (the
// messages' contents). A str carries its own ranges through
// what keeps bytes as they are (printing, concatenation, capturing a block or
// a macro's output, trimming); every other operation makes a str with none,
// so that a byte the template did not write is never counted as its own,
// whatever a filter did to it. `own` is sorted, disjoint, and never holds
// two adjacent ranges (they are merged).
struct TrackedText {
  std::string text;
  std::vector<ByteRange> own;

  // Appends `s`, of which the bytes `s_own` are the template's own.
  void Append(std::string_view s, std::span<const ByteRange> s_own = {});
  // Appends `s`, all of it the template's own.
  void AppendOwn(std::string_view s);
  // Appends str `v` with its own ranges.
  void AppendStr(const Value& v) { Append(v.str(), v.own()); }
};

// The own ranges of the bytes [begin, end) of a str whose own ranges are
// `own`, counted from `begin`.
std::vector<ByteRange> OwnWithin(std::span<const ByteRange> own, size_t begin, size_t end);

// `v` with every str inside it (through lists, tuples and dicts) wholly the
// template's own: what a constant expression evaluates to.
Value AllOwn(const Value& v);

class UndefObj final : public Object {
 public:
  std::string hint;
  bool unsafe = false;
};

class SeqObj final : public Object {
 public:
  SeqKind kind = SeqKind::kList;
  std::vector<Value> items;
  int64_t start = 0, stop = 0, step = 1;  // kRange
  int depth = 1;
  // A kGenerator whose producer failed after `items`: jinja2's generator
  // filters (map, select, items, ...) fail only when iterated that far.
  std::shared_ptr<const Error> deferred;
};

class DictObj final : public Object {
 public:
  std::vector<std::pair<Value, Value>> entries;
  int depth = 1;

  const Value* Find(const Value& key) const;
  const Value* FindStr(std::string_view key) const;
  // Python's d[key] = value: a new key goes last, an existing one keeps its
  // place (and its original key object: 1 stays 1 when 1.0 is assigned).
  void Set(Value key, Value value);
  size_t size() const { return entries.size(); }

 private:
  absl::flat_hash_map<std::string, size_t> str_index_;
};

class NamespaceObj final : public Object {
 public:
  std::vector<std::pair<std::string, Value>> attrs;
  const Value* Find(std::string_view name) const;
  void Set(const std::string& name, Value value);
};

struct MacroStmt;  // jinja_ast.h
struct Scope;      // jinja_interp.h

// A callable: a macro (with the scope it was defined in), one of the
// globals (range, namespace, raise_exception, ...) or a method bound to a
// value ('a'.upper, d.items, loop.cycle).
class CallableObj final : public Object {
 public:
  enum class Kind { kMacro, kGlobal, kMethod };
  Kind kind = Kind::kGlobal;
  std::string name;
  Value self;                        // kMethod
  const MacroStmt* macro = nullptr;  // kMacro
  Scope* closure = nullptr;          // kMacro
};

// A for loop's `loop`.
// A for loop's `loop`. As jinja2's LoopContext over a filtered loop (for x
// in xs if cond), the condition runs item by item as the loop advances (the
// body may change what it reads), and ahead of it only for what asks to look
// ahead: loop.last and loop.nextitem one item, loop.length (revindex,
// printing the loop) all of them.
class LoopObj final : public Object {
 public:
  std::vector<Value> items;    // accepted so far
  std::vector<Value> pending;  // what the loop iterates, not yet examined
  size_t pending_pos = 0;
  std::function<bool(const Value&)> accept;  // the `if`, while the loop runs
  std::shared_ptr<const Error> deferred;     // raised when `pending` runs out
  int64_t index0 = 0;
  bool has_changed = false;  // loop.changed() was called
  Value last_changed;

  // Examines items until items.size() > n or none are left; whether there
  // is an item n.
  bool Fill(size_t n) {
    while (items.size() <= n && pending_pos < pending.size()) {
      const Value& v = pending[pending_pos++];
      if (!accept || accept(v)) items.push_back(v);
    }
    if (items.size() <= n && deferred != nullptr) throw *deferred;
    return items.size() > n;
  }
  int64_t length() {
    Fill(static_cast<size_t>(-2));
    return static_cast<int64_t>(items.size());
  }
};

class CyclerObj final : public Object {
 public:
  std::vector<Value> items;
  size_t pos = 0;
};

class JoinerObj final : public Object {
 public:
  std::string sep;
  bool used = false;
};

// Python's name for the value's type ("int", "str", "NoneType", "list", ...).
std::string PyTypeName(const Value& v);
// What jinja2's undefined messages call an object: "dict object", "None".
std::string ObjectTypeRepr(const Value& v);

// str(v) (an Undefined prints as ""), appended.
void AppendStr(std::string* out, const Value& v, int depth = 0);
std::string ToStr(const Value& v);
// repr(v), appended.
void AppendRepr(std::string* out, const Value& v, int depth = 0);
std::string Repr(const Value& v);
// Python's repr() of a str.
std::string ReprString(std::string_view s);
// Python's repr() of a float ("1.0", "1e+16", "0.0001", "inf").
std::string FloatRepr(double x);

// bool(v).
bool Truthy(const Value& v);
// v1 == v2.
bool Equal(const Value& a, const Value& b, int depth = 0);
// a <op> b for op "<", "<=", ">" or ">="; a TypeError where Python has no
// ordering between the two (an UndefinedError for an Undefined).
bool Compare(const Value& a, const Value& b, std::string_view op, int depth = 0);
bool Less(const Value& a, const Value& b, int depth = 0);
// hash(v) consistent with Equal; a TypeError for unhashable values.
size_t Hash(const Value& v, int depth = 0);
bool IsHashable(const Value& v);

// json.dumps(v, ensure_ascii=..., indent=..., separators=..., sort_keys=...).
struct JsonOptions {
  bool ensure_ascii = false;
  bool has_indent = false;
  std::string indent;  // the indent unit when has_indent
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};
void AppendJson(std::string* out, const Value& v, const JsonOptions& options, int level = 0);

// The Python-visible items of an iterable (list(v)); TypeError for values
// that are not iterable. An Undefined iterates as nothing.
std::vector<Value> Iterate(const Value& v);

}  // namespace coalesce::chat::jinja
