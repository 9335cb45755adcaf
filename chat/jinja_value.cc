#include "chat/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <functional>

#include "chat/jinja_unicode.h"

namespace coalesce::chat::jinja {

void ThrowRuntime(std::string_view py_type, std::string_view message) {
  throw Error{Error::Kind::kRuntime, Cat(py_type, ": ", message)};
}

void ThrowTypeError(std::string_view message) { ThrowRuntime("TypeError", message); }

void ThrowLimit(std::string message) { throw Error{Error::Kind::kLimit, std::move(message)}; }

namespace {

void CheckDepth(int depth) {
  if (depth > kMaxValueDepth) {
    ThrowLimit(Cat("a value nests deeper than ", kMaxValueDepth, " levels (or contains itself)"));
  }
}

int ChildDepth(const Value& v) {
  if (v.is_seq()) return v.seq().depth;
  if (v.is_dict()) return v.dict().depth;
  return 0;
}

const std::string& EmptyString() {
  static const std::string* const empty = new std::string;
  return *empty;
}

}  // namespace

Value Value::Undefined(std::string hint, bool unsafe) {
  Value v(Type::kUndefined);
  if (!hint.empty() || unsafe) {
    auto obj = std::make_shared<UndefObj>();
    obj->hint = std::move(hint);
    obj->unsafe = unsafe;
    v.obj_ = std::move(obj);
  }
  return v;
}

Value Value::Str(std::string s, bool safe) {
  Value v(Type::kString);
  v.safe_ = safe;
  v.obj_ = std::make_shared<StrObj>(std::move(s));
  return v;
}

Value Value::Str(std::string s, bool safe, std::vector<ByteRange> own) {
  Value v(Type::kString);
  v.safe_ = safe;
  v.obj_ = std::make_shared<StrObj>(std::move(s), std::move(own));
  return v;
}

Value Value::TemplateStr(std::string s) {
  std::vector<ByteRange> own;
  if (!s.empty()) own.push_back({0, s.size()});
  return Str(std::move(s), false, std::move(own));
}

void TrackedText::Append(std::string_view s, std::span<const ByteRange> s_own) {
  const size_t base = text.size();
  text.append(s);
  for (const ByteRange& r : s_own) {
    if (r.begin >= r.end) continue;
    if (!own.empty() && own.back().end == base + r.begin) {
      own.back().end = base + r.end;
    } else {
      own.push_back({base + r.begin, base + r.end});
    }
  }
}

void TrackedText::AppendOwn(std::string_view s) {
  const ByteRange all{0, s.size()};
  Append(s, std::span<const ByteRange>(&all, 1));
}

std::vector<ByteRange> OwnWithin(std::span<const ByteRange> own, size_t begin, size_t end) {
  std::vector<ByteRange> out;
  for (const ByteRange& r : own) {
    const size_t b = std::max(r.begin, begin), e = std::min(r.end, end);
    if (b < e) out.push_back({b - begin, e - begin});
  }
  return out;
}

Value AllOwn(const Value& v) {
  switch (v.type()) {
    case Type::kString: {
      std::vector<ByteRange> own;
      if (!v.str().empty()) own.push_back({0, v.str().size()});
      return Value::Str(v.str(), v.safe(), std::move(own));
    }
    case Type::kSeq: {
      if (v.seq_kind() != SeqKind::kList && v.seq_kind() != SeqKind::kTuple) return v;
      std::vector<Value> items;
      items.reserve(v.seq().items.size());
      for (const Value& item : v.seq().items) items.push_back(AllOwn(item));
      return Value::Seq(v.seq_kind(), std::move(items));
    }
    case Type::kDict: {
      auto dict = std::make_shared<DictObj>();
      for (const auto& [key, value] : v.dict().entries) dict->Set(AllOwn(key), AllOwn(value));
      return Value::Dict(std::move(dict));
    }
    default:
      return v;
  }
}

Value Value::Range(int64_t start, int64_t stop, int64_t step, std::vector<Value> items) {
  Value v = Seq(SeqKind::kRange, std::move(items));
  SeqObj& seq = v.seq_mutable();
  seq.start = start;
  seq.stop = stop;
  seq.step = step;
  return v;
}

Value Value::Seq(SeqKind kind, std::vector<Value> items) {
  auto obj = std::make_shared<SeqObj>();
  obj->kind = kind;
  int depth = 0;
  for (const Value& item : items) depth = std::max(depth, ChildDepth(item));
  obj->depth = depth + 1;
  CheckDepth(obj->depth);
  obj->items = std::move(items);
  Value v(Type::kSeq);
  v.obj_ = std::move(obj);
  return v;
}

Value Value::Dict(std::shared_ptr<DictObj> dict) {
  int depth = 0;
  for (const auto& [key, value] : dict->entries) {
    depth = std::max({depth, ChildDepth(key), ChildDepth(value)});
  }
  dict->depth = depth + 1;
  CheckDepth(dict->depth);
  Value v(Type::kDict);
  v.obj_ = std::move(dict);
  return v;
}

Value Value::Object(Type type, std::shared_ptr<jinja::Object> object) {
  Value v(type);
  v.obj_ = std::move(object);
  return v;
}

const std::string& Value::str() const { return static_cast<const StrObj*>(obj_.get())->s; }
std::span<const ByteRange> Value::own() const {
  if (type_ != Type::kString) return {};
  return static_cast<const StrObj*>(obj_.get())->own;
}
const SeqObj& Value::seq() const { return *static_cast<const SeqObj*>(obj_.get()); }
SeqObj& Value::seq_mutable() const { return *static_cast<SeqObj*>(obj_.get()); }
SeqKind Value::seq_kind() const { return seq().kind; }
const DictObj& Value::dict() const { return *static_cast<const DictObj*>(obj_.get()); }
NamespaceObj& Value::ns() const { return *static_cast<NamespaceObj*>(obj_.get()); }
const std::string& Value::undefined_hint() const {
  return obj_ ? static_cast<const UndefObj*>(obj_.get())->hint : EmptyString();
}
bool Value::undefined_unsafe() const {
  return obj_ && static_cast<const UndefObj*>(obj_.get())->unsafe;
}

// ---------------------------------------------------------------------------
// Dicts and namespaces

namespace {

void CheckHashable(const Value& key) {
  if (!IsHashable(key)) {
    ThrowTypeError(Cat("unhashable type: '", PyTypeName(key), "'"));
  }
}

}  // namespace

const Value* DictObj::FindStr(std::string_view key) const {
  auto it = str_index_.find(absl::string_view(key.data(), key.size()));
  return it == str_index_.end() ? nullptr : &entries[it->second].second;
}

const Value* DictObj::Find(const Value& key) const {
  if (key.is_string()) return FindStr(key.str());
  CheckHashable(key);
  CountWork(static_cast<int64_t>(entries.size()));
  for (const auto& [k, v] : entries) {
    if (!k.is_string() && Equal(k, key)) return &v;
  }
  return nullptr;
}

void DictObj::Set(Value key, Value value) {
  if (key.is_string()) {
    auto [it, inserted] = str_index_.try_emplace(key.str(), entries.size());
    if (inserted) {
      entries.emplace_back(std::move(key), std::move(value));
    } else {
      entries[it->second].second = std::move(value);
    }
    return;
  }
  CheckHashable(key);
  CountWork(static_cast<int64_t>(entries.size()));
  for (auto& [k, v] : entries) {
    if (!k.is_string() && Equal(k, key)) {
      v = std::move(value);
      return;
    }
  }
  entries.emplace_back(std::move(key), std::move(value));
}

const Value* NamespaceObj::Find(std::string_view name) const {
  for (const auto& [k, v] : attrs) {
    if (k == name) return &v;
  }
  return nullptr;
}

void NamespaceObj::Set(const std::string& name, Value value) {
  for (auto& [k, v] : attrs) {
    if (k == name) {
      v = std::move(value);
      return;
    }
  }
  attrs.emplace_back(name, std::move(value));
}

// ---------------------------------------------------------------------------
// Names

std::string PyTypeName(const Value& v) {
  switch (v.type()) {
    case Type::kUndefined:
      return "Undefined";
    case Type::kNone:
      return "NoneType";
    case Type::kBool:
      return "bool";
    case Type::kInt:
      return "int";
    case Type::kFloat:
      return "float";
    case Type::kString:
      return v.safe() ? "Markup" : "str";
    case Type::kSeq:
      switch (v.seq_kind()) {
        case SeqKind::kList:
          return "list";
        case SeqKind::kTuple:
          return "tuple";
        case SeqKind::kGenerator:
          return "generator";
        case SeqKind::kRange:
          return "range";
        case SeqKind::kKeys:
          return "dict_keys";
        case SeqKind::kValues:
          return "dict_values";
        case SeqKind::kItems:
          return "dict_items";
        case SeqKind::kReversed:
          return "list_reverseiterator";
      }
      return "list";
    case Type::kDict:
      return "dict";
    case Type::kNamespace:
      return "Namespace";
    case Type::kCallable:
      switch (v.object<CallableObj>().kind) {
        case CallableObj::Kind::kMacro:
          return "Macro";
        case CallableObj::Kind::kGlobal:
          return "function";
        case CallableObj::Kind::kMethod:
          return "builtin_function_or_method";
      }
      return "function";
    case Type::kLoop:
      return "LoopContext";
    case Type::kCycler:
      return "Cycler";
    case Type::kJoiner:
      return "Joiner";
  }
  return "object";
}

std::string ObjectTypeRepr(const Value& v) {
  switch (v.type()) {
    case Type::kNone:
      return "None";
    case Type::kString:
      return v.safe() ? "markupsafe.Markup object" : "str object";
    case Type::kNamespace:
      return "jinja2.utils.Namespace object";
    case Type::kLoop:
      return "jinja2.runtime.LoopContext object";
    case Type::kCycler:
      return "jinja2.utils.Cycler object";
    case Type::kJoiner:
      return "jinja2.utils.Joiner object";
    case Type::kUndefined:
      return "jinja2.runtime.Undefined object";
    default:
      return PyTypeName(v) + " object";
  }
}

// ---------------------------------------------------------------------------
// str() and repr()

std::string FloatRepr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (x == 0) return std::signbit(x) ? "-0.0" : "0.0";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), x, std::chars_format::scientific);
  const std::string_view sci(buf, static_cast<size_t>(res.ptr - buf));
  // [-]d[.ddd]e[+-]dd
  std::string out;
  size_t pos = 0;
  if (sci[0] == '-') {
    out.push_back('-');
    pos = 1;
  }
  const size_t e = sci.find('e');
  std::string digits;
  for (size_t i = pos; i < e; ++i) {
    if (sci[i] != '.') digits.push_back(sci[i]);
  }
  int exponent = 0;
  std::from_chars(sci.data() + e + (sci[e + 1] == '+' ? 2 : 1), sci.data() + sci.size(), exponent);
  const int decpt = exponent + 1;  // x = 0.digits * 10^decpt
  const int n = static_cast<int>(digits.size());
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out += "0.";
      out.append(static_cast<size_t>(-decpt), '0');
      out += digits;
    } else if (decpt >= n) {
      out += digits;
      out.append(static_cast<size_t>(decpt - n), '0');
      out += ".0";
    } else {
      out.append(digits, 0, static_cast<size_t>(decpt));
      out.push_back('.');
      out.append(digits, static_cast<size_t>(decpt));
    }
    return out;
  }
  out.push_back(digits[0]);
  if (n > 1) {
    out.push_back('.');
    out.append(digits, 1);
  }
  out.push_back('e');
  const int exp = decpt - 1;
  out.push_back(exp < 0 ? '-' : '+');
  const int abs_exp = exp < 0 ? -exp : exp;
  if (abs_exp < 10) out.push_back('0');
  out += std::to_string(abs_exp);
  return out;
}

std::string ReprString(std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back(quote);
  size_t pos = 0;
  char hex[16];
  while (pos < s.size()) {
    const char32_t c = DecodeUtf8At(s, &pos);
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7F) {
      std::snprintf(hex, sizeof(hex), "\\x%02x", static_cast<unsigned>(c));
      out += hex;
    } else if (c < 0x7F || IsPrintable(c)) {
      AppendUtf8(&out, c);
    } else if (c <= 0xFF) {
      std::snprintf(hex, sizeof(hex), "\\x%02x", static_cast<unsigned>(c));
      out += hex;
    } else if (c <= 0xFFFF) {
      std::snprintf(hex, sizeof(hex), "\\u%04x", static_cast<unsigned>(c));
      out += hex;
    } else {
      std::snprintf(hex, sizeof(hex), "\\U%08x", static_cast<unsigned>(c));
      out += hex;
    }
  }
  out.push_back(quote);
  return out;
}

namespace {

void AppendItems(std::string* out, const std::vector<Value>& items, int depth) {
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out->append(", ");
    AppendRepr(out, items[i], depth + 1);
  }
}

void AppendDictItems(std::string* out, const DictObj& dict, int depth) {
  bool first = true;
  for (const auto& [k, v] : dict.entries) {
    if (!first) out->append(", ");
    first = false;
    AppendRepr(out, k, depth + 1);
    out->append(": ");
    AppendRepr(out, v, depth + 1);
  }
}

}  // namespace

void AppendRepr(std::string* out, const Value& v, int depth) {
  CheckDepth(depth);
  CountWork(1);
  switch (v.type()) {
    case Type::kUndefined:
      out->append("Undefined");
      return;
    case Type::kNone:
      out->append("None");
      return;
    case Type::kBool:
      out->append(v.bool_value() ? "True" : "False");
      return;
    case Type::kInt:
      out->append(std::to_string(v.int_value()));
      return;
    case Type::kFloat:
      out->append(FloatRepr(v.float_value()));
      return;
    case Type::kString:
      CountWork(static_cast<int64_t>(v.str().size() / 8));
      if (v.safe()) {
        CatAppend(out, "Markup(", ReprString(v.str()), ")");
      } else {
        out->append(ReprString(v.str()));
      }
      return;
    case Type::kSeq: {
      const SeqObj& seq = v.seq();
      switch (seq.kind) {
        case SeqKind::kList:
          out->push_back('[');
          AppendItems(out, seq.items, depth);
          out->push_back(']');
          return;
        case SeqKind::kTuple:
          out->push_back('(');
          AppendItems(out, seq.items, depth);
          if (seq.items.size() == 1) out->push_back(',');
          out->push_back(')');
          return;
        case SeqKind::kGenerator:
          out->append("<generator object>");
          return;
        case SeqKind::kReversed:
          out->append("<list_reverseiterator object>");
          return;
        case SeqKind::kRange:
          if (seq.step == 1) {
            CatAppend(out, "range(", seq.start, ", ", seq.stop, ")");
          } else {
            CatAppend(out, "range(", seq.start, ", ", seq.stop, ", ", seq.step, ")");
          }
          return;
        case SeqKind::kKeys:
        case SeqKind::kValues:
        case SeqKind::kItems:
          CatAppend(out, PyTypeName(v), "([");
          AppendItems(out, seq.items, depth);
          out->append("])");
          return;
      }
      return;
    }
    case Type::kDict:
      out->push_back('{');
      AppendDictItems(out, v.dict(), depth);
      out->push_back('}');
      return;
    case Type::kNamespace: {
      out->append("<Namespace {");
      bool first = true;
      for (const auto& [k, val] : v.ns().attrs) {
        if (!first) out->append(", ");
        first = false;
        CatAppend(out, ReprString(k), ": ");
        AppendRepr(out, val, depth + 1);
      }
      out->append("}>");
      return;
    }
    case Type::kCallable: {
      const auto& c = v.object<CallableObj>();
      switch (c.kind) {
        case CallableObj::Kind::kMacro:
          CatAppend(out, "<Macro ", ReprString(c.name), ">");
          return;
        case CallableObj::Kind::kGlobal:
          CatAppend(out, "<function ", c.name, ">");
          return;
        case CallableObj::Kind::kMethod:
          CatAppend(out, "<built-in method ", c.name, " of ", PyTypeName(c.self), " object>");
          return;
      }
      return;
    }
    case Type::kLoop: {
      auto& loop = v.object<LoopObj>();
      CatAppend(out, "<LoopContext ", loop.index0 + 1, "/", loop.length(), ">");
      return;
    }
    case Type::kCycler:
      out->append("<jinja2.utils.Cycler object>");
      return;
    case Type::kJoiner:
      out->append("<jinja2.utils.Joiner object>");
      return;
  }
}

std::string Repr(const Value& v) {
  std::string out;
  AppendRepr(&out, v);
  return out;
}

void AppendStr(std::string* out, const Value& v, int depth) {
  switch (v.type()) {
    case Type::kUndefined:
      return;
    case Type::kString:
      out->append(v.str());
      return;
    default:
      AppendRepr(out, v, depth);
  }
}

std::string ToStr(const Value& v) {
  if (v.is_string()) return v.str();
  std::string out;
  AppendStr(&out, v);
  return out;
}

// ---------------------------------------------------------------------------
// Truth, equality, ordering, hashing

bool Truthy(const Value& v) {
  switch (v.type()) {
    case Type::kUndefined:
    case Type::kNone:
      return false;
    case Type::kBool:
    case Type::kInt:
      return v.int_value() != 0;
    case Type::kFloat:
      return v.float_value() != 0.0;
    case Type::kString:
      return !v.str().empty();
    case Type::kSeq:
      switch (v.seq_kind()) {
        case SeqKind::kGenerator:
        case SeqKind::kReversed:
          return true;  // an iterator is always true
        default:
          return !v.seq().items.empty();
      }
    case Type::kDict:
      return v.dict().size() != 0;
    default:
      return true;
  }
}

namespace {

// An int and a float compare exactly, as in Python.
int CompareIntFloat(int64_t i, double f) {
  if (std::isnan(f)) return 2;  // unordered
  const long double li = static_cast<long double>(i);
  const long double lf = static_cast<long double>(f);
  return li < lf ? -1 : (li > lf ? 1 : 0);
}

// -1, 0, 1, or 2 when unordered (NaN).
int CompareNumbers(const Value& a, const Value& b) {
  if (a.is_intlike() && b.is_intlike()) {
    return a.int_value() < b.int_value() ? -1 : (a.int_value() > b.int_value() ? 1 : 0);
  }
  if (a.is_intlike()) return CompareIntFloat(a.int_value(), b.float_value());
  if (b.is_intlike()) {
    const int c = CompareIntFloat(b.int_value(), a.float_value());
    return c == 2 ? 2 : -c;
  }
  const double x = a.float_value(), y = b.float_value();
  if (std::isnan(x) || std::isnan(y)) return 2;
  return x < y ? -1 : (x > y ? 1 : 0);
}

bool SequenceLike(SeqKind k) {
  return k == SeqKind::kList || k == SeqKind::kTuple || k == SeqKind::kRange;
}

}  // namespace

bool Equal(const Value& a, const Value& b, int depth) {
  CheckDepth(depth);
  CountWork(1);
  if (a.is_number() && b.is_number()) return CompareNumbers(a, b) == 0;
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case Type::kUndefined:
    case Type::kNone:
      return true;
    case Type::kString:
      CountWork(static_cast<int64_t>(std::min(a.str().size(), b.str().size()) / 16));
      return a.str() == b.str();
    case Type::kSeq: {
      if (a.identity() == b.identity()) return true;
      const SeqKind ka = a.seq_kind(), kb = b.seq_kind();
      if (ka != kb || !(SequenceLike(ka) || ka == SeqKind::kKeys || ka == SeqKind::kItems)) {
        return false;
      }
      const auto& x = a.seq().items;
      const auto& y = b.seq().items;
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i) {
        if (!Equal(x[i], y[i], depth + 1)) return false;
      }
      return true;
    }
    case Type::kDict: {
      if (a.identity() == b.identity()) return true;
      const DictObj& x = a.dict();
      const DictObj& y = b.dict();
      if (x.size() != y.size()) return false;
      for (const auto& [k, v] : x.entries) {
        const Value* other = y.Find(k);
        if (other == nullptr || !Equal(v, *other, depth + 1)) return false;
      }
      return true;
    }
    case Type::kCallable: {
      const auto& x = a.object<CallableObj>();
      const auto& y = b.object<CallableObj>();
      if (&x == &y) return true;
      return x.kind == CallableObj::Kind::kMethod && y.kind == CallableObj::Kind::kMethod &&
             x.name == y.name && x.self.identity() == y.self.identity();
    }
    default:
      return a.identity() == b.identity();
  }
}

namespace {

bool ApplyOrder(int c, std::string_view op) {
  if (c == 2) return false;
  if (op == "<") return c < 0;
  if (op == "<=") return c <= 0;
  if (op == ">") return c > 0;
  return c >= 0;  // ">="
}

}  // namespace

bool Compare(const Value& a, const Value& b, std::string_view op, int depth) {
  CheckDepth(depth);
  CountWork(1);
  if (a.is_undefined() || b.is_undefined()) {
    const Value& u = a.is_undefined() ? a : b;
    ThrowRuntime(u.undefined_unsafe() ? "SecurityError" : "UndefinedError", u.undefined_hint());
  }
  if (a.is_number() && b.is_number()) return ApplyOrder(CompareNumbers(a, b), op);
  if (a.is_string() && b.is_string()) {
    const int c = a.str().compare(b.str());
    return ApplyOrder(c < 0 ? -1 : (c > 0 ? 1 : 0), op);
  }
  if (a.is_seq() && b.is_seq() && a.seq_kind() == b.seq_kind() &&
      (a.seq_kind() == SeqKind::kList || a.seq_kind() == SeqKind::kTuple)) {
    const auto& x = a.seq().items;
    const auto& y = b.seq().items;
    const size_t n = std::min(x.size(), y.size());
    for (size_t i = 0; i < n; ++i) {
      if (!Equal(x[i], y[i], depth + 1)) return Compare(x[i], y[i], op, depth + 1);
    }
    return ApplyOrder(x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0), op);
  }
  ThrowTypeError(Cat("'", op, "' not supported between instances of '", PyTypeName(a), "' and '",
                     PyTypeName(b), "'"));
}

bool Less(const Value& a, const Value& b, int depth) { return Compare(a, b, "<", depth); }

bool IsHashable(const Value& v) {
  switch (v.type()) {
    case Type::kDict:
      return false;
    case Type::kSeq:
      switch (v.seq_kind()) {
        case SeqKind::kList:
        case SeqKind::kKeys:
        case SeqKind::kValues:
        case SeqKind::kItems:
          return false;
        case SeqKind::kTuple:
          for (const Value& item : v.seq().items) {
            if (!IsHashable(item)) return false;
          }
          return true;
        default:
          return true;
      }
    default:
      return true;
  }
}

size_t Hash(const Value& v, int depth) {
  CheckDepth(depth);
  CountWork(1);
  switch (v.type()) {
    case Type::kUndefined:
      return 0x5bd1e995;
    case Type::kNone:
      return 0x27d4eb2d;
    case Type::kBool:
    case Type::kInt:
      return std::hash<int64_t>()(v.int_value());
    case Type::kFloat: {
      const double f = v.float_value();
      if (std::isfinite(f) && f == std::floor(f) && std::fabs(f) < 9.2e18) {
        return std::hash<int64_t>()(static_cast<int64_t>(f));
      }
      return std::hash<double>()(f);
    }
    case Type::kString:
      CountWork(static_cast<int64_t>(v.str().size() / 16));
      return std::hash<std::string_view>()(v.str());
    case Type::kSeq:
      if (v.seq_kind() == SeqKind::kTuple) {
        size_t h = 0x345678;
        for (const Value& item : v.seq().items) h = h * 1000003 ^ Hash(item, depth + 1);
        return h;
      }
      if (!IsHashable(v)) ThrowTypeError(Cat("unhashable type: '", PyTypeName(v), "'"));
      return std::hash<const void*>()(v.identity());
    case Type::kDict:
      ThrowTypeError("unhashable type: 'dict'");
    default:
      return std::hash<const void*>()(v.identity());
  }
}

// ---------------------------------------------------------------------------
// JSON

namespace {

void AppendJsonString(std::string* out, std::string_view s, bool ensure_ascii) {
  out->push_back('"');
  char hex[16];
  size_t pos = 0;
  while (pos < s.size()) {
    const auto b = static_cast<uint8_t>(s[pos]);
    if (((b >= 0x20 && b < 0x7F) || (b == 0x7F && !ensure_ascii)) && b != '"' && b != '\\') {
      out->push_back(static_cast<char>(b));
      ++pos;
      continue;
    }
    if (b >= 0x80 && !ensure_ascii) {
      const size_t start = pos;
      DecodeUtf8At(s, &pos);
      out->append(s.substr(start, pos - start));
      continue;
    }
    const char32_t c = DecodeUtf8At(s, &pos);
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\r':
        out->append("\\r");
        break;
      case '\t':
        out->append("\\t");
        break;
      case '\b':
        out->append("\\b");
        break;
      case '\f':
        out->append("\\f");
        break;
      default:
        if (c >= 0x10000) {
          const char32_t v = c - 0x10000;
          std::snprintf(hex, sizeof(hex), "\\u%04x\\u%04x",
                        static_cast<unsigned>(0xD800 + (v >> 10)),
                        static_cast<unsigned>(0xDC00 + (v & 0x3FF)));
        } else {
          std::snprintf(hex, sizeof(hex), "\\u%04x", static_cast<unsigned>(c));
        }
        out->append(hex);
    }
  }
  out->push_back('"');
}

std::string JsonFloat(double f) {
  if (std::isnan(f)) return "NaN";
  if (std::isinf(f)) return f > 0 ? "Infinity" : "-Infinity";
  return FloatRepr(f);
}

[[noreturn]] void NotSerializable(const Value& v) {
  ThrowTypeError(Cat("Object of type ", PyTypeName(v), " is not JSON serializable"));
}

void AppendNewline(std::string* out, const JsonOptions& options, int level) {
  out->push_back('\n');
  for (int i = 0; i < level; ++i) out->append(options.indent);
}

}  // namespace

void AppendJson(std::string* out, const Value& v, const JsonOptions& options, int level) {
  if (level > kMaxValueDepth) ThrowRuntime("ValueError", "Circular reference detected");
  CountWork(1);
  switch (v.type()) {
    case Type::kNone:
      out->append("null");
      return;
    case Type::kBool:
      out->append(v.bool_value() ? "true" : "false");
      return;
    case Type::kInt:
      out->append(std::to_string(v.int_value()));
      return;
    case Type::kFloat:
      out->append(JsonFloat(v.float_value()));
      return;
    case Type::kString:
      CountWork(static_cast<int64_t>(v.str().size() / 8));
      AppendJsonString(out, v.str(), options.ensure_ascii);
      return;
    case Type::kSeq: {
      const SeqObj& seq = v.seq();
      if (seq.kind != SeqKind::kList && seq.kind != SeqKind::kTuple) NotSerializable(v);
      if (seq.items.empty()) {
        out->append("[]");
        return;
      }
      out->push_back('[');
      if (options.has_indent) AppendNewline(out, options, level + 1);
      for (size_t i = 0; i < seq.items.size(); ++i) {
        if (i > 0) {
          out->append(options.item_separator);
          if (options.has_indent) AppendNewline(out, options, level + 1);
        }
        AppendJson(out, seq.items[i], options, level + 1);
      }
      if (options.has_indent) AppendNewline(out, options, level);
      out->push_back(']');
      return;
    }
    case Type::kDict: {
      const DictObj& dict = v.dict();
      if (dict.size() == 0) {
        out->append("{}");
        return;
      }
      std::vector<const std::pair<Value, Value>*> entries;
      entries.reserve(dict.size());
      for (const auto& e : dict.entries) entries.push_back(&e);
      if (options.sort_keys) {
        std::stable_sort(entries.begin(), entries.end(),
                         [](const auto* x, const auto* y) { return Less(x->first, y->first); });
      }
      out->push_back('{');
      if (options.has_indent) AppendNewline(out, options, level + 1);
      bool first = true;
      for (const auto* entry : entries) {
        const Value& key = entry->first;
        if (!first) {
          out->append(options.item_separator);
          if (options.has_indent) AppendNewline(out, options, level + 1);
        }
        first = false;
        switch (key.type()) {
          case Type::kString:
            AppendJsonString(out, key.str(), options.ensure_ascii);
            break;
          case Type::kNone:
            out->append("\"null\"");
            break;
          case Type::kBool:
            out->append(key.bool_value() ? "\"true\"" : "\"false\"");
            break;
          case Type::kInt:
            CatAppend(out, "\"", key.int_value(), "\"");
            break;
          case Type::kFloat:
            CatAppend(out, "\"", JsonFloat(key.float_value()), "\"");
            break;
          default:
            ThrowTypeError(
                Cat("keys must be str, int, float, bool or None, not ", PyTypeName(key)));
        }
        out->append(options.key_separator);
        AppendJson(out, entry->second, options, level + 1);
      }
      if (options.has_indent) AppendNewline(out, options, level);
      out->push_back('}');
      return;
    }
    default:
      NotSerializable(v);
  }
}

// ---------------------------------------------------------------------------
// Iteration

std::vector<Value> Iterate(const Value& v) {
  switch (v.type()) {
    case Type::kUndefined:
      return {};
    case Type::kString: {
      const std::string& s = v.str();
      std::vector<Value> out;
      out.reserve(s.size());
      size_t pos = 0;
      while (pos < s.size()) {
        const size_t start = pos;
        DecodeUtf8At(s, &pos);
        out.push_back(Value::Str(s.substr(start, pos - start), v.safe()));
      }
      CountWork(static_cast<int64_t>(out.size()));
      return out;
    }
    case Type::kSeq:
      if (v.seq().deferred != nullptr) throw *v.seq().deferred;
      CountWork(static_cast<int64_t>(v.seq().items.size()));
      return v.seq().items;
    case Type::kDict: {
      std::vector<Value> out;
      out.reserve(v.dict().size());
      for (const auto& [k, unused] : v.dict().entries) out.push_back(k);
      CountWork(static_cast<int64_t>(out.size()));
      return out;
    }
    default:
      ThrowTypeError(Cat("'", PyTypeName(v), "' object is not iterable"));
  }
}

}  // namespace coalesce::chat::jinja
