#include "engine/model/gguf_file.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/model/mapped_file.h"

namespace coalesce::engine {
namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read little-endian
// Keys and tensor names the format allows (the GGUF specification: keys of
// at most 2^16 - 1 bytes, tensor names of at most 64 bytes).
constexpr uint64_t kMaxKeyBytes = 65535;
constexpr uint64_t kMaxTensorNameBytes = 64;
constexpr uint32_t kMaxDims = 4;
// The fewest bytes a metadata entry (key length, empty key, type, a one-byte
// value) and a tensor info (name length, empty name, n_dims 0, type, offset)
// take: bounds for the counts in the header before anything is allocated.
constexpr uint64_t kMinEntryBytes = 8 + 4 + 1;
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 4 + 8;

// Bytes of a scalar value type; 0 for string, array and unknown types.
uint64_t ScalarSize(GgufValueType type) {
  switch (type) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
      return 2;
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kFloat32:
      return 4;
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kFloat64:
      return 8;
    case GgufValueType::kString:
    case GgufValueType::kArray:
      return 0;
  }
  return 0;
}

bool KnownValueType(uint32_t type) {
  return type <= static_cast<uint32_t>(GgufValueType::kFloat64);
}

// The fewest bytes one item of an array of `type` takes.
uint64_t MinItemBytes(GgufValueType type) {
  if (type == GgufValueType::kString) return 8;     // the length
  if (type == GgufValueType::kArray) return 4 + 8;  // item type and count
  return ScalarSize(type);
}

uint64_t LoadLE(const uint8_t* p, uint64_t n) {
  uint64_t v = 0;
  for (uint64_t i = n; i-- > 0;) v = v << 8 | p[i];
  return v;
}

// Debian's Abseil has its own absl::string_view, which std::string_view does
// not convert to.
absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// A key or name from a file, for a message: quoted, escaped, cut after 64
// bytes.
std::string Quote(std::string_view s) {
  constexpr size_t kMax = 64;
  std::string out = absl::StrCat("\"", absl::CHexEscape(Av(s.substr(0, kMax))), "\"");
  if (s.size() > kMax) absl::StrAppend(&out, "... (", s.size(), " bytes)");
  return out;
}

std::string DescribeValueTypeId(uint32_t id) {
  if (KnownValueType(id)) return GgufValueTypeName(static_cast<GgufValueType>(id));
  return absl::StrCat("unknown value type ", id);
}

}  // namespace

const char* GgufValueTypeName(GgufValueType type) {
  switch (type) {
    case GgufValueType::kUint8:
      return "uint8";
    case GgufValueType::kInt8:
      return "int8";
    case GgufValueType::kUint16:
      return "uint16";
    case GgufValueType::kInt16:
      return "int16";
    case GgufValueType::kUint32:
      return "uint32";
    case GgufValueType::kInt32:
      return "int32";
    case GgufValueType::kFloat32:
      return "float32";
    case GgufValueType::kBool:
      return "bool";
    case GgufValueType::kString:
      return "string";
    case GgufValueType::kArray:
      return "array";
    case GgufValueType::kUint64:
      return "uint64";
    case GgufValueType::kInt64:
      return "int64";
    case GgufValueType::kFloat64:
      return "float64";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------
// GgufValue
// ---------------------------------------------------------------------------

bool GgufValue::is_integer() const {
  switch (type_) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
      return true;
    default:
      return false;
  }
}

bool GgufValue::is_float() const {
  return type_ == GgufValueType::kFloat32 || type_ == GgufValueType::kFloat64;
}

std::optional<int64_t> GgufValue::AsInt() const {
  switch (type_) {
    case GgufValueType::kUint8:
    case GgufValueType::kUint16:
    case GgufValueType::kUint32:
      return static_cast<int64_t>(bits_);
    case GgufValueType::kUint64:
      if (bits_ > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
      return static_cast<int64_t>(bits_);
    case GgufValueType::kInt8:
      return static_cast<int8_t>(bits_);
    case GgufValueType::kInt16:
      return static_cast<int16_t>(bits_);
    case GgufValueType::kInt32:
      return static_cast<int32_t>(bits_);
    case GgufValueType::kInt64:
      return static_cast<int64_t>(bits_);
    default:
      return std::nullopt;
  }
}

std::optional<uint64_t> GgufValue::AsUint() const {
  if (type_ == GgufValueType::kUint64) return bits_;
  const std::optional<int64_t> v = AsInt();
  if (!v.has_value() || *v < 0) return std::nullopt;
  return static_cast<uint64_t>(*v);
}

std::optional<double> GgufValue::AsFloat() const {
  if (type_ == GgufValueType::kFloat32) {
    float f;
    const uint32_t bits = static_cast<uint32_t>(bits_);
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  if (type_ == GgufValueType::kFloat64) {
    double d;
    std::memcpy(&d, &bits_, sizeof d);
    return d;
  }
  return std::nullopt;
}

std::optional<bool> GgufValue::AsBool() const {
  if (type_ != GgufValueType::kBool) return std::nullopt;
  return bits_ != 0;
}

std::optional<std::string_view> GgufValue::AsString() const {
  if (type_ != GgufValueType::kString) return std::nullopt;
  return string_;
}

GgufValue GgufValue::At(uint64_t i) const {
  GgufValue item;
  if (type_ != GgufValueType::kArray || i >= size_) return item;
  item.type_ = item_type_;
  if (item_type_ == GgufValueType::kString) {
    item.string_ = strings_[i];
  } else if (item_type_ == GgufValueType::kArray) {
    item = arrays_[i];
  } else {
    const uint64_t n = ScalarSize(item_type_);
    item.bits_ = LoadLE(items_ + i * n, n);
  }
  return item;
}

std::string GgufValue::Describe() const {
  const char* name = GgufValueTypeName(type_);
  if (type_ == GgufValueType::kArray) {
    return absl::StrCat("array of ", size_, " ", GgufValueTypeName(item_type_));
  }
  if (type_ == GgufValueType::kString) return absl::StrCat(name, " ", Quote(string_));
  if (type_ == GgufValueType::kBool) return absl::StrCat(name, " ", bits_ ? "true" : "false");
  if (is_float()) return absl::StrCat(name, " ", *AsFloat());
  if (type_ == GgufValueType::kUint64) return absl::StrCat(name, " ", bits_);
  return absl::StrCat(name, " ", *AsInt());
}

// ---------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------

class GgufParser {
 public:
  GgufParser(GgufFile& file, const uint8_t* data, uint64_t size)
      : file_(file), data_(data), size_(size) {}

  absl::Status Parse() {
    // Header.
    if (size_ < 4) {
      return Error(absl::StrCat("file too short for a GGUF header (", size_, " bytes)"));
    }
    const uint32_t magic = static_cast<uint32_t>(LoadLE(data_, 4));
    if (magic != kGgufMagic) {
      return Error(
          absl::StrCat("not a GGUF file: it starts with \"",
                       absl::CHexEscape(absl::string_view(reinterpret_cast<const char*>(data_), 4)),
                       "\", not \"GGUF\""));
    }
    pos_ = 4;
    uint32_t version = 0;
    if (auto s = ReadU32("the version", &version); !s.ok()) return s;
    if ((version & 0xFFFF) == 0 && version != 0) {
      const uint32_t swapped = (version >> 24) | ((version >> 8) & 0xFF00) |
                               ((version << 8) & 0xFF0000) | (version << 24);
      return Error(absl::StrCat("big-endian GGUF (version field ", version, ", version ", swapped,
                                " byte-swapped) is not supported: only little-endian files are"));
    }
    if (version == 1) {
      return Error(
          "GGUF version 1 is not supported (versions 2 and 3 are): convert the file with a "
          "current llama.cpp");
    }
    if (version != 2 && version != 3) {
      return Error(absl::StrCat("unsupported GGUF version ", version, " (supported: 2, 3)"));
    }
    file_.version_ = static_cast<int>(version);
    uint64_t tensor_count = 0, kv_count = 0;
    if (auto s = ReadU64("the tensor count", &tensor_count); !s.ok()) return s;
    if (auto s = ReadU64("the metadata key/value count", &kv_count); !s.ok()) return s;
    if (kv_count > Left() / kMinEntryBytes) {
      return Error(absl::StrCat("metadata key/value count ", kv_count, " cannot fit in the ",
                                Left(), " bytes left (each entry takes at least ", kMinEntryBytes,
                                "): corrupt or truncated"));
    }
    if (tensor_count > Left() / kMinTensorInfoBytes) {
      return Error(absl::StrCat("tensor count ", tensor_count, " cannot fit in the ", Left(),
                                " bytes left (each tensor info takes at least ",
                                kMinTensorInfoBytes, "): corrupt or truncated"));
    }

    // Metadata.
    file_.metadata_.reserve(kv_count);
    absl::flat_hash_set<std::string_view> keys;
    for (uint64_t i = 0; i < kv_count; ++i) {
      std::string_view key;
      if (auto s = ReadString(absl::StrCat("the key of metadata entry ", i), &key); !s.ok()) {
        return s;
      }
      const std::string where = absl::StrCat("metadata key ", Quote(key));
      if (key.empty()) return Error(absl::StrCat("metadata entry ", i, " has an empty key"));
      if (key.size() > kMaxKeyBytes) {
        return Error(absl::StrCat(where, ": the key is ", key.size(), " bytes long (at most ",
                                  kMaxKeyBytes, ")"));
      }
      if (!keys.insert(key).second) return Error(absl::StrCat(where, " appears twice"));
      uint32_t type = 0;
      if (auto s = ReadU32(absl::StrCat(where, ": the value type"), &type); !s.ok()) return s;
      GgufValue value;
      if (auto s = ReadValue(where, type, 0, &value); !s.ok()) return s;
      file_.metadata_.push_back({std::string(key), std::move(value)});
    }

    // The alignment.
    if (const GgufValue* a = file_.Find("general.alignment"); a != nullptr) {
      const std::optional<uint64_t> v = a->AsUint();
      if (a->type() != GgufValueType::kUint32 || !v.has_value() || *v == 0 ||
          !std::has_single_bit(*v)) {
        return Error(
            absl::StrCat("metadata key \"general.alignment\": expected a uint32 power "
                         "of two, found ",
                         a->Describe()));
      }
      file_.alignment_ = *v;
    }

    // Tensor infos.
    if (tensor_count > Left() / kMinTensorInfoBytes) {
      return Error(absl::StrCat("tensor count ", tensor_count, " cannot fit in the ", Left(),
                                " bytes left after the metadata (each tensor info takes at least ",
                                kMinTensorInfoBytes, "): corrupt or truncated"));
    }
    file_.tensors_.reserve(tensor_count);
    absl::flat_hash_map<std::string_view, size_t>& names = file_.tensor_index_;
    for (uint64_t i = 0; i < tensor_count; ++i) {
      std::string_view name;
      if (auto s = ReadString(absl::StrCat("the name of tensor ", i), &name); !s.ok()) return s;
      const std::string where = absl::StrCat("tensor ", Quote(name));
      if (name.size() > kMaxTensorNameBytes) {
        return Error(absl::StrCat(where, ": the name is ", name.size(), " bytes long (at most ",
                                  kMaxTensorNameBytes, ")"));
      }
      if (!names.emplace(name, file_.tensors_.size()).second) {
        return Error(absl::StrCat(where, " appears twice"));
      }
      GgufTensor t;
      t.name = std::string(name);
      if (auto s = ReadTensorInfo(where, &t); !s.ok()) return s;
      file_.tensors_.push_back(std::move(t));
    }

    // The data section, then each tensor's place in it.
    const uint64_t a = file_.alignment_;
    file_.data_offset_ = pos_ % a == 0 ? pos_ : pos_ + (a - pos_ % a);
    return PlaceTensors();
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(file_.path_, ": ", what));
  }
  uint64_t Left() const { return size_ - pos_; }

  absl::Status Need(absl::string_view what, uint64_t n) const {
    if (n <= Left()) return absl::OkStatus();
    return Error(absl::StrCat("truncated: ", what, " needs ", n, " bytes at offset ", pos_,
                              " but the file has ", size_, " bytes"));
  }
  absl::Status ReadU32(absl::string_view what, uint32_t* out) {
    if (auto s = Need(what, 4); !s.ok()) return s;
    *out = static_cast<uint32_t>(LoadLE(data_ + pos_, 4));
    pos_ += 4;
    return absl::OkStatus();
  }
  absl::Status ReadU64(absl::string_view what, uint64_t* out) {
    if (auto s = Need(what, 8); !s.ok()) return s;
    *out = LoadLE(data_ + pos_, 8);
    pos_ += 8;
    return absl::OkStatus();
  }
  // A string: uint64 length, then the bytes (a view into the mapping).
  absl::Status ReadString(absl::string_view what, std::string_view* out) {
    uint64_t n = 0;
    if (auto s = ReadU64(absl::StrCat(what, " (its length)"), &n); !s.ok()) return s;
    if (n > Left()) {
      return Error(absl::StrCat("truncated: ", what, " is ", n, " bytes long at offset ", pos_,
                                " but only ", Left(), " bytes are left in the file"));
    }
    *out = std::string_view(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return absl::OkStatus();
  }

  // A value of type id `type` (the type already read); `where` names the key
  // (and the item, inside arrays); `depth` is how many arrays enclose it.
  absl::Status ReadValue(const std::string& where, uint32_t type, int depth, GgufValue* out) {
    if (!KnownValueType(type)) {
      return Error(absl::StrCat(where, ": unknown value type ", type, " (known: 0 to 12)"));
    }
    out->type_ = static_cast<GgufValueType>(type);
    switch (out->type_) {
      case GgufValueType::kString:
        return ReadString(absl::StrCat(where, ": the string value"), &out->string_);
      case GgufValueType::kArray:
        return ReadArray(where, depth + 1, out);
      default:
        break;
    }
    const uint64_t n = ScalarSize(out->type_);
    if (auto s = Need(absl::StrCat(where, ": the ", GgufValueTypeName(out->type_), " value"), n);
        !s.ok()) {
      return s;
    }
    out->bits_ = LoadLE(data_ + pos_, n);
    if (out->type_ == GgufValueType::kBool && out->bits_ > 1) {
      return Error(absl::StrCat(where, ": bool value ", out->bits_, " is neither 0 nor 1"));
    }
    pos_ += n;
    return absl::OkStatus();
  }

  // An array at nesting depth `depth` (1 for a key's own array): item type,
  // count, items.
  absl::Status ReadArray(const std::string& where, int depth, GgufValue* out) {
    if (depth > kGgufMaxArrayDepth) {
      return Error(absl::StrCat(where, ": arrays nest more than ", kGgufMaxArrayDepth, " deep"));
    }
    uint32_t item_type = 0;
    uint64_t count = 0;
    if (auto s = ReadU32(absl::StrCat(where, ": the array's item type"), &item_type); !s.ok()) {
      return s;
    }
    if (!KnownValueType(item_type)) {
      return Error(
          absl::StrCat(where, ": array of unknown value type ", item_type, " (known: 0 to 12)"));
    }
    if (auto s = ReadU64(absl::StrCat(where, ": the array's count"), &count); !s.ok()) return s;
    out->item_type_ = static_cast<GgufValueType>(item_type);
    out->size_ = count;
    const uint64_t min_bytes = MinItemBytes(out->item_type_);
    if (count > Left() / min_bytes) {
      return Error(absl::StrCat(where, ": array of ", count, " ", DescribeValueTypeId(item_type),
                                " items cannot fit in the ", Left(),
                                " bytes left in the file (truncated or corrupt)"));
    }
    switch (out->item_type_) {
      case GgufValueType::kString:
        out->strings_.resize(count);
        for (uint64_t i = 0; i < count; ++i) {
          if (auto s = ReadString(absl::StrCat(where, ": string item ", i), &out->strings_[i]);
              !s.ok()) {
            return s;
          }
        }
        return absl::OkStatus();
      case GgufValueType::kArray:
        out->arrays_.resize(count);
        for (uint64_t i = 0; i < count; ++i) {
          GgufValue& item = out->arrays_[i];
          item.type_ = GgufValueType::kArray;
          if (auto s = ReadArray(absl::StrCat(where, "[", i, "]"), depth + 1, &item); !s.ok()) {
            return s;
          }
        }
        return absl::OkStatus();
      default:
        break;
    }
    const uint64_t n = ScalarSize(out->item_type_);
    out->items_ = data_ + pos_;
    if (out->item_type_ == GgufValueType::kBool) {
      for (uint64_t i = 0; i < count; ++i) {
        if (out->items_[i] > 1) {
          return Error(
              absl::StrCat(where, ": bool item ", i, " is ", out->items_[i], ", neither 0 nor 1"));
        }
      }
    }
    pos_ += count * n;
    return absl::OkStatus();
  }

  // One tensor info after its name: n_dims, dims, type, offset; the element
  // count and bytes, checked against overflow and the type's block size.
  absl::Status ReadTensorInfo(const std::string& where, GgufTensor* t) {
    uint32_t n_dims = 0;
    if (auto s = ReadU32(absl::StrCat(where, ": n_dims"), &n_dims); !s.ok()) return s;
    if (n_dims > kMaxDims) {
      return Error(absl::StrCat(where, ": n_dims is ", n_dims, " (at most ", kMaxDims, ")"));
    }
    std::vector<uint64_t> dims(n_dims);
    for (uint32_t d = 0; d < n_dims; ++d) {
      if (auto s = ReadU64(absl::StrCat(where, ": dimension ", d), &dims[d]); !s.ok()) return s;
    }
    uint32_t type_id = 0;
    if (auto s = ReadU32(absl::StrCat(where, ": the type"), &type_id); !s.ok()) return s;
    if (auto s = ReadU64(absl::StrCat(where, ": the offset"), &t->offset); !s.ok()) return s;

    const std::string dims_text = absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
    const std::optional<GgmlTypeInfo> info = FindGgmlType(type_id);
    if (!info.has_value()) {
      return Error(absl::StrCat(where, ": unknown ggml type id ", type_id));
    }
    t->type = info->type;
    // Elements: the product of the dims, refused when it passes 2^63 - 1.
    uint64_t elements = 1;
    bool overflow = false;
    for (const uint64_t d : dims) {
      if (d > static_cast<uint64_t>(INT64_MAX)) {
        return Error(absl::StrCat(where, ": dims ", dims_text, " hold a dimension over 2^63 - 1"));
      }
      if (d != 0 && elements > static_cast<uint64_t>(INT64_MAX) / d) overflow = true;
      elements *= d;
      t->dims.push_back(static_cast<int64_t>(d));
    }
    if (std::find(dims.begin(), dims.end(), 0) != dims.end()) {
      elements = 0;  // no elements, however large the other dims
      overflow = false;
    }
    if (overflow) {
      return Error(absl::StrCat(where, ": dims ", dims_text, " hold more than 2^63 - 1 elements"));
    }
    const uint64_t row = n_dims == 0 ? 1 : dims[0];
    if (row % static_cast<uint64_t>(info->block_size) != 0) {
      return Error(absl::StrCat(where, ": a row of ", row, " elements (dims ", dims_text,
                                ") is not a whole number of ", info->name, " blocks of ",
                                info->block_size));
    }
    auto bytes = GgmlRowBytes(t->type, static_cast<int64_t>(elements));
    if (!bytes.ok()) {
      return Error(absl::StrCat(where, ": dims ", dims_text, ": ", bytes.status().message()));
    }
    t->num_elements = static_cast<int64_t>(elements);
    t->num_bytes = *bytes;
    return absl::OkStatus();
  }

  // Every tensor's data: aligned, inside the file, overlapping no other.
  absl::Status PlaceTensors() {
    const uint64_t begin = file_.data_offset_;
    const uint8_t* base = data_ + std::min(begin, size_);
    std::vector<const GgufTensor*> order;
    for (GgufTensor& t : file_.tensors_) {
      const std::string where = absl::StrCat("tensor ", Quote(t.name));
      if (t.offset % file_.alignment_ != 0) {
        return Error(absl::StrCat(where, ": offset ", t.offset,
                                  " is not a multiple of the alignment ", file_.alignment_));
      }
      const uint64_t n = static_cast<uint64_t>(t.num_bytes);
      if (begin > size_ || t.offset > size_ - begin || n > size_ - begin - t.offset) {
        return Error(absl::StrCat(where, ": its ", n, " bytes of ", GgmlTypeName(t.type),
                                  " at offset ", t.offset, " (file offset ", begin, " + ", t.offset,
                                  ") end beyond the file's ", size_,
                                  " bytes: truncated, or the offset is wrong"));
      }
      t.data = reinterpret_cast<const std::byte*>(base + t.offset);
      if (n > 0) order.push_back(&t);
    }
    std::sort(order.begin(), order.end(),
              [](const GgufTensor* x, const GgufTensor* y) { return x->offset < y->offset; });
    for (size_t i = 1; i < order.size(); ++i) {
      const GgufTensor& prev = *order[i - 1];
      const GgufTensor& t = *order[i];
      const uint64_t prev_end = prev.offset + static_cast<uint64_t>(prev.num_bytes);
      if (t.offset < prev_end) {
        return Error(absl::StrCat("tensor ", Quote(t.name), " (bytes [", t.offset, ", ",
                                  t.offset + static_cast<uint64_t>(t.num_bytes),
                                  ") of the data section) overlaps tensor ", Quote(prev.name),
                                  " (bytes [", prev.offset, ", ", prev_end, "))"));
      }
    }
    return absl::OkStatus();
  }

  GgufFile& file_;
  const uint8_t* data_;
  uint64_t size_;
  uint64_t pos_ = 0;
};

// ---------------------------------------------------------------------------
// GgufFile
// ---------------------------------------------------------------------------

absl::StatusOr<GgufFile> GgufFile::Open(const std::string& path) {
  size_t size = 0;
  auto mapped = MapFile(path, &size);
  if (!mapped.ok()) return mapped.status();
  GgufFile file;
  file.path_ = path;
  file.mapping_ = *std::move(mapped);
  file.size_ = size;
  GgufParser parser(file, static_cast<const uint8_t*>(file.mapping_.get()), size);
  if (auto s = parser.Parse(); !s.ok()) return s;
  return file;
}

const GgufValue* GgufFile::Find(std::string_view key) const {
  for (const GgufKeyValue& kv : metadata_) {
    if (kv.key == key) return &kv.value;
  }
  return nullptr;
}

const GgufTensor* GgufFile::FindTensor(std::string_view name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

absl::Status GgufFile::KeyError(std::string_view key, const char* expected) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) {
    return absl::NotFoundError(absl::StrCat(path_, ": no metadata key ", Quote(key)));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      path_, ": metadata key ", Quote(key), ": expected ", expected, ", found ", v->Describe()));
}

absl::StatusOr<uint64_t> GgufFile::GetUint(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v != nullptr) {
    if (std::optional<uint64_t> x = v->AsUint(); x.has_value()) return *x;
  }
  return KeyError(key, "an integer >= 0");
}

absl::StatusOr<int64_t> GgufFile::GetInt(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v != nullptr) {
    if (std::optional<int64_t> x = v->AsInt(); x.has_value()) return *x;
  }
  return KeyError(key, "an integer that fits in int64");
}

absl::StatusOr<double> GgufFile::GetFloat(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v != nullptr) {
    if (std::optional<double> x = v->AsFloat(); x.has_value()) return *x;
  }
  return KeyError(key, "a float32 or float64");
}

absl::StatusOr<bool> GgufFile::GetBool(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v != nullptr) {
    if (std::optional<bool> x = v->AsBool(); x.has_value()) return *x;
  }
  return KeyError(key, "a bool");
}

absl::StatusOr<std::string_view> GgufFile::GetString(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v != nullptr) {
    if (std::optional<std::string_view> x = v->AsString(); x.has_value()) return *x;
  }
  return KeyError(key, "a string");
}

absl::StatusOr<const GgufValue*> GgufFile::GetArray(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v != nullptr && v->is_array()) return v;
  return KeyError(key, "an array");
}

absl::StatusOr<absl::Span<const std::string_view>> GgufFile::GetStringArray(
    std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v != nullptr && v->is_array() && v->item_type() == GgufValueType::kString) {
    return absl::MakeConstSpan(v->strings());
  }
  return KeyError(key, "an array of string");
}

absl::StatusOr<std::vector<int64_t>> GgufFile::GetIntArray(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v != nullptr && v->is_array()) {
    std::vector<int64_t> out;
    out.reserve(v->size());
    for (uint64_t i = 0; i < v->size(); ++i) {
      const std::optional<int64_t> x = v->At(i).AsInt();
      if (!x.has_value()) {
        if (v->item_type() == GgufValueType::kUint64) {
          return absl::InvalidArgumentError(absl::StrCat(path_, ": metadata key ", Quote(key),
                                                         ": item ", i, " (", v->At(i).Describe(),
                                                         ") does not fit in int64"));
        }
        break;
      }
      out.push_back(*x);
    }
    if (out.size() == v->size()) return out;
  }
  return KeyError(key, "an array of integers");
}

absl::StatusOr<std::vector<double>> GgufFile::GetFloatArray(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v != nullptr && v->is_array() &&
      (v->item_type() == GgufValueType::kFloat32 || v->item_type() == GgufValueType::kFloat64)) {
    std::vector<double> out;
    out.reserve(v->size());
    for (uint64_t i = 0; i < v->size(); ++i) out.push_back(*v->At(i).AsFloat());
    return out;
  }
  return KeyError(key, "an array of float32 or float64");
}

}  // namespace coalesce::engine
