// Python's number parsing and its two string formattings, as templates use
// them: int() and float() of strings, round(), the % operator
// (PercentFormat, jinja_interp.h) and str.format with format specs.
#include "chat/jinja_format.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "chat/jinja_builtins.h"
#include "chat/jinja_interp.h"
#include "chat/jinja_unicode.h"

namespace coalesce::chat::jinja {

namespace {

std::string GroupDigits(const std::string& digits, char sep) {
  std::string out;
  const size_t n = digits.size();
  for (size_t i = 0; i < n; ++i) {
    out.push_back(digits[i]);
    const size_t left = n - 1 - i;
    if (left > 0 && left % 3 == 0) out.push_back(sep);
  }
  return out;
}

struct FormatSpec {
  char32_t fill = ' ';
  char align = 0;  // < > ^ =
  char sign = '-';
  bool alt = false;
  bool zero = false;
  int64_t width = -1;
  char grouping = 0;
  int64_t precision = -1;
  char type = 0;
};

FormatSpec ParseSpec(std::string_view spec) {
  FormatSpec f;
  const std::u32string s = DecodeUtf8(spec);
  size_t i = 0;
  auto is_align = [](char32_t c) { return c == '<' || c == '>' || c == '^' || c == '='; };
  if (s.size() >= 2 && is_align(s[1])) {
    f.fill = s[0];
    f.align = static_cast<char>(s[1]);
    i = 2;
  } else if (!s.empty() && is_align(s[0])) {
    f.align = static_cast<char>(s[0]);
    i = 1;
  }
  if (i < s.size() && (s[i] == '+' || s[i] == '-' || s[i] == ' '))
    f.sign = static_cast<char>(s[i++]);
  if (i < s.size() && s[i] == '#') {
    f.alt = true;
    ++i;
  }
  if (i < s.size() && s[i] == '0') {
    f.zero = true;
    ++i;
  }
  auto number = [&]() -> int64_t {
    int64_t v = -1;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
      v = (v < 0 ? 0 : v) * 10 + (s[i] - '0');
      if (v > 100000) ValueError("Too many decimal digits in format string");
      ++i;
    }
    return v;
  };
  f.width = number();
  if (i < s.size() && (s[i] == ',' || s[i] == '_')) f.grouping = static_cast<char>(s[i++]);
  if (i < s.size() && s[i] == '.') {
    ++i;
    f.precision = number();
    if (f.precision < 0) ValueError("Format specifier missing precision");
  }
  if (i < s.size()) f.type = static_cast<char>(s[i++]);
  if (i < s.size()) ValueError("Invalid format specifier");
  if (f.zero && f.align == 0) {
    f.fill = '0';
    f.align = '=';
  }
  return f;
}

std::string ApplyAlign(const std::string& sign_prefix, const std::string& body, const FormatSpec& f,
                       char default_align) {
  const char align = f.align == 0 ? default_align : f.align;
  const int64_t len = static_cast<int64_t>(CodePointCount(sign_prefix) + CodePointCount(body));
  if (f.width <= len) return sign_prefix + body;
  if (align == '=') {
    std::string fill;
    for (int64_t k = 0; k < f.width - len; ++k) AppendUtf8(&fill, f.fill);
    return sign_prefix + fill + body;
  }
  return Pad(sign_prefix + body, f.width, f.fill, align);
}

std::string FormatFloatType(double x, char type, int64_t precision, bool alt) {
  if (std::isnan(x) || std::isinf(x)) {
    std::string s = std::isnan(x) ? "nan" : "inf";
    if (type == 'E' || type == 'F' || type == 'G') s = PyUpper(s);
    return s;
  }
  const int p = static_cast<int>(std::min<int64_t>(precision < 0 ? 6 : precision, 400));
  std::vector<char> buf(static_cast<size_t>(p) + 420);
  char fmt[16];
  std::snprintf(fmt, sizeof(fmt), "%%%s.*%c", alt ? "#" : "", type);
  std::snprintf(buf.data(), buf.size(), fmt, p, x);
  return buf.data();
}

// format(value, spec) for str, int, float, bool (the built-in __format__s).
std::string FormatValue(const Value& v, std::string_view spec_text) {
  if (spec_text.empty()) return ToStr(v);
  const FormatSpec f = ParseSpec(spec_text);
  if (v.is_string()) {
    if (f.type != 0 && f.type != 's') {
      ValueError(
          Cat("Unknown format code '", std::string(1, f.type), "' for object of type 'str'"));
    }
    std::string s = v.str();
    if (f.precision >= 0) {
      const std::u32string cps = DecodeUtf8(s);
      if (static_cast<int64_t>(cps.size()) > f.precision) {
        s = EncodeUtf8(std::u32string_view(cps).substr(0, static_cast<size_t>(f.precision)));
      }
    }
    if (f.align == '=') ValueError("'=' alignment not allowed in string format specifier");
    return ApplyAlign("", s, f, '<');
  }
  if (v.is_intlike() && (f.type == 0 || f.type == 'd' || f.type == 'n' || f.type == 'x' ||
                         f.type == 'X' || f.type == 'o' || f.type == 'b' || f.type == 'c')) {
    const int64_t x = v.int_value();
    if (f.type == 'c') {
      std::string s;
      AppendUtf8(&s, static_cast<char32_t>(x));
      return ApplyAlign("", s, f, '<');
    }
    if (f.precision >= 0) ValueError("Precision not allowed in integer format specifier");
    const bool neg = x < 0;
    const unsigned long long mag =
        neg ? static_cast<unsigned long long>(-(x + 1)) + 1 : static_cast<unsigned long long>(x);
    std::string digits;
    std::string_view prefix;  // a view: GCC 12 misreads assigning literals to a string here
    int base = 10;
    if (f.type == 'x' || f.type == 'X') base = 16, prefix = f.type == 'x' ? "0x" : "0X";
    if (f.type == 'o') base = 8, prefix = "0o";
    if (f.type == 'b') base = 2, prefix = "0b";
    if (mag == 0) digits = "0";
    for (unsigned long long m = mag; m > 0; m /= static_cast<unsigned>(base)) {
      const int d = static_cast<int>(m % static_cast<unsigned>(base));
      digits.push_back(static_cast<char>(d < 10 ? '0' + d : (f.type == 'X' ? 'A' : 'a') + d - 10));
    }
    std::reverse(digits.begin(), digits.end());  // least significant digit first above
    if (f.grouping != 0) digits = GroupDigits(digits, f.grouping);
    std::string sign = neg ? "-" : (f.sign == '+' ? "+" : (f.sign == ' ' ? " " : ""));
    if (f.alt && base != 10) sign += prefix;
    return ApplyAlign(sign, digits, f, '>');
  }
  if (v.is_number()) {
    double x = v.float_value();
    char type = f.type;
    if (type != 0 && type != 'e' && type != 'E' && type != 'f' && type != 'F' && type != 'g' &&
        type != 'G' && type != '%' && type != 'n') {
      ValueError(Cat("Unknown format code '", std::string(1, type), "' for object of type '",
                     PyTypeName(v), "'"));
    }
    const bool neg = std::signbit(x) && !std::isnan(x);
    x = std::fabs(x);
    std::string body;
    if (type == '%') {
      body = FormatFloatType(x * 100, 'f', f.precision, f.alt) + "%";
    } else if (type == 0 && f.precision < 0) {
      body = v.is_intlike() ? std::to_string(v.int_value() < 0 ? -v.int_value() : v.int_value())
                            : FloatRepr(x);
    } else if (type == 0) {
      body = FormatFloatType(x, 'g', std::max<int64_t>(f.precision, 1), f.alt);
      if (body.find_first_of(".en") == std::string::npos) body += ".0";
    } else {
      body = FormatFloatType(x, type == 'n' ? 'g' : type, f.precision, f.alt);
    }
    if (f.grouping != 0) {
      const size_t end = body.find_first_not_of("0123456789");
      const std::string int_part = body.substr(0, end);
      body = GroupDigits(int_part, f.grouping) + (end == std::string::npos ? "" : body.substr(end));
    }
    const std::string sign = neg ? "-" : (f.sign == '+' ? "+" : (f.sign == ' ' ? " " : ""));
    return ApplyAlign(sign, body, f, '>');
  }
  ThrowTypeError(Cat("unsupported format string passed to ", PyTypeName(v), ".__format__"));
}

// One conversion of Python's %-formatting: its flags ("-+ #0"), width and
// precision (-1 when absent).
struct PercentSpec {
  std::string flags;
  int64_t width = -1, precision = -1;
};

// `body` padded to the width: on the right with '-', with zeros after the
// sign with '0' when it is a number, else on the left.
std::string PercentPad(const std::string& body, bool numeric, const PercentSpec& spec) {
  const bool left = spec.flags.find('-') != std::string::npos;
  const bool zero = spec.flags.find('0') != std::string::npos && !left;
  const auto len = static_cast<int64_t>(CodePointCount(body));
  if (spec.width <= len) return body;
  const size_t n = static_cast<size_t>(spec.width - len);
  if (left) return body + std::string(n, ' ');
  if (zero && numeric) {
    const size_t sign =
        !body.empty() && (body[0] == '-' || body[0] == '+' || body[0] == ' ') ? 1 : 0;
    return body.substr(0, sign) + std::string(n, '0') + body.substr(sign);
  }
  return std::string(n, ' ') + body;
}

// The flags passed on to snprintf: all but '0' and '-', which PercentPad
// applies (counting code points, not bytes).
std::string PrintfFlags(const PercentSpec& spec) {
  std::string out;
  for (char f : spec.flags) {
    if (f != '0' && f != '-') out.push_back(f);
  }
  return out;
}

// %s, %r, %a.
std::string PercentText(char conv, const Value& arg, const PercentSpec& spec) {
  std::string s = conv == 's' ? ToStr(arg) : Repr(arg);
  if (spec.precision >= 0) {
    const std::u32string cps = DecodeUtf8(s);
    if (static_cast<int64_t>(cps.size()) > spec.precision) {
      s = EncodeUtf8(std::u32string_view(cps).substr(0, static_cast<size_t>(spec.precision)));
    }
  }
  return PercentPad(s, false, spec);
}

// %d, %i, %u, %o, %x, %X.
std::string PercentInt(char conv, const Value& arg, const PercentSpec& spec) {
  int64_t v;
  if (arg.is_intlike()) {
    v = arg.int_value();
  } else if (arg.type() == Type::kFloat && (conv == 'd' || conv == 'i' || conv == 'u')) {
    v = TruncToInt(arg.float_value());
  } else {
    ThrowTypeError(Cat("%", std::string(1, conv), " format: ",
                       conv == 'd' || conv == 'i' || conv == 'u' ? "a real number" : "an integer",
                       " is required, not ", PyTypeName(arg)));
  }
  char fmt[32], buf[128];
  const char c2 = conv == 'i' || conv == 'u' ? 'd' : conv;
  std::string cf = PrintfFlags(spec);
  if (conv == 'o') cf.erase(std::remove(cf.begin(), cf.end(), '#'), cf.end());
  std::snprintf(fmt, sizeof(fmt), "%%%s.%dll%c", cf.c_str(),
                static_cast<int>(std::min<int64_t>(spec.precision < 0 ? 1 : spec.precision, 100)),
                c2);
  std::snprintf(buf, sizeof(buf), fmt, static_cast<long long>(v));
  std::string body = buf;
  // Python's alternate octal form is 0o17, C's 017.
  if (conv == 'o' && spec.flags.find('#') != std::string::npos) {
    const size_t sign =
        !body.empty() && (body[0] == '-' || body[0] == '+' || body[0] == ' ') ? 1 : 0;
    body.insert(sign, "0o");
  }
  return PercentPad(body, true, spec);
}

// %e, %E, %f, %F, %g, %G.
std::string PercentFloat(char conv, const Value& arg, const PercentSpec& spec) {
  if (!arg.is_number()) {
    if (arg.is_undefined()) Interp::ThrowUndefined(arg);
    ThrowTypeError(Cat("must be real number, not ", PyTypeName(arg)));
  }
  const double x = arg.float_value();
  const int p = static_cast<int>(std::min<int64_t>(spec.precision < 0 ? 6 : spec.precision, 400));
  std::vector<char> buf(static_cast<size_t>(p) + 420);
  char fmt[32];
  std::snprintf(fmt, sizeof(fmt), "%%%s.*%c", PrintfFlags(spec).c_str(), conv);
  std::snprintf(buf.data(), buf.size(), fmt, p, x);
  return PercentPad(buf.data(), std::isfinite(x), spec);
}

// %c: a code point, or a str of one.
std::string PercentChar(const Value& arg, const PercentSpec& spec) {
  std::string s;
  if (arg.is_intlike()) {
    if (arg.int_value() < 0 || arg.int_value() > 0x10FFFF) {
      ThrowRuntime("OverflowError", "%c arg not in range(0x110000)");
    }
    AppendUtf8(&s, static_cast<char32_t>(arg.int_value()));
  } else if (arg.is_string() && CodePointCount(arg.str()) == 1) {
    s = arg.str();
  } else {
    ThrowTypeError("%c requires int or char");
  }
  return PercentPad(s, false, spec);
}

std::string PercentConvert(char conv, const Value& arg, const PercentSpec& spec) {
  switch (conv) {
    case 's':
    case 'r':
    case 'a':
      return PercentText(conv, arg, spec);
    case 'd':
    case 'i':
    case 'u':
    case 'o':
    case 'x':
    case 'X':
      return PercentInt(conv, arg, spec);
    case 'e':
    case 'E':
    case 'f':
    case 'F':
    case 'g':
    case 'G':
      return PercentFloat(conv, arg, spec);
    case 'c':
      return PercentChar(arg, spec);
    default:
      ValueError(Cat("unsupported format character ", ReprString(std::string(1, conv))));
  }
}

}  // namespace

std::string PercentFormat(Interp* in, std::string_view format, const Value& args) {
  std::vector<Value> items;
  const Value* mapping = nullptr;
  // Python: a tuple is the arguments; anything else is one argument, and one
  // that can be subscripted (a dict, but also a list) silences the "not all
  // arguments converted" check.
  bool subscriptable = false;
  if (args.is_seq() && args.seq_kind() == SeqKind::kTuple) {
    items = args.seq().items;
  } else {
    items.push_back(args);
    if (args.is_dict()) mapping = &args;
    subscriptable = args.is_dict() || args.is_undefined() ||
                    (args.is_seq() &&
                     (args.seq_kind() == SeqKind::kList || args.seq_kind() == SeqKind::kRange));
  }
  size_t next = 0;
  bool used_mapping = false;
  std::string out;
  auto take = [&]() -> const Value& {
    if (next >= items.size()) ThrowTypeError("not enough arguments for format string");
    return items[next++];
  };
  size_t i = 0;
  while (i < format.size()) {
    const char c = format[i];
    if (c != '%') {
      out.push_back(c);
      ++i;
      continue;
    }
    ++i;
    if (i >= format.size()) ValueError("incomplete format");
    const Value* arg = nullptr;
    if (format[i] == '(') {
      if (args.is_undefined()) Interp::ThrowUndefined(args);
      if (mapping == nullptr) ThrowTypeError("format requires a mapping");
      size_t depth = 1, k = i + 1;
      while (k < format.size() && depth > 0) {
        if (format[k] == '(') ++depth;
        if (format[k] == ')') --depth;
        ++k;
      }
      if (depth != 0) ValueError("incomplete format key");
      const std::string key(format.substr(i + 1, k - i - 2));
      arg = mapping->dict().FindStr(key);
      if (arg == nullptr) ThrowRuntime("KeyError", ReprString(key));
      used_mapping = true;
      i = k;
    }
    PercentSpec spec;
    while (i < format.size() &&
           std::string_view("-+ #0").find(format[i]) != std::string_view::npos) {
      spec.flags.push_back(format[i++]);
    }
    auto number = [&](int64_t* v) {
      if (i < format.size() && format[i] == '*') {
        *v = RequireInt(take(), "* width");
        ++i;
        return;
      }
      while (i < format.size() && format[i] >= '0' && format[i] <= '9') {
        *v = (*v < 0 ? 0 : *v) * 10 + (format[i++] - '0');
        if (*v > 100000) ValueError("width too big");
      }
    };
    number(&spec.width);
    if (i < format.size() && format[i] == '.') {
      ++i;
      spec.precision = 0;
      number(&spec.precision);
    }
    while (i < format.size() && (format[i] == 'h' || format[i] == 'l' || format[i] == 'L')) ++i;
    if (i >= format.size()) ValueError("incomplete format");
    const char conv = format[i++];
    if (conv == '%') {
      out.push_back('%');
      continue;
    }
    if (arg == nullptr) arg = &take();
    if (arg->is_undefined() && conv != 's' && conv != 'r' && conv != 'a') {
      Interp::ThrowUndefined(*arg);
    }
    out += PercentConvert(conv, *arg, spec);
    if (out.size() > in->limits().max_output_bytes) in->MakeStr(out);  // throws
  }
  if (!used_mapping && !subscriptable && next < items.size()) {
    ThrowTypeError("not all arguments converted during string formatting");
  }
  return out;
}

namespace {}  // namespace

// Python's int(str, 10): optional whitespace and sign, digits with single
// underscores between them.
bool ParsePyInt(std::string_view s, int base, int64_t* out) {
  std::string t = Strip(s, nullptr, 0);
  size_t i = 0;
  bool neg = false;
  if (i < t.size() && (t[i] == '+' || t[i] == '-')) neg = t[i++] == '-';
  if (base == 0 || base == 16 || base == 8 || base == 2) {
    if (i + 1 < t.size() && t[i] == '0') {
      const char p = static_cast<char>(t[i + 1] | 0x20);
      if ((p == 'x' && (base == 0 || base == 16)) || (p == 'o' && (base == 0 || base == 8)) ||
          (p == 'b' && (base == 0 || base == 2))) {
        base = p == 'x' ? 16 : (p == 'o' ? 8 : 2);
        i += 2;
        if (i < t.size() && t[i] == '_') ++i;
      }
    }
    if (base == 0) base = 10;
  }
  if (base < 2 || base > 36) return false;
  if (i >= t.size()) return false;
  unsigned __int128 v = 0;
  bool prev_digit = false;
  for (; i < t.size(); ++i) {
    const char c = t[i];
    if (c == '_') {
      if (!prev_digit || i + 1 >= t.size()) return false;
      prev_digit = false;
      continue;
    }
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') {
      d = (c | 0x20) - 'a' + 10;
    } else {
      return false;
    }
    if (d >= base) return false;
    v = v * static_cast<unsigned>(base) + static_cast<unsigned>(d);
    if (v > static_cast<unsigned __int128>(std::numeric_limits<int64_t>::max()) + 1) {
      ThrowRuntime("OverflowError", "integer out of the 64-bit range of chat templates");
    }
    prev_digit = true;
  }
  if (!prev_digit) return false;
  if (!neg && v > static_cast<unsigned __int128>(std::numeric_limits<int64_t>::max())) {
    ThrowRuntime("OverflowError", "integer out of the 64-bit range of chat templates");
  }
  *out = neg ? static_cast<int64_t>(-v) : static_cast<int64_t>(v);
  return true;
}

// Python's float(str).
bool ParsePyFloat(std::string_view s, double* out) {
  std::string t = Strip(s, nullptr, 0);
  std::string lower = PyLower(t);
  size_t i = 0;
  double sign = 1;
  if (i < lower.size() && (lower[i] == '+' || lower[i] == '-')) sign = lower[i++] == '-' ? -1 : 1;
  const std::string_view rest = std::string_view(lower).substr(i);
  if (rest == "inf" || rest == "infinity") {
    *out = sign * std::numeric_limits<double>::infinity();
    return true;
  }
  if (rest == "nan") {
    *out = std::numeric_limits<double>::quiet_NaN();
    return true;
  }
  // digits [. digits] [e [+-] digits], with single underscores between digits.
  std::string clean;
  bool digits = false, prev_digit = false;
  for (size_t k = 0; k < t.size(); ++k) {
    const char c = t[k];
    if (c == '_') {
      if (!prev_digit || k + 1 >= t.size() || !(t[k + 1] >= '0' && t[k + 1] <= '9')) return false;
      prev_digit = false;
      continue;
    }
    const bool is_digit = c >= '0' && c <= '9';
    if (!is_digit && c != '.' && c != 'e' && c != 'E' && c != '+' && c != '-') return false;
    digits |= is_digit;
    prev_digit = is_digit;
    clean.push_back(c);
  }
  if (!digits) return false;
  char* end = nullptr;
  const double v = std::strtod(clean.c_str(), &end);
  if (end != clean.c_str() + clean.size()) return false;
  *out = v;
  return true;
}

// The integer value of a number for int(): truncates floats.
int64_t TruncToInt(double f) {
  if (std::isnan(f)) ValueError("cannot convert float NaN to integer");
  if (std::isinf(f)) ThrowRuntime("OverflowError", "cannot convert float infinity to integer");
  const double t = std::trunc(f);
  if (t >= 9.2233720368547758e18 || t < -9.2233720368547758e18) {
    ThrowRuntime("OverflowError", "integer out of the 64-bit range of chat templates");
  }
  return static_cast<int64_t>(t);
}

// Python's round(x, ndigits) for a float.
double PyRound(double x, int64_t ndigits) {
  if (!std::isfinite(x)) return x;
  if (ndigits > 323) return x;
  if (ndigits < -308) return std::copysign(0.0, x);
  if (ndigits >= 0) {
    std::vector<char> buf(static_cast<size_t>(ndigits) + 400);
    std::snprintf(buf.data(), buf.size(), "%.*f", static_cast<int>(ndigits), x);
    return std::strtod(buf.data(), nullptr);
  }
  const double p = std::pow(10.0, static_cast<double>(-ndigits));
  const double y = std::nearbyint(x / p) * p;
  return std::isfinite(y) ? y : x;
}

// str.format(*args, **kwargs), with jinja2's sandboxed attribute lookups.
std::string StrFormat(Interp* in, std::string_view format, const Args& args) {
  std::string out;
  size_t auto_index = 0;
  bool manual = false, automatic = false;
  size_t i = 0;
  while (i < format.size()) {
    const char c = format[i];
    if (c == '}') {
      if (i + 1 < format.size() && format[i + 1] == '}') {
        out.push_back('}');
        i += 2;
        continue;
      }
      ValueError("Single '}' encountered in format string");
    }
    if (c != '{') {
      out.push_back(c);
      ++i;
      continue;
    }
    if (i + 1 < format.size() && format[i + 1] == '{') {
      out.push_back('{');
      i += 2;
      continue;
    }
    // {field[!conv][:spec]}
    size_t k = i + 1;
    int depth = 1;
    while (k < format.size()) {
      if (format[k] == '{') ++depth;
      if (format[k] == '}' && --depth == 0) break;
      ++k;
    }
    if (k >= format.size()) ValueError("expected '}' before end of string");
    const std::string_view field = format.substr(i + 1, k - i - 1);
    i = k + 1;
    size_t name_end = field.find_first_of("!:");
    const std::string_view name = field.substr(0, name_end);
    char conv = 0;
    std::string_view spec;
    if (name_end != std::string_view::npos) {
      size_t rest = name_end;
      if (field[rest] == '!') {
        if (rest + 1 >= field.size())
          ValueError("end of string while looking for conversion specifier");
        conv = field[rest + 1];
        rest += 2;
        if (rest < field.size() && field[rest] != ':')
          ValueError("expected ':' after conversion specifier");
      }
      if (rest < field.size()) spec = field.substr(rest + 1);
    }
    if (spec.find('{') != std::string_view::npos)
      NotSupported("a nested replacement field in str.format");
    // The first part: an index, a keyword, or nothing (automatic numbering).
    const size_t first_end = name.find_first_of(".[");
    const std::string_view first = name.substr(0, first_end);
    Value v;
    if (first.empty()) {
      if (manual)
        ValueError("cannot switch from manual field specification to automatic field numbering");
      automatic = true;
      if (auto_index >= args.pos.size()) {
        ThrowRuntime("IndexError", Cat("Replacement index ", auto_index,
                                       " out of range for positional args tuple"));
      }
      v = args.pos[auto_index++];
    } else if (std::all_of(first.begin(), first.end(),
                           [](char ch) { return ch >= '0' && ch <= '9'; })) {
      if (automatic)
        ValueError("cannot switch from automatic field numbering to manual field specification");
      manual = true;
      const size_t idx = first.size() > 9 ? args.pos.size() : std::stoul(std::string(first));
      if (idx >= args.pos.size()) {
        ThrowRuntime("IndexError",
                     Cat("Replacement index ", first, " out of range for positional args tuple"));
      }
      v = args.pos[idx];
    } else {
      const Value* kw = args.Kw(first);
      if (kw == nullptr) ThrowRuntime("KeyError", ReprString(first));
      v = *kw;
    }
    // .attr and [key] parts.
    size_t p = first_end;
    while (p != std::string_view::npos && p < name.size()) {
      if (name[p] == '.') {
        const size_t e = name.find_first_of(".[", p + 1);
        v = in->GetAttr(v, name.substr(p + 1, e == std::string_view::npos ? e : e - p - 1));
        p = e;
      } else {
        const size_t e = name.find(']', p);
        if (e == std::string_view::npos) ValueError("Missing ']' in format string");
        const std::string key(name.substr(p + 1, e - p - 1));
        const bool digits =
            !key.empty() && key.size() < 18 &&
            std::all_of(key.begin(), key.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
        v = in->GetItem(v, digits ? Value::Int(std::stoll(key)) : Value::Str(key));
        p = e + 1;
      }
    }
    if (conv == 'r' || conv == 'a') {
      v = Value::Str(Repr(v));
    } else if (conv == 's') {
      v = Value::Str(ToStr(v));
    } else if (conv != 0) {
      ValueError(Cat("Unknown conversion specifier ", std::string(1, conv)));
    }
    out += FormatValue(v, spec);
    if (out.size() > in->limits().max_output_bytes) in->MakeStr(out);  // throws
  }
  return out;
}

}  // namespace coalesce::chat::jinja
