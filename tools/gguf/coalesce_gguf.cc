// coalesce-gguf: what engine/model/gguf_file.h reads from a GGUF file, for
// people and for tests/engine/model/test_gguf_parity.py, which compares it
// with PyPI's `gguf` package.
//
//   coalesce-gguf FILE                          the metadata and tensor table as JSON
//   coalesce-gguf --dequantize=NAME FILE        tensor NAME as float32 (--output, default stdout)
//   coalesce-gguf --dequantize_all FILE         every tensor that can be dequantized, in
//                                               table order, one after the other
//
// The JSON (one object, to stdout):
//   {"path", "version", "alignment", "data_offset", "file_size",
//    "metadata": [{"key", "type", "value"} or, for arrays,
//                 {"key", "type": "array", "item_type", "value": [items]}],
//    "tensors": [{"name", "type", "type_id", "dims" (ggml order: dims[0] varies
//                 fastest), "offset" (in the data section), "num_elements",
//                 "num_bytes", "dequantize" (whether it can be)}]}
// Items of an array of arrays are {"type": "array", "item_type", "value"}.
// Integers are printed exactly (uint64 and int64 included); a float32 or
// float64 as the shortest decimal that reads back as the same double (a
// float32 is widened first, exactly), always with a "." or an exponent, or
// as one of the strings "NaN",
// "Infinity", "-Infinity". Strings are UTF-8; a byte that is not part of
// valid UTF-8 becomes U+FFFD.
//
// Dequantized values are raw little-endian float32. Errors go to stderr with
// exit status 1 (2 for bad usage).
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/flag.h"
#include "common/flags.h"
#include "engine/model/gguf_file.h"
#include "engine/model/gguf_quant.h"

ABSL_FLAG(std::string, dequantize, "",
          "Write this tensor's values, dequantized to float32, to --output instead of printing "
          "the JSON.");
ABSL_FLAG(bool, dequantize_all, false,
          "Write every tensor whose type can be dequantized, in table order, to --output instead "
          "of printing the JSON.");
ABSL_FLAG(std::string, output, "-", "Where dequantized values go: a file, or - for stdout.");

namespace coalesce::engine {
namespace {

void AppendJsonString(std::string& out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out.push_back('"');
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      if (c == '"' || c == '\\') {
        out.push_back('\\');
        out.push_back(static_cast<char>(c));
      } else if (c < 0x20 || c == 0x7F) {
        out.append("\\u00");
        out.push_back(kHex[c >> 4]);
        out.push_back(kHex[c & 15]);
      } else {
        out.push_back(static_cast<char>(c));
      }
      ++i;
      continue;
    }
    // A multi-byte sequence: its length from the lead byte, then the
    // continuation bytes, no overlong forms, no surrogates, nothing past
    // U+10FFFF.
    size_t n = 0;
    uint32_t cp = 0;
    if (c >= 0xC2 && c <= 0xDF) {
      n = 2;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      n = 3;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 4;
      cp = c & 0x07;
    }
    bool valid = n > 0 && i + n <= s.size();
    for (size_t k = 1; valid && k < n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) valid = false;
      cp = cp << 6 | (cc & 0x3F);
    }
    if (valid && ((n == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) ||
                  (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)))) {
      valid = false;
    }
    if (valid) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out.append("\\ufffd");
      ++i;
    }
  }
  out.push_back('"');
}

void AppendDouble(std::string& out, double v) {
  if (std::isnan(v)) {
    out.append("\"NaN\"");
  } else if (std::isinf(v)) {
    out.append(v > 0 ? "\"Infinity\"" : "\"-Infinity\"");
  } else {
    char buf[64];
    const auto r = std::to_chars(buf, buf + sizeof buf, v);
    const std::string_view text(buf, r.ptr - buf);
    out.append(text);
    // "-0" or "3" would read back as an integer (losing -0.0's sign).
    if (text.find_first_of(".e") == std::string_view::npos) out.append(".0");
  }
}

// A scalar or string value (not an array).
void AppendScalar(std::string& out, const GgufValue& v) {
  switch (v.type()) {
    case GgufValueType::kString:
      AppendJsonString(out, *v.AsString());
      return;
    case GgufValueType::kBool:
      out.append(*v.AsBool() ? "true" : "false");
      return;
    case GgufValueType::kFloat32:
    case GgufValueType::kFloat64:
      AppendDouble(out, *v.AsFloat());
      return;
    case GgufValueType::kUint64:
      out.append(std::to_string(*v.AsUint()));
      return;
    default:
      out.append(std::to_string(*v.AsInt()));
      return;
  }
}

// `"item_type": ..., "value": [...]` of an array.
void AppendArrayFields(std::string& out, const GgufValue& v) {
  out.append("\"item_type\": \"");
  out.append(GgufValueTypeName(v.item_type()));
  out.append("\", \"value\": [");
  for (uint64_t i = 0; i < v.size(); ++i) {
    if (i > 0) out.append(", ");
    if (v.item_type() == GgufValueType::kArray) {
      out.append("{\"type\": \"array\", ");
      AppendArrayFields(out, v.arrays()[i]);
      out.append("}");
    } else if (v.item_type() == GgufValueType::kString) {
      AppendJsonString(out, v.strings()[i]);
    } else {
      AppendScalar(out, v.At(i));
    }
  }
  out.append("]");
}

std::string ToJson(const GgufFile& file) {
  std::string out = "{\"path\": ";
  AppendJsonString(out, file.path());
  out.append(", \"version\": " + std::to_string(file.version()));
  out.append(", \"alignment\": " + std::to_string(file.alignment()));
  out.append(", \"data_offset\": " + std::to_string(file.data_offset()));
  out.append(", \"file_size\": " + std::to_string(file.file_size()));
  out.append(",\n\"metadata\": [");
  bool first = true;
  for (const GgufKeyValue& kv : file.metadata()) {
    out.append(first ? "\n" : ",\n");
    first = false;
    out.append("{\"key\": ");
    AppendJsonString(out, kv.key);
    out.append(", \"type\": \"");
    out.append(GgufValueTypeName(kv.value.type()));
    out.append("\", ");
    if (kv.value.is_array()) {
      AppendArrayFields(out, kv.value);
    } else {
      out.append("\"value\": ");
      AppendScalar(out, kv.value);
    }
    out.append("}");
  }
  out.append("],\n\"tensors\": [");
  first = true;
  for (const GgufTensor& t : file.tensors()) {
    out.append(first ? "\n" : ",\n");
    first = false;
    out.append("{\"name\": ");
    AppendJsonString(out, t.name);
    out.append(", \"type\": \"");
    out.append(GgmlTypeName(t.type));
    out.append("\", \"type_id\": " + std::to_string(static_cast<uint32_t>(t.type)));
    out.append(", \"dims\": [");
    for (size_t d = 0; d < t.dims.size(); ++d) {
      if (d > 0) out.append(", ");
      out.append(std::to_string(t.dims[d]));
    }
    out.append("], \"offset\": " + std::to_string(t.offset));
    out.append(", \"num_elements\": " + std::to_string(t.num_elements));
    out.append(", \"num_bytes\": " + std::to_string(t.num_bytes));
    out.append(", \"dequantize\": ");
    out.append(GgmlTypeCanDequantize(t.type) ? "true" : "false");
    out.append("}");
  }
  out.append("]}\n");
  return out;
}

bool WriteAll(std::FILE* f, const void* data, size_t n) {
  return n == 0 || std::fwrite(data, 1, n, f) == n;
}

// Dequantizes `tensors` one after the other to --output.
int Dequantize(const GgufFile& file, const std::vector<const GgufTensor*>& tensors) {
  const std::string output = absl::GetFlag(FLAGS_output);
  std::FILE* f = output == "-" ? stdout : std::fopen(output.c_str(), "wb");
  if (f == nullptr) {
    std::fprintf(stderr, "coalesce-gguf: cannot open %s for writing: %s\n", output.c_str(),
                 std::strerror(errno));
    return 1;
  }
  std::vector<float> values;
  for (const GgufTensor* t : tensors) {
    values.resize(static_cast<size_t>(t->num_elements));
    const absl::Status s = DequantizeToFloat(t->type, t->data, t->num_elements, values.data());
    if (!s.ok()) {
      std::fprintf(stderr, "coalesce-gguf: %s: tensor %s: %s\n", file.path().c_str(),
                   t->name.c_str(), std::string(s.message()).c_str());
      if (f != stdout) std::fclose(f);
      return 1;
    }
    if (!WriteAll(f, values.data(), values.size() * sizeof(float))) {
      std::fprintf(stderr, "coalesce-gguf: writing %s failed\n", output.c_str());
      if (f != stdout) std::fclose(f);
      return 1;
    }
  }
  if ((f == stdout ? std::fflush(f) : std::fclose(f)) != 0) {
    std::fprintf(stderr, "coalesce-gguf: writing %s failed\n", output.c_str());
    return 1;
  }
  return 0;
}

int Main(const std::string& path) {
  auto file = GgufFile::Open(path);
  if (!file.ok()) {
    std::fprintf(stderr, "coalesce-gguf: %s\n", std::string(file.status().message()).c_str());
    return 1;
  }
  const std::string name = absl::GetFlag(FLAGS_dequantize);
  if (absl::GetFlag(FLAGS_dequantize_all)) {
    std::vector<const GgufTensor*> tensors;
    for (const GgufTensor& t : file->tensors()) {
      if (GgmlTypeCanDequantize(t.type)) tensors.push_back(&t);
    }
    return Dequantize(*file, tensors);
  }
  if (!name.empty()) {
    const GgufTensor* t = file->FindTensor(name);
    if (t == nullptr) {
      std::fprintf(stderr, "coalesce-gguf: %s has no tensor named %s\n", path.c_str(),
                   name.c_str());
      return 1;
    }
    return Dequantize(*file, {t});
  }
  const std::string json = ToJson(*file);
  if (!WriteAll(stdout, json.data(), json.size()) || std::fflush(stdout) != 0) {
    std::fprintf(stderr, "coalesce-gguf: writing the JSON failed\n");
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace coalesce::engine

int main(int argc, char** argv) {
  const std::vector<char*> rest = coalesce::ParseFlags(
      argc, argv,
      "Prints a GGUF file's metadata and tensor table as JSON, or writes tensors dequantized "
      "to float32.\n"
      "Usage: coalesce-gguf [--dequantize=NAME | --dequantize_all] [--output=FILE] FILE.gguf");
  if (rest.size() != 2) {
    std::fprintf(stderr, "coalesce-gguf: expected one GGUF file (see --help)\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_dequantize_all) && !absl::GetFlag(FLAGS_dequantize).empty()) {
    std::fprintf(stderr, "coalesce-gguf: --dequantize and --dequantize_all exclude each other\n");
    return 2;
  }
  return coalesce::engine::Main(rest[1]);
}
