// jinja2's filters and tests, the methods of str, dict and list a template
// may call, jinja2's globals plus transformers' raise_exception and
// strftime_now, and Python's % and str.format formatting (jinja_format.cc). Filters and
// methods are tables of named functions (kFilters; kStrMethods and the
// other receivers' tables), which say both what exists and what runs.
#include "chat/jinja_builtins.h"

#include <sys/time.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "chat/jinja_format.h"
#include "chat/jinja_interp.h"
#include "chat/jinja_unicode.h"

namespace coalesce::chat::jinja {
namespace {

// ---------------------------------------------------------------------------
// Small helpers

Value MethodValue(const Value& self, std::string_view name) {
  auto fn = std::make_shared<CallableObj>();
  fn->kind = CallableObj::Kind::kMethod;
  fn->name = std::string(name);
  fn->self = self;
  return Value::Object(Type::kCallable, std::move(fn));
}

[[noreturn]] void FilterArgumentError(std::string_view message) {
  ThrowRuntime("FilterArgumentError", message);
}

bool OneOf(std::initializer_list<std::string_view> names, std::string_view name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// jinja2's soft_str: a str stays what it is (Markup included), anything
// else becomes str(value).
Value SoftStr(Interp* in, const Value& v) {
  if (v.is_string()) return v;
  std::string s;
  AppendStr(&s, v);
  return in->MakeStr(std::move(s));
}

// len(v).
int64_t Len(const Value& v) {
  switch (v.type()) {
    case Type::kUndefined:
      return 0;
    case Type::kString:
      return static_cast<int64_t>(CodePointCount(v.str()));
    case Type::kSeq:
      if (v.seq_kind() != SeqKind::kGenerator && v.seq_kind() != SeqKind::kReversed) {
        return static_cast<int64_t>(v.seq().items.size());
      }
      break;
    case Type::kDict:
      return static_cast<int64_t>(v.dict().size());
    case Type::kLoop:
      return v.object<LoopObj>().length();
    default:
      break;
  }
  ThrowTypeError(Cat("object of type '", PyTypeName(v), "' has no len()"));
}

// str.split / rsplit.
std::vector<std::string> Split(std::string_view s, const Value* sep, int64_t maxsplit, bool right) {
  std::vector<std::string> out;
  if (sep == nullptr || sep->is_none()) {
    const std::u32string cps = DecodeUtf8(s);
    std::vector<std::pair<size_t, size_t>> words;
    if (!right) {
      size_t i = 0;
      while (i < cps.size()) {
        while (i < cps.size() && IsPySpace(cps[i])) ++i;
        if (i >= cps.size()) break;
        if (maxsplit >= 0 && static_cast<int64_t>(words.size()) == maxsplit) {
          size_t e = cps.size();
          while (e > i && IsPySpace(cps[e - 1])) --e;
          words.emplace_back(i, e);
          break;
        }
        size_t j = i;
        while (j < cps.size() && !IsPySpace(cps[j])) ++j;
        words.emplace_back(i, j);
        i = j;
      }
    } else {
      size_t i = cps.size();
      while (i > 0) {
        while (i > 0 && IsPySpace(cps[i - 1])) --i;
        if (i == 0) break;
        if (maxsplit >= 0 && static_cast<int64_t>(words.size()) == maxsplit) {
          size_t b = 0;
          while (b < i && IsPySpace(cps[b])) ++b;
          words.emplace_back(b, i);
          break;
        }
        size_t j = i;
        while (j > 0 && !IsPySpace(cps[j - 1])) --j;
        words.emplace_back(j, i);
        i = j;
      }
      std::reverse(words.begin(), words.end());
    }
    for (const auto& [b, e] : words)
      out.push_back(EncodeUtf8(std::u32string_view(cps).substr(b, e - b)));
    return out;
  }
  const std::string& sp = RequireStr(*sep, "separator");
  if (sp.empty()) ValueError("empty separator");
  if (!right) {
    size_t start = 0;
    int64_t n = 0;
    while (maxsplit < 0 || n < maxsplit) {
      const size_t k = s.find(sp, start);
      if (k == std::string_view::npos) break;
      out.emplace_back(s.substr(start, k - start));
      start = k + sp.size();
      ++n;
    }
    out.emplace_back(s.substr(start));
    return out;
  }
  size_t end = s.size();
  int64_t n = 0;
  while (maxsplit < 0 || n < maxsplit) {
    if (end < sp.size()) break;
    const size_t k = s.rfind(sp, end - sp.size());
    if (k == std::string_view::npos) break;
    out.emplace_back(s.substr(k + sp.size(), end - k - sp.size()));
    end = k;
    ++n;
  }
  out.emplace_back(s.substr(0, end));
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> SplitLines(std::string_view s, bool keepends) {
  const std::u32string cps = DecodeUtf8(s);
  std::vector<std::string> out;
  size_t i = 0;
  while (i < cps.size()) {
    size_t j = i;
    while (j < cps.size() && !IsLineBreak(cps[j])) ++j;
    size_t eol = j;
    if (j < cps.size()) {
      eol = (cps[j] == '\r' && j + 1 < cps.size() && cps[j + 1] == '\n') ? j + 2 : j + 1;
    }
    out.push_back(EncodeUtf8(std::u32string_view(cps).substr(i, (keepends ? eol : j) - i)));
    i = eol;
  }
  return out;
}

std::string Replace(std::string_view s, std::string_view old, std::string_view repl, int64_t count,
                    size_t limit) {
  std::string out;
  auto check = [&]() {
    if (out.size() > limit) {
      ThrowLimit(Cat("max_output_bytes exceeded: the template built a string of more than ", limit,
                     " bytes"));
    }
  };
  if (old.empty()) {
    // Python inserts `repl` around every code point.
    size_t pos = 0;
    int64_t n = 0;
    while (true) {
      if (count >= 0 && n >= count) break;
      out.append(repl);
      ++n;
      check();
      if (pos >= s.size()) break;
      const size_t start = pos;
      DecodeUtf8At(s, &pos);
      out.append(s.substr(start, pos - start));
    }
    out.append(s.substr(std::min(pos, s.size())));
    check();
    return out;
  }
  size_t start = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    const size_t k = s.find(old, start);
    if (k == std::string_view::npos) break;
    out.append(s.substr(start, k - start));
    out.append(repl);
    check();
    start = k + old.size();
    ++n;
  }
  out.append(s.substr(start));
  check();
  return out;
}

// Code point bounds [start, end) of s[start:end] as Python's str methods
// take them.
void Bounds(size_t len, const Value* start, const Value* end, size_t* b, size_t* e) {
  auto norm = [&](const Value* v, int64_t dflt) -> int64_t {
    if (v == nullptr || v->is_none()) return dflt;
    int64_t x = RequireInt(*v, "slice index");
    if (x < 0) x = std::max<int64_t>(0, x + static_cast<int64_t>(len));
    return std::min<int64_t>(x, static_cast<int64_t>(len));
  };
  *b = static_cast<size_t>(norm(start, 0));
  *e = static_cast<size_t>(norm(end, static_cast<int64_t>(len)));
}

}  // namespace

[[noreturn]] void ValueError(std::string_view message) { ThrowRuntime("ValueError", message); }
[[noreturn]] void NotSupported(std::string_view what) {
  ThrowRuntime("TemplateRuntimeError", Cat(what, " is not supported in chat templates"));
}

const std::string& RequireStr(const Value& v, std::string_view what) {
  if (!v.is_string()) {
    if (v.is_undefined()) Interp::ThrowUndefined(v);
    ThrowTypeError(Cat(what, " must be str, not ", PyTypeName(v)));
  }
  return v.str();
}

int64_t RequireInt(const Value& v, std::string_view what) {
  if (v.is_intlike()) return v.int_value();
  if (v.is_undefined()) Interp::ThrowUndefined(v);
  ThrowTypeError(
      Cat("'", PyTypeName(v), "' object cannot be interpreted as an integer (", what, ")"));
}

// Python's str.strip(chars) family: which = -1 left, 1 right, 0 both.
// `begin`, when given, is set to the byte of `s` where the result starts.
std::string Strip(std::string_view s, const Value* chars, int which, size_t* begin) {
  const std::u32string cps = DecodeUtf8(s);
  std::u32string set;
  const bool whitespace = chars == nullptr || chars->is_none();
  if (!whitespace) set = DecodeUtf8(RequireStr(*chars, "strip arg"));
  auto strip_it = [&](char32_t c) {
    return whitespace ? IsPySpace(c) : set.find(c) != std::u32string::npos;
  };
  size_t b = 0, e = cps.size();
  if (which <= 0) {
    while (b < e && strip_it(cps[b])) ++b;
  }
  if (which >= 0) {
    while (e > b && strip_it(cps[e - 1])) --e;
  }
  if (begin != nullptr) *begin = EncodeUtf8(std::u32string_view(cps).substr(0, b)).size();
  return EncodeUtf8(std::u32string_view(cps).substr(b, e - b));
}

std::string Pad(std::string_view s, int64_t width, char32_t fill, char align) {
  const auto len = static_cast<int64_t>(CodePointCount(s));
  if (width <= len) return std::string(s);
  const int64_t pad = width - len;
  int64_t left = 0;
  if (align == '>') {
    left = pad;
  } else if (align == '^') {
    left = pad / 2;
  }
  std::string f;
  AppendUtf8(&f, fill);
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += f;
  out += s;
  for (int64_t i = 0; i < pad - left; ++i) out += f;
  return out;
}

std::string HtmlEscape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// Methods
//
// One table per receiver type of the methods a template may look up, sorted
// by name: PyAttr reads it to know that `s.strip` is a bound method, and
// CallMethod to call it. A name without a function is a method Python has
// and chat templates may not call: looking it up gives the bound method (as
// in Python), calling it is an error saying it is not supported.

namespace {

// `name` is the method's name as the template called it: methods that
// differ only in a direction or a character class share one function.
using MethodFn = Value (*)(Interp* in, const Value& self, std::string_view name, const Args& args);

struct MethodEntry {
  std::string_view name;
  MethodFn fn;  // null: not supported in chat templates
};

// The entry of `table` (sorted by name) named `name`, or null.
template <typename Table>
auto FindByName(const Table& table, std::string_view name) -> decltype(&*std::begin(table)) {
  const auto it = std::lower_bound(std::begin(table), std::end(table), name,
                                   [](const auto& e, std::string_view n) { return e.name < n; });
  return it != std::end(table) && it->name == name ? &*it : nullptr;
}

// Whether `table` is sorted by name, each name once: what FindByName needs.
template <typename Entry, size_t N>
constexpr bool StrictlySortedByName(const Entry (&table)[N]) {
  return std::adjacent_find(std::begin(table), std::end(table), [](const Entry& a, const Entry& b) {
           return !(a.name < b.name);
         }) == std::end(table);
}

// --- str

// A list of the strs `parts`, each as safe as the str it came from.
Value StrList(Interp* in, std::vector<std::string> parts, bool safe) {
  std::vector<Value> items;
  items.reserve(parts.size());
  for (auto& p : parts) items.push_back(Value::Str(std::move(p), safe));
  return in->MakeSeq(SeqKind::kList, std::move(items));
}

// str.strip, lstrip, rstrip.
Value StrStrip(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {"chars"});
  size_t begin = 0;
  std::string kept =
      Strip(self.str(), b.Get(0), name == "strip" ? 0 : (name == "lstrip" ? -1 : 1), &begin);
  return in->Substr(self, begin, std::move(kept));
}

// str.split, rsplit.
Value StrSplit(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {"sep", "maxsplit"});
  const int64_t maxsplit = b.Has(1) ? RequireInt(*b.Get(1), "maxsplit") : -1;
  return StrList(in, Split(self.str(), b.Get(0), maxsplit, name == "rsplit"), self.safe());
}

Value StrSplitlines(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {"keepends"});
  return StrList(in, SplitLines(self.str(), b.Has(0) && Truthy(*b.Get(0))), self.safe());
}

// str.startswith, endswith: a str or a tuple of strs, within [start, end).
Value StrStartsOrEndsWith(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {"prefix", "start", "end"});
  if (!b.Has(0)) ThrowTypeError(Cat(name, "() takes at least 1 argument (0 given)"));
  const std::u32string cps = DecodeUtf8(self.str());
  size_t lo, hi;
  Bounds(cps.size(), b.Get(1), b.Get(2), &lo, &hi);
  const std::u32string_view window =
      lo <= hi ? std::u32string_view(cps).substr(lo, hi - lo) : std::u32string_view();
  std::vector<Value> candidates;
  const Value& prefix = *b.Get(0);
  if (prefix.is_seq() && prefix.seq_kind() == SeqKind::kTuple) {
    candidates = prefix.seq().items;
  } else if (prefix.is_string()) {
    candidates.push_back(prefix);
  } else {
    ThrowTypeError(Cat(name, " first arg must be str or a tuple of str, not ", PyTypeName(prefix)));
  }
  if (lo > hi) return Value::Bool(false);
  for (const Value& c : candidates) {
    const std::u32string p = DecodeUtf8(RequireStr(c, "tuple for startswith"));
    if (p.size() > window.size()) continue;
    if (name == "startswith" ? window.substr(0, p.size()) == p
                             : window.substr(window.size() - p.size()) == p) {
      return Value::Bool(true);
    }
  }
  return Value::Bool(false);
}

// str.upper, lower, casefold, title, capitalize, swapcase: `kConvert` of the
// text, as safe as it was.
template <std::string (*kConvert)(std::string_view)>
Value StrConvert(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {});
  return in->MakeStr(kConvert(self.str()), self.safe());
}

Value StrReplace(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {"old", "new", "count"});
  if (!b.Has(1)) ThrowTypeError("replace expected at least 2 arguments");
  const int64_t count = b.Has(2) ? RequireInt(*b.Get(2), "count") : -1;
  return in->MakeStr(
      Replace(self.str(), RequireStr(*b.Get(0), "replace() argument 1"),
              RequireStr(*b.Get(1), "replace() argument 2"), count, in->limits().max_output_bytes),
      self.safe());
}

// The arguments of str.find, rfind, index, rindex and count: the text and
// the substring as code points, and the window [lo, hi) of the text to look
// in (lo > hi: none).
struct SubstringSearch {
  std::u32string cps, sub;
  size_t lo, hi;
};

SubstringSearch BindSubstringSearch(const std::string& s, std::string_view name, const Args& args) {
  Bound b(name, args, {"sub", "start", "end"});
  if (!b.Has(0)) ThrowTypeError(Cat(name, "() takes at least 1 argument (0 given)"));
  SubstringSearch out;
  out.cps = DecodeUtf8(s);
  out.sub = DecodeUtf8(RequireStr(*b.Get(0), "substring"));
  Bounds(out.cps.size(), b.Get(1), b.Get(2), &out.lo, &out.hi);
  return out;
}

// str.find, rfind, index, rindex: where the substring starts (the last
// place for the r-forms); -1 when it is not there, an error for index and
// rindex.
Value StrFind(Interp* in, const Value& self, std::string_view name, const Args& args) {
  const SubstringSearch q = BindSubstringSearch(self.str(), name, args);
  int64_t found = -1;
  if (q.lo <= q.hi && q.hi - q.lo >= q.sub.size()) {
    const std::u32string_view w = std::u32string_view(q.cps).substr(q.lo, q.hi - q.lo);
    const size_t p = (name == "find" || name == "index") ? w.find(q.sub) : w.rfind(q.sub);
    if (p != std::u32string_view::npos) found = static_cast<int64_t>(q.lo + p);
  }
  if (found < 0 && (name == "index" || name == "rindex")) ValueError("substring not found");
  return Value::Int(found);
}

// str.count: non-overlapping occurrences (an empty substring is between
// every two code points and at both ends).
Value StrCount(Interp* in, const Value& self, std::string_view name, const Args& args) {
  const SubstringSearch q = BindSubstringSearch(self.str(), name, args);
  if (q.lo > q.hi) return Value::Int(0);
  const std::u32string_view w = std::u32string_view(q.cps).substr(q.lo, q.hi - q.lo);
  if (q.sub.empty()) return Value::Int(static_cast<int64_t>(w.size()) + 1);
  int64_t c = 0;
  for (size_t p = w.find(q.sub); p != std::u32string_view::npos;
       p = w.find(q.sub, p + q.sub.size()))
    ++c;
  return Value::Int(c);
}

Value StrJoin(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {"iterable"});
  if (!b.Has(0)) ThrowTypeError("join() takes exactly one argument (0 given)");
  const std::vector<Value> items = Iterate(*b.Get(0));
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!items[i].is_string()) {
      ThrowTypeError(
          Cat("sequence item ", i, ": expected str instance, ", PyTypeName(items[i]), " found"));
    }
    if (i > 0) out += self.str();
    out += items[i].str();
    if (out.size() > in->limits().max_output_bytes) in->MakeStr(std::move(out));  // throws
  }
  return in->MakeStr(std::move(out), self.safe());
}

Value StrFormatMethod(Interp* in, const Value& self, std::string_view name, const Args& args) {
  return in->MakeStr(StrFormat(in, self.str(), args), self.safe());
}

Value StrIsascii(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {});
  return Value::Bool(IsAscii(self.str()));
}

Value StrIsprintable(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {});
  const std::u32string cps = DecodeUtf8(self.str());
  return Value::Bool(std::all_of(cps.begin(), cps.end(), IsPrintable));
}

// str.islower, isupper: at least one cased code point, and none of the other
// case (nor a titlecase one).
Value StrIsLowerOrUpper(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {});
  const bool lower = name == "islower";
  bool cased = false;
  for (char32_t c : DecodeUtf8(self.str())) {
    if (lower ? IsUpperChar(c) : IsLowerChar(c)) return Value::Bool(false);
    if (IsCased(c) && (lower ? IsLowerChar(c) : IsUpperChar(c))) cased = true;
    if (IsCased(c) && !IsLowerChar(c) && !IsUpperChar(c)) return Value::Bool(false);
  }
  return Value::Bool(cased);
}

Value StrIstitle(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {});
  bool cased = false, previous_cased = false;
  for (char32_t c : DecodeUtf8(self.str())) {
    if (IsUpperChar(c) || (IsCased(c) && !IsLowerChar(c))) {
      if (previous_cased) return Value::Bool(false);
      previous_cased = cased = true;
    } else if (IsLowerChar(c)) {
      if (!previous_cased) return Value::Bool(false);
      previous_cased = cased = true;
    } else {
      previous_cased = false;
    }
  }
  return Value::Bool(cased);
}

Value StrIsidentifier(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {});
  const std::u32string cps = DecodeUtf8(self.str());
  if (cps.empty()) return Value::Bool(false);
  for (size_t i = 0; i < cps.size(); ++i) {
    const char32_t c = cps[i];
    const bool ok = c == '_' || IsAlpha(c) || (i > 0 && (IsDecimal(c) || IsDigit(c)));
    if (!ok) return Value::Bool(false);
  }
  return Value::Bool(true);
}

bool IsAlnum(char32_t c) { return IsAlpha(c) || IsDecimal(c) || IsDigit(c) || IsNumeric(c); }

// str.isalnum, isalpha, isdecimal, isdigit, isnumeric, isspace: a non-empty
// str of code points all of the class.
template <bool (*kIsClass)(char32_t)>
Value StrIsClass(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {});
  const std::u32string cps = DecodeUtf8(self.str());
  return Value::Bool(!cps.empty() && std::all_of(cps.begin(), cps.end(), kIsClass));
}

// str.ljust, rjust, center.
Value StrJustify(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {"width", "fillchar"});
  if (!b.Has(0)) ThrowTypeError(Cat(name, "() takes at least 1 argument (0 given)"));
  const int64_t width = RequireInt(*b.Get(0), "width");
  if (width > static_cast<int64_t>(in->limits().max_output_bytes)) in->StringLimit();
  char32_t fill = ' ';
  if (b.Has(1)) {
    const std::u32string f = DecodeUtf8(RequireStr(*b.Get(1), "fillchar"));
    if (f.size() != 1) ThrowTypeError("The fill character must be exactly one character long");
    fill = f[0];
  }
  const std::string& s = self.str();
  if (name != "center")
    return in->MakeStr(Pad(s, width, fill, name == "ljust" ? '<' : '>'), self.safe());
  const auto len = static_cast<int64_t>(CodePointCount(s));
  if (width <= len) return self;
  // Python's centering: an odd code point of padding goes on the left when
  // the width is odd too.
  const int64_t pad = width - len;
  const int64_t left = pad / 2 + (pad & width & 1);
  std::string fs;
  AppendUtf8(&fs, fill);
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += fs;
  out += s;
  for (int64_t i = 0; i < pad - left; ++i) out += fs;
  return in->MakeStr(std::move(out), self.safe());
}

Value StrZfill(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {"width"});
  if (!b.Has(0)) ThrowTypeError("zfill() takes exactly one argument (0 given)");
  const int64_t width = RequireInt(*b.Get(0), "width");
  const std::string& s = self.str();
  const auto len = static_cast<int64_t>(CodePointCount(s));
  if (width <= len) return self;
  if (width > static_cast<int64_t>(in->limits().max_output_bytes)) in->StringLimit();
  const size_t sign = !s.empty() && (s[0] == '+' || s[0] == '-') ? 1 : 0;
  return in->MakeStr(
      s.substr(0, sign) + std::string(static_cast<size_t>(width - len), '0') + s.substr(sign),
      self.safe());
}

// str.removeprefix, removesuffix.
Value StrRemoveAffix(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {"affix"});
  if (!b.Has(0)) ThrowTypeError(Cat(name, "() takes exactly one argument (0 given)"));
  const std::string& a = RequireStr(*b.Get(0), name);
  const std::string& s = self.str();
  if (name == "removeprefix" && s.compare(0, a.size(), a) == 0)
    return in->MakeStr(s.substr(a.size()), self.safe());
  if (name == "removesuffix" && !a.empty() && s.size() >= a.size() &&
      s.compare(s.size() - a.size(), a.size(), a) == 0) {
    return in->MakeStr(s.substr(0, s.size() - a.size()), self.safe());
  }
  return self;
}

// str.partition, rpartition.
Value StrPartition(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {"sep"});
  if (!b.Has(0)) ThrowTypeError(Cat(name, "() takes exactly one argument (0 given)"));
  const std::string& sep = RequireStr(*b.Get(0), name);
  if (sep.empty()) ValueError("empty separator");
  const std::string& s = self.str();
  const bool safe = self.safe();
  const size_t k = name == "partition" ? s.find(sep) : s.rfind(sep);
  std::vector<Value> parts;
  if (k == std::string::npos) {
    if (name == "partition") {
      parts = {Value::Str(s, safe), Value::Str("", safe), Value::Str("", safe)};
    } else {
      parts = {Value::Str("", safe), Value::Str("", safe), Value::Str(s, safe)};
    }
  } else {
    parts = {Value::Str(s.substr(0, k), safe), Value::Str(sep, safe),
             Value::Str(s.substr(k + sep.size()), safe)};
  }
  return in->MakeSeq(SeqKind::kTuple, std::move(parts));
}

constexpr MethodEntry kStrMethods[] = {
    {"capitalize", StrConvert<PyCapitalize>},
    {"casefold", StrConvert<PyLower>},
    {"center", StrJustify},
    {"count", StrCount},
    {"encode", nullptr},
    {"endswith", StrStartsOrEndsWith},
    {"expandtabs", nullptr},
    {"find", StrFind},
    {"format", StrFormatMethod},
    {"format_map", nullptr},
    {"index", StrFind},
    {"isalnum", StrIsClass<IsAlnum>},
    {"isalpha", StrIsClass<IsAlpha>},
    {"isascii", StrIsascii},
    {"isdecimal", StrIsClass<IsDecimal>},
    {"isdigit", StrIsClass<IsDigit>},
    {"isidentifier", StrIsidentifier},
    {"islower", StrIsLowerOrUpper},
    {"isnumeric", StrIsClass<IsNumeric>},
    {"isprintable", StrIsprintable},
    {"isspace", StrIsClass<IsPySpace>},
    {"istitle", StrIstitle},
    {"isupper", StrIsLowerOrUpper},
    {"join", StrJoin},
    {"ljust", StrJustify},
    {"lower", StrConvert<PyLower>},
    {"lstrip", StrStrip},
    {"maketrans", nullptr},
    {"partition", StrPartition},
    {"removeprefix", StrRemoveAffix},
    {"removesuffix", StrRemoveAffix},
    {"replace", StrReplace},
    {"rfind", StrFind},
    {"rindex", StrFind},
    {"rjust", StrJustify},
    {"rpartition", StrPartition},
    {"rsplit", StrSplit},
    {"rstrip", StrStrip},
    {"split", StrSplit},
    {"splitlines", StrSplitlines},
    {"startswith", StrStartsOrEndsWith},
    {"strip", StrStrip},
    {"swapcase", StrConvert<PySwapcase>},
    {"title", StrConvert<PyTitle>},
    {"translate", nullptr},
    {"upper", StrConvert<PyUpper>},
    {"zfill", StrZfill},
};
static_assert(StrictlySortedByName(kStrMethods));

// --- dict

Value DictGet(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {"key", "default"});
  if (!b.Has(0)) ThrowTypeError("get expected at least 1 argument, got 0");
  if (const Value* v = self.dict().Find(*b.Get(0))) return *v;
  return b.Has(1) ? *b.Get(1) : Value::None();
}

// dict.items, keys, values: a view of the entries as they are now.
Value DictView(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {});
  const DictObj& d = self.dict();
  std::vector<Value> items;
  items.reserve(d.size());
  for (const auto& [k, v] : d.entries) {
    if (name == "items") {
      items.push_back(Value::Tuple({k, v}));
    } else {
      items.push_back(name == "keys" ? k : v);
    }
  }
  return in->MakeSeq(
      name == "items" ? SeqKind::kItems : (name == "keys" ? SeqKind::kKeys : SeqKind::kValues),
      std::move(items));
}

Value DictCopy(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {});
  const DictObj& d = self.dict();
  auto copy = std::make_shared<DictObj>(d);
  in->Charge(static_cast<int64_t>(d.size()));
  return Value::Dict(std::move(copy));
}

constexpr MethodEntry kDictMethods[] = {
    {"copy", DictCopy},  {"fromkeys", nullptr}, {"get", DictGet},
    {"items", DictView}, {"keys", DictView},    {"values", DictView},
};
static_assert(StrictlySortedByName(kDictMethods));

// --- list, tuple, range

Value SeqCount(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {"value"});
  if (!b.Has(0)) ThrowTypeError("count() takes exactly one argument (0 given)");
  int64_t c = 0;
  for (const Value& v : self.seq().items) c += Equal(v, *b.Get(0)) ? 1 : 0;
  return Value::Int(c);
}

Value SeqIndex(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {"value", "start", "stop"});
  if (!b.Has(0)) ThrowTypeError("index expected at least 1 argument, got 0");
  const auto& items = self.seq().items;
  size_t lo, hi;
  Bounds(items.size(), b.Get(1), b.Get(2), &lo, &hi);
  for (size_t i = lo; i < hi; ++i) {
    if (Equal(items[i], *b.Get(0))) return Value::Int(static_cast<int64_t>(i));
  }
  ValueError(Cat(Repr(*b.Get(0)), " is not in ", PyTypeName(self)));
}

Value SeqCopy(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {});
  return in->MakeSeq(SeqKind::kList, self.seq().items);
}

constexpr MethodEntry kListMethods[] = {
    {"copy", SeqCopy}, {"count", SeqCount}, {"index", SeqIndex}};
static_assert(StrictlySortedByName(kListMethods));
// Tuples and ranges: the methods of immutable sequences.
constexpr MethodEntry kTupleMethods[] = {{"count", SeqCount}, {"index", SeqIndex}};
static_assert(StrictlySortedByName(kTupleMethods));

// --- loop, cycler, float

// loop.cycle(a, b, ...): the argument at the iteration's index, round.
Value LoopCycle(Interp* in, const Value& self, std::string_view name, const Args& args) {
  if (args.pos.empty()) ThrowTypeError("no items for cycling given");
  return args.pos[static_cast<size_t>(self.object<LoopObj>().index0) % args.pos.size()];
}

// loop.changed(a, ...): whether the arguments differ from the last call's.
Value LoopChanged(Interp* in, const Value& self, std::string_view name, const Args& args) {
  auto& loop = self.object<LoopObj>();
  Value now = Value::Tuple(args.pos);
  if (!loop.has_changed || !Equal(loop.last_changed, now)) {
    loop.has_changed = true;
    loop.last_changed = std::move(now);
    return Value::Bool(true);
  }
  return Value::Bool(false);
}

constexpr MethodEntry kLoopMethods[] = {{"changed", LoopChanged}, {"cycle", LoopCycle}};
static_assert(StrictlySortedByName(kLoopMethods));

Value CyclerNext(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {});
  auto& cycler = self.object<CyclerObj>();
  Value v = cycler.items[cycler.pos];
  cycler.pos = (cycler.pos + 1) % cycler.items.size();
  return v;
}

Value CyclerReset(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {});
  self.object<CyclerObj>().pos = 0;
  return Value::None();
}

constexpr MethodEntry kCyclerMethods[] = {{"next", CyclerNext}, {"reset", CyclerReset}};
static_assert(StrictlySortedByName(kCyclerMethods));

Value FloatIsInteger(Interp* in, const Value& self, std::string_view name, const Args& args) {
  Bound b(name, args, {});
  const double f = self.float_value();
  return Value::Bool(std::isfinite(f) && f == std::floor(f));
}

constexpr MethodEntry kFloatMethods[] = {{"is_integer", FloatIsInteger}};

// The methods of `obj`'s type; none for the others (generators, dict views,
// numbers other than float, ...).
std::span<const MethodEntry> MethodsOf(const Value& obj) {
  switch (obj.type()) {
    case Type::kString:
      return kStrMethods;
    case Type::kDict:
      return kDictMethods;
    case Type::kSeq:
      switch (obj.seq_kind()) {
        case SeqKind::kList:
          return kListMethods;
        case SeqKind::kTuple:
        case SeqKind::kRange:
          return kTupleMethods;
        default:
          return {};
      }
    case Type::kLoop:
      return kLoopMethods;
    case Type::kCycler:
      return kCyclerMethods;
    case Type::kFloat:
      return kFloatMethods;
    default:
      return {};
  }
}

}  // namespace

std::optional<Value> Interp::PyAttr(const Value& obj, std::string_view name) {
  auto unsafe = [&]() {
    return Value::Undefined(Cat("access to attribute ", ReprString(name), " of ",
                                ReprString(PyTypeName(obj)), " object is unsafe."),
                            /*unsafe=*/true);
  };
  if (name.size() > 4 && name.substr(0, 2) == "__" && name.substr(name.size() - 2) == "__") {
    return unsafe();
  }
  if (FindByName(MethodsOf(obj), name) != nullptr) return MethodValue(obj, name);
  switch (obj.type()) {
    case Type::kDict:
      if (OneOf({"clear", "pop", "popitem", "setdefault", "update"}, name)) return unsafe();
      break;
    case Type::kSeq:
      if (obj.seq_kind() == SeqKind::kList &&
          OneOf({"append", "clear", "pop", "reverse", "insert", "sort", "extend", "remove"},
                name)) {
        return unsafe();
      }
      if (obj.seq_kind() == SeqKind::kRange && OneOf({"start", "stop", "step"}, name)) {
        NotSupported("range.start/stop/step");
      }
      break;
    case Type::kNamespace:
      if (const Value* v = obj.ns().Find(name)) return *v;
      break;
    case Type::kLoop: {
      auto& loop = obj.object<LoopObj>();
      const int64_t i = loop.index0;
      if (name == "index0") return Value::Int(i);
      if (name == "index") return Value::Int(i + 1);
      if (name == "revindex") return Value::Int(loop.length() - i);
      if (name == "revindex0") return Value::Int(loop.length() - i - 1);
      if (name == "first") return Value::Bool(i == 0);
      if (name == "last") return Value::Bool(!loop.Fill(static_cast<size_t>(i + 1)));
      if (name == "length") return Value::Int(loop.length());
      if (name == "depth") return Value::Int(1);
      if (name == "depth0") return Value::Int(0);
      if (name == "previtem") {
        if (i == 0) return Value::Undefined("there is no previous item");
        return loop.items[static_cast<size_t>(i - 1)];
      }
      if (name == "nextitem") {
        if (!loop.Fill(static_cast<size_t>(i + 1)))
          return Value::Undefined("there is no next item");
        return loop.items[static_cast<size_t>(i + 1)];
      }
      break;
    }
    case Type::kCycler: {
      const auto& cycler = obj.object<CyclerObj>();
      if (name == "current") return cycler.items[cycler.pos];
      if (name == "items") return Value::List(cycler.items);
      break;
    }
    case Type::kFloat:
      if (name == "real") return obj;
      if (name == "imag") return Value::Float(0);
      break;
    case Type::kInt:
    case Type::kBool:
      if (name == "real" || name == "numerator") return Value::Int(obj.int_value());
      if (name == "imag") return Value::Int(0);
      if (name == "denominator") return Value::Int(1);
      break;
    default:
      break;
  }
  return std::nullopt;
}

Value Interp::CallMethod(const Value& self, const std::string& name, const Args& args) {
  // A str method's work grows with the str's length, whatever it does.
  if (self.is_string()) Charge(static_cast<int64_t>(self.str().size() / 16));
  const MethodEntry* method = FindByName(MethodsOf(self), name);
  if (method != nullptr && method->fn != nullptr) return method->fn(this, self, name, args);
  if (self.is_string()) NotSupported(Cat("str.", name, "()"));
  if (self.is_dict()) NotSupported(Cat("dict.", name, "()"));
  NotSupported(Cat(PyTypeName(self), ".", name, "()"));
}

// ---------------------------------------------------------------------------
// Globals

namespace {

void DictUpdateFrom(const Value& source, DictObj* out) {
  if (source.is_dict()) {
    for (const auto& [k, v] : source.dict().entries) out->Set(k, v);
    return;
  }
  size_t i = 0;
  for (const Value& item : Iterate(source)) {
    const std::vector<Value> pair = Iterate(item);
    if (pair.size() != 2) {
      ValueError(Cat("dictionary update sequence element #", i, " has length ", pair.size(),
                     "; 2 is required"));
    }
    out->Set(pair[0], pair[1]);
    ++i;
  }
}

std::string Strftime(std::string_view format, const struct tm& tm, int64_t micros, size_t limit) {
  // datetime.strftime first substitutes %f, %z and %Z (empty for the naive
  // datetime.now()), then calls the C library's strftime.
  std::string fmt;
  for (size_t i = 0; i < format.size(); ++i) {
    const char c = format[i];
    if (c == '\0') ValueError("embedded null character");
    if (c != '%' || i + 1 >= format.size()) {
      fmt.push_back(c);
      continue;
    }
    const char d = format[++i];
    if (d == 'f') {
      char buf[16];
      std::snprintf(buf, sizeof(buf), "%06lld", static_cast<long long>(micros));
      fmt += buf;
    } else if (d == 'z' || d == 'Z') {
    } else {
      fmt.push_back('%');
      fmt.push_back(d);
    }
  }
  if (fmt.empty()) return "";
  // Python gives up (and returns "") when the output stays empty with a
  // buffer of 256 times the format's length.
  for (size_t size = 1024; size <= std::max<size_t>(1024, 256 * fmt.size()); size *= 2) {
    if (size > limit + 1024) {
      ThrowLimit(
          Cat("max_output_bytes exceeded: strftime_now's output is longer than ", limit, " bytes"));
    }
    std::string buf(size, '\0');
    const size_t n = std::strftime(buf.data(), buf.size(), fmt.c_str(), &tm);
    if (n > 0) {
      buf.resize(n);
      return buf;
    }
  }
  return "";
}

}  // namespace

Value Interp::CallGlobal(const std::string& name, const Args& args) {
  if (name == "range") {
    if (!args.kw.empty()) ThrowTypeError("range() takes no keyword arguments");
    if (args.pos.empty() || args.pos.size() > 3) {
      ThrowTypeError(Cat("range expected at most 3 arguments, got ", args.pos.size()));
    }
    int64_t start = 0, stop, step = 1;
    if (args.pos.size() == 1) {
      stop = RequireInt(args.pos[0], "range");
    } else {
      start = RequireInt(args.pos[0], "range");
      stop = RequireInt(args.pos[1], "range");
      if (args.pos.size() == 3) step = RequireInt(args.pos[2], "range");
    }
    if (step == 0) ValueError("range() arg 3 must not be zero");
    const __int128 span =
        step > 0 ? static_cast<__int128>(stop) - start : static_cast<__int128>(start) - stop;
    const __int128 abs_step = step > 0 ? step : -static_cast<__int128>(step);
    const __int128 len = span <= 0 ? 0 : (span + abs_step - 1) / abs_step;
    if (len > 100000) {
      ThrowRuntime("OverflowError",
                   "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    }
    std::vector<Value> items;
    items.reserve(static_cast<size_t>(len));
    for (__int128 i = 0; i < len; ++i)
      items.push_back(Value::Int(static_cast<int64_t>(start + i * step)));
    Charge(static_cast<int64_t>(len));
    return Value::Range(start, stop, step, std::move(items));
  }
  if (name == "dict" || name == "namespace") {
    if (args.pos.size() > 1) {
      ThrowTypeError(Cat(name, " expected at most 1 argument, got ", args.pos.size()));
    }
    auto d = std::make_shared<DictObj>();
    if (!args.pos.empty()) DictUpdateFrom(args.pos[0], d.get());
    for (const auto& [k, v] : args.kw) d->Set(Value::Str(k), v);
    Charge(static_cast<int64_t>(d->size()));
    if (name == "dict") return Value::Dict(std::move(d));
    auto ns = std::make_shared<NamespaceObj>();
    for (auto& [k, v] : d->entries) {
      if (k.is_string()) ns->Set(k.str(), v);
    }
    TrackMutable(ns);
    return Value::Object(Type::kNamespace, std::move(ns));
  }
  if (name == "raise_exception") {
    Bound b(name, args, {"message"});
    if (!b.Has(0)) {
      ThrowTypeError("raise_exception() missing 1 required positional argument: 'message'");
    }
    throw Error{Error::Kind::kRaised, ToStr(*b.Get(0))};
  }
  if (name == "strftime_now") {
    Bound b(name, args, {"format"});
    if (!b.Has(0))
      ThrowTypeError("strftime_now() missing 1 required positional argument: 'format'");
    const std::string& format = RequireStr(*b.Get(0), "strftime() argument 1");
    time_t t;
    int64_t micros = 0;
    if (now_unix_seconds().has_value()) {
      t = static_cast<time_t>(*now_unix_seconds());
    } else {
      struct timeval tv;
      gettimeofday(&tv, nullptr);
      t = tv.tv_sec;
      micros = tv.tv_usec;
    }
    struct tm tm;
    if (localtime_r(&t, &tm) == nullptr) ThrowRuntime("OverflowError", "timestamp out of range");
    return MakeStr(Strftime(format, tm, micros, limits_.max_output_bytes));
  }
  if (name == "cycler") {
    if (args.pos.empty()) ThrowRuntime("RuntimeError", "at least one item has to be provided");
    auto c = std::make_shared<CyclerObj>();
    c->items = args.pos;
    TrackMutable(c);
    return Value::Object(Type::kCycler, std::move(c));
  }
  if (name == "joiner") {
    Bound b(name, args, {"sep"});
    auto j = std::make_shared<JoinerObj>();
    j->sep = b.Has(0) ? ToStr(*b.Get(0)) : ", ";
    return Value::Object(Type::kJoiner, std::move(j));
  }
  NotSupported(Cat(name, "()"));
}

// ---------------------------------------------------------------------------
// Tests

namespace {

constexpr std::string_view kTests[] = {
    "odd",     "even",   "divisibleby", "defined",  "undefined", "filter", "test",    "none",
    "boolean", "false",  "true",        "integer",  "float",     "lower",  "upper",   "string",
    "mapping", "number", "sequence",    "iterable", "callable",  "sameas", "escaped", "in",
    "==",      "eq",     "equalto",     "!=",       "ne",        ">",      "gt",      "greaterthan",
    "ge",      ">=",     "<",           "lt",       "lessthan",  "<=",     "le"};

}  // namespace

bool IsKnownTest(std::string_view name) {
  return std::find(std::begin(kTests), std::end(kTests), name) != std::end(kTests);
}

bool Interp::ApplyTest(std::string_view name, const Value& v, const Args& args) {
  if (!IsKnownTest(name)) {
    ThrowRuntime("TemplateRuntimeError", Cat("No test named ", ReprString(name), "."));
  }
  std::string fname = Cat("test_", name);
  auto no_args = [&]() { Bound b(fname, args, {}); };
  auto one_arg = [&]() -> const Value& {
    Bound b(fname, args, {"other"});
    if (!b.Has(0)) ThrowTypeError(Cat(fname, "() missing 1 required positional argument"));
    return *b.Get(0);
  };
  if (name == "defined" || name == "undefined") {
    no_args();
    return v.is_undefined() == (name == "undefined");
  }
  if (name == "none") return no_args(), v.is_none();
  if (name == "boolean") return no_args(), v.is_bool();
  if (name == "false") return no_args(), v.is_bool() && !v.bool_value();
  if (name == "true") return no_args(), v.is_bool() && v.bool_value();
  if (name == "integer") return no_args(), v.type() == Type::kInt;
  if (name == "float") return no_args(), v.type() == Type::kFloat;
  if (name == "string") return no_args(), v.is_string();
  if (name == "mapping") return no_args(), v.is_dict();
  if (name == "number") return no_args(), v.is_number();
  if (name == "escaped") return no_args(), v.is_string() && v.safe();
  if (name == "lower" || name == "upper") {
    no_args();
    Args none;
    const Value s = SoftStr(this, v);
    return Truthy(CallMethod(s, name == "lower" ? "islower" : "isupper", none));
  }
  if (name == "sequence") {
    no_args();
    switch (v.type()) {
      case Type::kUndefined:
      case Type::kString:
      case Type::kDict:
        return true;
      case Type::kSeq:
        return v.seq_kind() == SeqKind::kList || v.seq_kind() == SeqKind::kTuple ||
               v.seq_kind() == SeqKind::kRange;
      default:
        return false;
    }
  }
  if (name == "iterable") {
    no_args();
    switch (v.type()) {
      case Type::kUndefined:
      case Type::kString:
      case Type::kSeq:
      case Type::kDict:
      case Type::kLoop:
        return true;
      default:
        return false;
    }
  }
  if (name == "callable") {
    no_args();
    return v.type() == Type::kCallable || v.type() == Type::kJoiner || v.type() == Type::kLoop ||
           v.is_undefined();
  }
  if (name == "odd" || name == "even") {
    no_args();
    const Value r = Arith(BinOp::kMod, v, Value::Int(2));
    return Equal(r, Value::Int(name == "odd" ? 1 : 0));
  }
  if (name == "divisibleby") {
    const Value& num = one_arg();
    return Equal(Arith(BinOp::kMod, v, num), Value::Int(0));
  }
  if (name == "sameas") {
    const Value& other = one_arg();
    if (v.type() != other.type()) return false;
    switch (v.type()) {
      case Type::kNone:
      case Type::kUndefined:
        return v.identity() == other.identity() || v.is_none();
      case Type::kBool:
        return v.bool_value() == other.bool_value();
      case Type::kInt:
        return v.int_value() == other.int_value() && v.int_value() >= -5 && v.int_value() <= 256;
      default:
        return v.identity() != nullptr && v.identity() == other.identity();
    }
  }
  if (name == "in") return Contains(one_arg(), v);
  if (name == "filter") return no_args(), v.is_string() && IsKnownFilter(v.str());
  if (name == "test") return no_args(), v.is_string() && IsKnownTest(v.str());
  const Value& other = one_arg();
  if (name == "==" || name == "eq" || name == "equalto") return Equal(v, other);
  if (name == "!=" || name == "ne") return !Equal(v, other);
  if (name == ">" || name == "gt" || name == "greaterthan") return Compare(v, other, ">");
  if (name == ">=" || name == "ge") return Compare(v, other, ">=");
  if (name == "<" || name == "lt" || name == "lessthan") return Compare(v, other, "<");
  return Compare(v, other, "<=");
}

// ---------------------------------------------------------------------------
// Filters

namespace {

Value IgnoreCase(const Value& v) {
  if (v.is_string()) return Value::Str(PyLower(v.str()));
  return v;
}

// jinja2's select_or_reject over `items`: keep those the test (or truth)
// accepts, or rejects.
std::vector<Value> SelectOrReject(Interp* in, const Value& value, const Args& args, bool select,
                                  bool lookup_attr) {
  std::vector<Value> out;
  if (!Truthy(value)) return out;
  size_t off = 0;
  Value attr;
  if (lookup_attr) {
    if (args.pos.empty()) FilterArgumentError("Missing parameter for attribute name");
    attr = args.pos[0];
    off = 1;
  }
  Args test_args;
  bool has_test = args.pos.size() > off;
  std::string test_name;
  if (has_test) {
    test_name = ToStr(args.pos[off]);
    test_args.pos.assign(args.pos.begin() + static_cast<std::ptrdiff_t>(off + 1), args.pos.end());
    test_args.kw = args.kw;
  }
  for (const Value& item : Iterate(value)) {
    in->Step();
    const Value subject = lookup_attr ? in->AttrPath(item, attr) : item;
    const bool ok = has_test ? in->ApplyTest(test_name, subject, test_args) : Truthy(subject);
    if (ok == select) out.push_back(item);
  }
  return out;
}

// The key sort, min, max and unique compare: the attribute (attribute may
// be "a,b" for sort), lower-cased unless case-sensitive.
Value SortKey(Interp* in, const Value& item, const Value& attribute, bool case_sensitive,
              bool multi) {
  if (multi && attribute.is_string() && attribute.str().find(',') != std::string::npos) {
    std::vector<Value> keys;
    size_t start = 0;
    const std::string& a = attribute.str();
    while (true) {
      const size_t comma = a.find(',', start);
      const Value part =
          Value::Str(a.substr(start, comma == std::string::npos ? comma : comma - start));
      Value k = in->AttrPath(item, part);
      keys.push_back(case_sensitive ? k : IgnoreCase(k));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    return Value::List(std::move(keys));
  }
  Value k = in->AttrPath(item, attribute);
  return case_sensitive ? k : IgnoreCase(k);
}

std::string JinjaTitle(std::string_view s) {
  // Words start after runs of -, whitespace, (, {, [ or <.
  const std::u32string cps = DecodeUtf8(s);
  std::u32string out;
  auto is_delim = [](char32_t c) {
    return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || IsPySpace(c);
  };
  size_t i = 0;
  while (i < cps.size()) {
    const bool delim = is_delim(cps[i]);
    size_t j = i;
    while (j < cps.size() && is_delim(cps[j]) == delim) ++j;
    AppendUpper(&out, cps[i]);
    for (size_t k = i + 1; k < j; ++k) AppendLower(&out, cps[k]);
    i = j;
  }
  return EncodeUtf8(out);
}

// jinja2's filters, one function each (aliases and filters that differ only
// in a direction share one), in the table below. `name` is the filter's
// name as the template wrote it: the errors of argument binding name it.
using FilterFn = Value (*)(Interp* in, std::string_view name, const Value& value, const Args& args);

// transformers' tojson: json.dumps(x, ensure_ascii=False, indent=indent,
// separators=separators, sort_keys=False).
Value FilterTojson(Interp* in, std::string_view name, const Value& value, const Args& args) {
  const Value none = Value::None();
  Bound b(name, args, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonOptions o;
  o.ensure_ascii = b.Has(0) && Truthy(*b.Get(0));
  o.sort_keys = b.Has(3) && Truthy(*b.Get(3));
  const Value& indent = b.Or(1, none);
  if (!indent.is_none()) {
    o.has_indent = true;
    if (indent.is_string()) {
      o.indent = indent.str();
    } else if (indent.is_intlike()) {
      const int64_t k = indent.int_value();
      if (k > 1000) in->StringLimit();
      o.indent = std::string(static_cast<size_t>(std::max<int64_t>(0, k)), ' ');
    } else {
      ThrowTypeError(Cat("can't multiply sequence by non-int of type '", PyTypeName(indent), "'"));
    }
    o.item_separator = ",";
  }
  const Value& seps = b.Or(2, none);
  if (!seps.is_none()) {
    const std::vector<Value> parts = Iterate(seps);
    if (parts.size() != 2) {
      ValueError(Cat("too many values to unpack (expected 2)"));
    }
    o.item_separator = RequireStr(parts[0], "separator");
    o.key_separator = RequireStr(parts[1], "separator");
  }
  std::string out;
  AppendJson(&out, value, o);
  return in->MakeStr(std::move(out));
}

Value FilterTrim(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {"chars"});
  const Value s = SoftStr(in, value);
  size_t begin = 0;
  std::string kept = Strip(s.str(), b.Get(0), 0, &begin);
  return in->Substr(s, begin, std::move(kept));
}

// length, count.
Value FilterLength(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {});
  return Value::Int(Len(value));
}

// default, d.
Value FilterDefault(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {"default_value", "boolean"});
  const bool boolean = b.Has(1) && Truthy(*b.Get(1));
  if (value.is_undefined() || (boolean && !Truthy(value))) {
    return b.Has(0) ? *b.Get(0) : Value::Str("");
  }
  return value;
}

Value FilterString(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {});
  return SoftStr(in, value);
}

// upper, lower, capitalize: `kConvert` of str(value), as safe as it was.
template <std::string (*kConvert)(std::string_view)>
Value FilterConvert(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {});
  const Value s = SoftStr(in, value);
  return in->MakeStr(kConvert(s.str()), s.safe());
}

Value FilterTitle(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {});
  const Value s = SoftStr(in, value);
  return in->MakeStr(JinjaTitle(s.str()));
}

Value FilterSafe(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {});
  if (value.is_string()) return Value::Str(value.str(), true);
  return in->MakeStr(ToStr(value), true);
}

// escape, e: a safe str stays as it is.
Value FilterEscape(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {});
  if (value.is_string() && value.safe()) return value;
  return in->MakeStr(HtmlEscape(ToStr(value)), true);
}

Value FilterForceescape(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {});
  return in->MakeStr(HtmlEscape(ToStr(value)), true);
}

Value FilterReplace(Interp* in, std::string_view name, const Value& value, const Args& args) {
  const Value none = Value::None();
  Bound b(name, args, {"old", "new", "count"});
  if (!b.Has(1)) ThrowTypeError("do_replace() missing required arguments 'old' and 'new'");
  const Value& count = b.Or(2, none);
  // ToStr(undefined) is "", as str(Undefined) is.
  return in->MakeStr(Replace(ToStr(value), ToStr(*b.Get(0)), ToStr(*b.Get(1)),
                             count.is_none() ? -1 : RequireInt(count, "count"),
                             in->limits().max_output_bytes));
}

Value FilterJoin(Interp* in, std::string_view name, const Value& value, const Args& args) {
  const Value none = Value::None();
  Bound b(name, args, {"d", "attribute"});
  const std::string sep = b.Has(0) ? ToStr(*b.Get(0)) : "";
  const Value& attribute = b.Or(1, none);
  std::string out;
  bool first = true;
  for (const Value& item : Iterate(value)) {
    if (!first) out += sep;
    first = false;
    AppendStr(&out, attribute.is_none() ? item : in->AttrPath(item, attribute));
    if (out.size() > in->limits().max_output_bytes) in->MakeStr(std::move(out));  // throws
  }
  return in->MakeStr(std::move(out));
}

Value FilterFirst(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {});
  if (value.is_seq() || value.is_string() || value.is_dict() || value.is_undefined()) {
    std::vector<Value> items = Iterate(value);
    if (items.empty()) return Value::Undefined("No first item, sequence was empty.");
    return items.front();
  }
  ThrowTypeError(Cat("'", PyTypeName(value), "' object is not iterable"));
}

Value FilterLast(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {});
  if (value.is_seq() &&
      (value.seq_kind() == SeqKind::kGenerator || value.seq_kind() == SeqKind::kReversed)) {
    ThrowTypeError(Cat("'", PyTypeName(value), "' object is not reversible"));
  }
  if (value.is_seq() || value.is_string() || value.is_dict() || value.is_undefined()) {
    std::vector<Value> items = Iterate(value);
    if (items.empty()) return Value::Undefined("No last item, sequence was empty.");
    return items.back();
  }
  ThrowTypeError(Cat("'", PyTypeName(value), "' object is not reversible"));
}

Value FilterList(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {});
  return in->MakeSeq(SeqKind::kList, Iterate(value));
}

Value FilterItems(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {});
  if (value.is_undefined()) return in->MakeSeq(SeqKind::kGenerator, {});
  if (!value.is_dict()) ThrowTypeError("Can only get item pairs from a mapping.");
  std::vector<Value> items;
  for (const auto& [k, v] : value.dict().entries) items.push_back(Value::Tuple({k, v}));
  return in->MakeSeq(SeqKind::kGenerator, std::move(items));
}

// map(attribute=..., default=...): each item's attribute; map(filter, ...):
// the filter applied to each item.
Value FilterMap(Interp* in, std::string_view name, const Value& value, const Args& args) {
  std::vector<Value> out;
  if (!Truthy(value)) return in->MakeSeq(SeqKind::kGenerator, {});
  if (args.pos.empty() && args.Kw("attribute") != nullptr) {
    const Value* attribute = nullptr;
    const Value* dflt = nullptr;
    for (const auto& [k, v] : args.kw) {
      if (k == "attribute") {
        attribute = &v;
      } else if (k == "default") {
        dflt = &v;
      } else {
        FilterArgumentError(Cat("Unexpected keyword argument ", ReprString(k)));
      }
    }
    for (const Value& item : Iterate(value)) {
      in->Step();
      Value v = in->AttrPath(item, *attribute);
      if (dflt != nullptr && !dflt->is_none() && v.is_undefined()) v = *dflt;
      out.push_back(std::move(v));
    }
    return in->MakeSeq(SeqKind::kGenerator, std::move(out));
  }
  if (args.pos.empty()) FilterArgumentError("map requires a filter argument");
  const std::string filter = ToStr(args.pos[0]);
  Args rest;
  rest.pos.assign(args.pos.begin() + 1, args.pos.end());
  rest.kw = args.kw;
  for (const Value& item : Iterate(value)) {
    in->Step();
    out.push_back(in->ApplyFilter(filter, item, rest));
  }
  return in->MakeSeq(SeqKind::kGenerator, std::move(out));
}

// select, reject, selectattr, rejectattr.
Value FilterSelect(Interp* in, std::string_view name, const Value& value, const Args& args) {
  return in->MakeSeq(SeqKind::kGenerator,
                     SelectOrReject(in, value, args, name == "select" || name == "selectattr",
                                    name == "selectattr" || name == "rejectattr"));
}

Value FilterInt(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {"default", "base"});
  const Value dflt = b.Has(0) ? *b.Get(0) : Value::Int(0);
  const int64_t base = b.Has(1) ? RequireInt(*b.Get(1), "base") : 10;
  if (value.is_undefined()) Interp::ThrowUndefined(value);
  if (value.is_intlike()) return Value::Int(value.int_value());
  if (value.type() == Type::kFloat) {
    if (!std::isfinite(value.float_value())) return dflt;
    return Value::Int(TruncToInt(value.float_value()));
  }
  if (value.is_string()) {
    int64_t v;
    if (ParsePyInt(value.str(), static_cast<int>(base), &v)) return Value::Int(v);
    double f;
    if (ParsePyFloat(value.str(), &f) && std::isfinite(f)) return Value::Int(TruncToInt(f));
  }
  return dflt;
}

Value FilterFloat(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {"default"});
  const Value dflt = b.Has(0) ? *b.Get(0) : Value::Float(0.0);
  if (value.is_undefined()) Interp::ThrowUndefined(value);
  if (value.is_number()) return Value::Float(value.float_value());
  double f;
  if (value.is_string() && ParsePyFloat(value.str(), &f)) return Value::Float(f);
  return dflt;
}

Value FilterAbs(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {});
  if (value.is_intlike()) {
    if (value.int_value() == std::numeric_limits<int64_t>::min()) {
      ThrowRuntime("OverflowError", "integer out of the 64-bit range of chat templates");
    }
    return Value::Int(std::abs(value.int_value()));
  }
  if (value.type() == Type::kFloat) return Value::Float(std::fabs(value.float_value()));
  ThrowTypeError(Cat("bad operand type for abs(): '", PyTypeName(value), "'"));
}

// Python's round(x, precision) of an int: to the nearest multiple of
// 10**-precision, halves to the even one.
int64_t RoundInt(int64_t x, int64_t precision) {
  if (precision >= 0) return x;
  if (precision < -18) return 0;
  int64_t p = 1;
  for (int64_t i = 0; i < -precision; ++i) p *= 10;
  int64_t q = x / p, r = x % p;
  if (r < 0) {
    r += p;
    --q;
  }
  if (2 * r > p || (2 * r == p && (q & 1))) ++q;
  return q * p;
}

Value FilterRound(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {"precision", "method"});
  const int64_t precision = b.Has(0) ? RequireInt(*b.Get(0), "precision") : 0;
  const std::string method = b.Has(1) ? ToStr(*b.Get(1)) : "common";
  if (method != "common" && method != "ceil" && method != "floor") {
    FilterArgumentError("method must be common, ceil or floor");
  }
  if (!value.is_number()) {
    ThrowTypeError(Cat("type ", PyTypeName(value), " doesn't define __round__ method"));
  }
  if (method == "common") {
    if (value.is_intlike()) return Value::Int(RoundInt(value.int_value(), precision));
    return Value::Float(PyRound(value.float_value(), precision));
  }
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double x = value.float_value() * scale;
  return Value::Float((method == "ceil" ? std::ceil(x) : std::floor(x)) / scale);
}

Value FilterIndent(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {"width", "first", "blank"});
  if (value.is_undefined()) Interp::ThrowUndefined(value);
  if (!value.is_string()) {
    // do_indent's `s += "\n"` then `s.splitlines()`: a list takes the +=.
    if (value.is_seq() && value.seq_kind() == SeqKind::kList) {
      ThrowRuntime("AttributeError", "'list' object has no attribute 'splitlines'");
    }
    ThrowTypeError(Cat("unsupported operand type(s) for +=: '", PyTypeName(value), "' and 'str'"));
  }
  std::string indention;
  const Value width = b.Or(0, Value::Int(4));
  if (width.is_string()) {
    indention = width.str();
  } else {
    const int64_t w = RequireInt(width, "width");
    if (w > 1000) in->StringLimit();
    indention = std::string(static_cast<size_t>(std::max<int64_t>(0, w)), ' ');
  }
  const bool first = b.Has(1) && Truthy(*b.Get(1));
  const bool blank = b.Has(2) && Truthy(*b.Get(2));
  std::vector<std::string> lines = SplitLines(value.str() + "\n", false);
  const size_t limit = in->limits().max_output_bytes;
  std::string rv;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i > 0) rv += "\n" + indention;
      rv += lines[i];
      if (rv.size() > limit) in->MakeStr(std::move(rv));  // throws
    }
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) {
      rv += "\n";
      if (!lines[i].empty()) rv += indention;
      rv += lines[i];
      if (rv.size() > limit) in->MakeStr(std::move(rv));  // throws
    }
  }
  if (first) rv = indention + rv;
  return in->MakeStr(std::move(rv), value.safe());
}

Value FilterReverse(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {});
  if (!value.is_string() && !value.is_seq() && !value.is_dict() && !value.is_undefined()) {
    FilterArgumentError("argument must be iterable");
  }
  if (value.is_string()) {
    std::u32string cps = DecodeUtf8(value.str());
    std::reverse(cps.begin(), cps.end());
    return in->MakeStr(EncodeUtf8(cps), value.safe());
  }
  std::vector<Value> items;
  try {
    items = Iterate(value);
  } catch (const Error& e) {
    // A generator that fails as list() reads it: do_reverse's TypeError.
    if (e.kind == Error::Kind::kRuntime && e.message.rfind("TypeError", 0) == 0) {
      FilterArgumentError("argument must be iterable");
    }
    throw;
  }
  std::reverse(items.begin(), items.end());
  const bool iterator = value.is_undefined() || value.is_dict() ||
                        (value.is_seq() && value.seq_kind() != SeqKind::kGenerator &&
                         value.seq_kind() != SeqKind::kReversed);
  return in->MakeSeq(iterator ? SeqKind::kReversed : SeqKind::kList, std::move(items));
}

Value FilterSort(Interp* in, std::string_view name, const Value& value, const Args& args) {
  const Value none = Value::None();
  Bound b(name, args, {"reverse", "case_sensitive", "attribute"});
  const bool reverse = b.Has(0) && Truthy(*b.Get(0));
  const bool case_sensitive = b.Has(1) && Truthy(*b.Get(1));
  const Value& attribute = b.Or(2, none);
  std::vector<Value> items = Iterate(value);
  std::vector<std::pair<Value, size_t>> keyed;
  keyed.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    keyed.emplace_back(SortKey(in, items[i], attribute, case_sensitive, true), i);
  }
  in->Charge(static_cast<int64_t>(items.size()) * 4);
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
    return reverse ? Less(y.first, x.first) : Less(x.first, y.first);
  });
  std::vector<Value> out;
  out.reserve(items.size());
  for (const auto& [k, i] : keyed) out.push_back(items[i]);
  return in->MakeSeq(SeqKind::kList, std::move(out));
}

Value FilterDictsort(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {"case_sensitive", "by", "reverse"});
  const bool case_sensitive = b.Has(0) && Truthy(*b.Get(0));
  const std::string by = b.Has(1) ? ToStr(*b.Get(1)) : "key";
  const bool reverse = b.Has(2) && Truthy(*b.Get(2));
  if (by != "key" && by != "value")
    FilterArgumentError("You can only sort by either \"key\" or \"value\"");
  if (value.is_undefined()) Interp::ThrowUndefined(value);
  if (!value.is_dict()) {
    ThrowRuntime("AttributeError",
                 Cat("'", PyTypeName(value), "' object has no attribute 'items'"));
  }
  std::vector<std::pair<Value, Value>> entries = value.dict().entries;
  const size_t pos = by == "key" ? 0 : 1;
  auto key = [&](const std::pair<Value, Value>& e) {
    const Value& k = pos == 0 ? e.first : e.second;
    return case_sensitive ? k : IgnoreCase(k);
  };
  in->Charge(static_cast<int64_t>(entries.size()) * 4);
  std::stable_sort(entries.begin(), entries.end(), [&](const auto& x, const auto& y) {
    return reverse ? Less(key(y), key(x)) : Less(key(x), key(y));
  });
  std::vector<Value> out;
  for (auto& [k, v] : entries) out.push_back(Value::Tuple({k, v}));
  return in->MakeSeq(SeqKind::kList, std::move(out));
}

Value FilterUnique(Interp* in, std::string_view name, const Value& value, const Args& args) {
  const Value none = Value::None();
  Bound b(name, args, {"case_sensitive", "attribute"});
  const bool case_sensitive = b.Has(0) && Truthy(*b.Get(0));
  const Value& attribute = b.Or(1, none);
  std::vector<Value> out;
  std::vector<Value> seen;
  absl::flat_hash_map<size_t, std::vector<size_t>> index;
  for (const Value& item : Iterate(value)) {
    in->Step();
    const Value key = SortKey(in, item, attribute, case_sensitive, false);
    const size_t h = Hash(key);
    auto& bucket = index[h];
    bool dup = false;
    for (size_t i : bucket) dup = dup || Equal(seen[i], key);
    if (dup) continue;
    bucket.push_back(seen.size());
    seen.push_back(key);
    out.push_back(item);
  }
  return in->MakeSeq(SeqKind::kGenerator, std::move(out));
}

// min, max.
Value FilterMinMax(Interp* in, std::string_view name, const Value& value, const Args& args) {
  const Value none = Value::None();
  Bound b(name, args, {"case_sensitive", "attribute"});
  const bool case_sensitive = b.Has(0) && Truthy(*b.Get(0));
  const Value& attribute = b.Or(1, none);
  const std::vector<Value> items = Iterate(value);
  if (items.empty()) return Value::Undefined("No aggregated item, sequence was empty.");
  size_t best = 0;
  Value best_key = SortKey(in, items[0], attribute, case_sensitive, false);
  for (size_t i = 1; i < items.size(); ++i) {
    Value k = SortKey(in, items[i], attribute, case_sensitive, false);
    if (name == "min" ? Less(k, best_key) : Less(best_key, k)) {
      best = i;
      best_key = std::move(k);
    }
  }
  return items[best];
}

Value FilterSum(Interp* in, std::string_view name, const Value& value, const Args& args) {
  const Value none = Value::None();
  Bound b(name, args, {"attribute", "start"});
  const Value& attribute = b.Or(0, none);
  Value rv = b.Has(1) ? *b.Get(1) : Value::Int(0);
  for (const Value& item : Iterate(value)) {
    in->Step();
    rv = in->Arith(BinOp::kAdd, rv, attribute.is_none() ? item : in->AttrPath(item, attribute));
  }
  return rv;
}

Value FilterBatch(Interp* in, std::string_view name, const Value& value, const Args& args) {
  const Value none = Value::None();
  Bound b(name, args, {"linecount", "fill_with"});
  if (!b.Has(0)) ThrowTypeError("do_batch() missing 1 required positional argument: 'linecount'");
  const int64_t count = RequireInt(*b.Get(0), "linecount");
  const Value& fill = b.Or(1, none);
  std::vector<Value> out, tmp;
  for (const Value& item : Iterate(value)) {
    if (static_cast<int64_t>(tmp.size()) == count) {
      out.push_back(Value::List(std::move(tmp)));
      tmp.clear();
    }
    tmp.push_back(item);
  }
  if (!tmp.empty()) {
    if (!fill.is_none()) {
      while (static_cast<int64_t>(tmp.size()) < count) {
        in->Step();
        tmp.push_back(fill);
      }
    }
    out.push_back(Value::List(std::move(tmp)));
  }
  return in->MakeSeq(SeqKind::kGenerator, std::move(out));
}

Value FilterSlice(Interp* in, std::string_view name, const Value& value, const Args& args) {
  const Value none = Value::None();
  Bound b(name, args, {"slices", "fill_with"});
  if (!b.Has(0)) ThrowTypeError("do_slice() missing 1 required positional argument: 'slices'");
  const int64_t slices = RequireInt(*b.Get(0), "slices");
  if (slices > 100000) in->StepLimit();
  const Value& fill = b.Or(1, none);
  const std::vector<Value> seq = Iterate(value);
  const auto length = static_cast<int64_t>(seq.size());
  if (slices <= 0) {
    if (slices == 0) ThrowRuntime("ZeroDivisionError", "integer division or modulo by zero");
    return in->MakeSeq(SeqKind::kGenerator, {});
  }
  const int64_t per = length / slices, extra = length % slices;
  int64_t offset = 0;
  std::vector<Value> out;
  for (int64_t k = 0; k < slices; ++k) {
    in->Step();
    const int64_t start = offset + k * per;
    if (k < extra) ++offset;
    const int64_t end = offset + (k + 1) * per;
    std::vector<Value> tmp(seq.begin() + start, seq.begin() + end);
    if (!fill.is_none() && k >= extra) tmp.push_back(fill);
    out.push_back(Value::List(std::move(tmp)));
  }
  return in->MakeSeq(SeqKind::kGenerator, std::move(out));
}

Value FilterCenter(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {"width"});
  Args a;
  a.pos.push_back(b.Has(0) ? *b.Get(0) : Value::Int(80));
  return in->CallMethod(SoftStr(in, value), "center", a);
}

// format: str(value) % args, args positional or keyword.
Value FilterFormat(Interp* in, std::string_view name, const Value& value, const Args& args) {
  if (!args.pos.empty() && !args.kw.empty()) {
    FilterArgumentError("can't handle positional and keyword arguments at the same time");
  }
  Value fargs;
  if (!args.kw.empty()) {
    auto d = std::make_shared<DictObj>();
    for (const auto& [k, v] : args.kw) d->Set(Value::Str(k), v);
    fargs = Value::Dict(std::move(d));
  } else {
    fargs = Value::Tuple(args.pos);
  }
  const Value s = SoftStr(in, value);
  return in->MakeStr(PercentFormat(in, s.str(), fargs), s.safe());
}

Value FilterAttr(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {"name"});
  if (!b.Has(0)) ThrowTypeError("do_attr() missing 1 required positional argument: 'name'");
  if (value.is_undefined()) Interp::ThrowUndefined(value);
  const std::string attr = ToStr(*b.Get(0));
  if (auto v = in->PyAttr(value, attr)) return *v;
  return Value::Undefined(
      Cat(ReprString(ObjectTypeRepr(value)), " has no attribute ", ReprString(attr)));
}

Value FilterWordcount(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {});
  const Value s = SoftStr(in, value);
  int64_t count = 0;
  bool in_word = false;
  size_t pos = 0;
  while (pos < s.str().size()) {
    const char32_t c = DecodeUtf8At(s.str(), &pos);
    const bool w = c == '_' || IsAlnum(c);
    if (w && !in_word) ++count;
    in_word = w;
  }
  return Value::Int(count);
}

Value FilterTruncate(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {"length", "killwords", "end", "leeway"});
  const int64_t length = b.Has(0) ? RequireInt(*b.Get(0), "length") : 255;
  const bool killwords = b.Has(1) && Truthy(*b.Get(1));
  const std::string end = b.Has(2) ? ToStr(*b.Get(2)) : "...";
  const int64_t leeway = b.Has(3) && !b.Get(3)->is_none() ? RequireInt(*b.Get(3), "leeway") : 5;
  const auto end_len = static_cast<int64_t>(CodePointCount(end));
  if (length < end_len)
    ThrowRuntime("AssertionError", Cat("expected length >= ", end_len, ", got ", length));
  if (leeway < 0) ThrowRuntime("AssertionError", Cat("expected leeway >= 0, got ", leeway));
  if (Len(value) <= length + leeway) return value;
  const std::u32string cps = DecodeUtf8(RequireStr(value, "truncate"));
  const std::string head =
      EncodeUtf8(std::u32string_view(cps).substr(0, static_cast<size_t>(length - end_len)));
  if (killwords) return in->MakeStr(head + end);
  const size_t space = head.rfind(' ');
  return in->MakeStr((space == std::string::npos ? head : head.substr(0, space)) + end);
}

Value FilterPprint(Interp* in, std::string_view name, const Value& value, const Args& args) {
  Bound b(name, args, {});
  return in->MakeStr(Repr(value));
}

// What ApplyFilter does around a filter besides calling it.
enum FilterTraits : int {
  // jinja2 runs it only when its result is iterated (it is a generator): its
  // failure waits until then.
  kGenerator = 1,
  // It takes jinja2's context, so jinja2 never folds it into a constant.
  kContextual = 2,
};

struct FilterEntry {
  std::string_view name;
  FilterFn fn;  // null: a jinja2 filter chat templates cannot use
  int traits = 0;
};

// Every jinja2 filter, sorted by name: the parser refuses the names not here
// (IsKnownFilter), as jinja2 does when it compiles a template.
constexpr FilterEntry kFilters[] = {
    {"abs", FilterAbs},
    {"attr", FilterAttr},
    {"batch", FilterBatch, kGenerator},
    {"capitalize", FilterConvert<PyCapitalize>},
    {"center", FilterCenter},
    {"count", FilterLength},
    {"d", FilterDefault},
    {"default", FilterDefault},
    {"dictsort", FilterDictsort},
    {"e", FilterEscape},
    {"escape", FilterEscape},
    {"filesizeformat", nullptr},
    {"first", FilterFirst},
    {"float", FilterFloat},
    {"forceescape", FilterForceescape},
    {"format", FilterFormat},
    {"groupby", nullptr},
    {"indent", FilterIndent},
    {"int", FilterInt},
    {"items", FilterItems, kGenerator},
    {"join", FilterJoin},
    {"last", FilterLast},
    {"length", FilterLength},
    {"list", FilterList},
    {"lower", FilterConvert<PyLower>},
    {"map", FilterMap, kGenerator | kContextual},
    {"max", FilterMinMax},
    {"min", FilterMinMax},
    {"pprint", FilterPprint},
    {"random", nullptr, kContextual},
    {"reject", FilterSelect, kGenerator | kContextual},
    {"rejectattr", FilterSelect, kGenerator | kContextual},
    {"replace", FilterReplace},
    {"reverse", FilterReverse},
    {"round", FilterRound},
    {"safe", FilterSafe},
    {"select", FilterSelect, kGenerator | kContextual},
    {"selectattr", FilterSelect, kGenerator | kContextual},
    {"slice", FilterSlice, kGenerator},
    {"sort", FilterSort},
    {"string", FilterString},
    {"striptags", nullptr},
    {"sum", FilterSum},
    {"title", FilterTitle},
    {"tojson", FilterTojson},
    {"trim", FilterTrim},
    {"truncate", FilterTruncate},
    {"unique", FilterUnique, kGenerator},
    {"upper", FilterConvert<PyUpper>},
    {"urlencode", nullptr},
    {"urlize", nullptr},
    {"wordcount", FilterWordcount},
    {"wordwrap", nullptr},
    {"xmlattr", nullptr},
};
static_assert(StrictlySortedByName(kFilters));

// Calls `filter` (the entry named `name`, or null for a name jinja2 does not
// know).
Value RunFilter(Interp* in, const FilterEntry* filter, std::string_view name, const Value& value,
                const Args& args) {
  if (filter == nullptr) {
    ThrowRuntime("TemplateRuntimeError", Cat("No filter named ", ReprString(name), "."));
  }
  if (filter->fn == nullptr) NotSupported(Cat("the '", name, "' filter"));
  return filter->fn(in, name, value, args);
}

}  // namespace

bool IsKnownFilter(std::string_view name) { return FindByName(kFilters, name) != nullptr; }

Value Interp::ApplyFilter(std::string_view name, const Value& value, const Args& args) {
  const FilterEntry* filter = FindByName(kFilters, name);
  const int traits = filter != nullptr ? filter->traits : 0;
  if (const_mode_ && (traits & kContextual)) NotConstant();
  // jinja2's generator filters run only when their result is iterated: a
  // failure becomes the generator's deferred error (a template that only
  // tests the generator's truth, always true, never sees it).
  if (traits & kGenerator) {
    try {
      return RunFilter(this, filter, name, value, args);
    } catch (Error& e) {
      if (e.kind != Error::Kind::kRuntime) throw;
      if (e.line == 0) e.line = line_;
      auto deferred = std::make_shared<const Error>(std::move(e));
      Value v = MakeSeq(SeqKind::kGenerator, {});
      v.seq_mutable().deferred = std::move(deferred);
      return v;
    }
  }
  return RunFilter(this, filter, name, value, args);
}

}  // namespace coalesce::chat::jinja
