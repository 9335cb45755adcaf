// Reading GGUF files (the format of llama.cpp and Ollama): the container
// only, i.e. the metadata key/values and the tensor table, with each
// tensor's bytes located in the file's memory mapping. Turning the tensors
// into floats is engine/model/gguf_quant.h; turning a GGUF file into a model
// is engine/model/gguf_model.h, and its tokenizer metadata into a tokenizer
// engine/model/gguf_vocab.h.
//
// The layout (GGUF versions 2 and 3, little-endian; every integer below is
// little-endian, a "string" is a uint64 byte length and that many bytes):
//
//   "GGUF"  uint32 version  uint64 tensor_count  uint64 metadata_kv_count
//   metadata_kv_count x { string key, uint32 value_type, value }
//   tensor_count x { string name, uint32 n_dims, n_dims x uint64 dim,
//                    uint32 ggml_type, uint64 offset }
//   padding to `general.alignment` (a uint32 key; 32 when absent)
//   the data section: each tensor at data start + its offset (a multiple of
//   the alignment)
//
// A value is one of uint8, int8, uint16, int16, uint32, int32, uint64, int64,
// float32, float64, bool (one byte, 0 or 1), string, or an array: uint32 item
// type, uint64 count, then the items (arrays of arrays included).
//
// Files are validated strictly; a hostile file is refused with an
// INVALID_ARGUMENT that names the file, the key or tensor at fault and the
// value found, never a crash or an unbounded allocation: every count is
// bounded by the bytes left in the file before anything is allocated for it,
// and arrays nest at most kGgufMaxArrayDepth deep. Besides the mapping, the
// parsed metadata takes less than 9 bytes of memory per byte of the file at
// worst (arrays of empty arrays; 2 for arrays of strings, none for numeric
// arrays, whose items stay in the mapping).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/model/gguf_quant.h"

namespace coalesce::engine {

enum class GgufValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

// "uint8", ..., "float64", "bool", "string", "array"; "unknown" otherwise.
const char* GgufValueTypeName(GgufValueType type);

// A special token id (tokenizer.ggml.*_token_id) of 0xFFFFFFFF names no
// token: it is llama.cpp's "none" (-1) as uint32, which its
// llama-convert-llama2c-to-ggml writes for the padding id (llama.cpp reads
// that file with no padding token). The loaders read it as the key being
// absent.
inline constexpr uint64_t kGgufNoTokenId = 0xFFFFFFFF;

// Arrays of arrays nest at most this deep (an array of arrays of scalars is
// depth 2). Real files use depth 1.
inline constexpr int kGgufMaxArrayDepth = 8;

// One metadata value. Strings and the items of numeric arrays are views into
// the file's mapping: a GgufValue is valid while its GgufFile lives.
class GgufValue {
 public:
  GgufValueType type() const { return type_; }
  bool is_array() const { return type_ == GgufValueType::kArray; }
  bool is_integer() const;  // uint8 .. int64 (not bool)
  bool is_float() const;    // float32, float64

  // A scalar as the asked kind, or nullopt when it is not of that kind:
  // AsUint: any integer type holding a value >= 0; AsInt: any integer type
  // holding a value that fits in int64; AsFloat: float32 or float64; AsBool:
  // bool; AsString: string.
  std::optional<uint64_t> AsUint() const;
  std::optional<int64_t> AsInt() const;
  std::optional<double> AsFloat() const;
  std::optional<bool> AsBool() const;
  std::optional<std::string_view> AsString() const;

  // Arrays: the item type and count, and the items. At(i), for i < size(),
  // returns item i as a value of its own (a copy, for an array of arrays);
  // an array of arrays also gives its items through arrays(), and an array
  // of strings its strings through strings().
  GgufValueType item_type() const { return item_type_; }
  uint64_t size() const { return size_; }
  GgufValue At(uint64_t i) const;
  const std::vector<std::string_view>& strings() const { return strings_; }
  const std::vector<GgufValue>& arrays() const { return arrays_; }

  // For messages: "uint32 7", "string \"llama\"" (escaped, cut after 64
  // bytes), "array of 3 string".
  std::string Describe() const;

 private:
  friend class GgufParser;
  GgufValueType type_ = GgufValueType::kUint8;
  uint64_t bits_ = 0;                                // a scalar's little-endian bits, zero-extended
  std::string_view string_;                          // kString
  GgufValueType item_type_ = GgufValueType::kUint8;  // kArray
  uint64_t size_ = 0;                                // kArray: item count
  const uint8_t* items_ = nullptr;                   // kArray of scalars: the raw items
  std::vector<std::string_view> strings_;            // kArray of kString
  std::vector<GgufValue> arrays_;                    // kArray of kArray
};

struct GgufKeyValue {
  std::string key;
  GgufValue value;
};

struct GgufTensor {
  std::string name;
  // ggml order: dims[0] is the fastest-varying (a row of a matrix holds
  // dims[0] elements); 1 to 4 entries (0 for a scalar).
  std::vector<int64_t> dims;
  GgmlType type = GgmlType::kF32;
  uint64_t offset = 0;              // from the start of the data section
  const std::byte* data = nullptr;  // into the mapping
  int64_t num_elements = 0;
  int64_t num_bytes = 0;
};

class GgufFile {
 public:
  // Maps and validates `path`. Errors (INVALID_ARGUMENT unless the file
  // cannot be read at all) name the file and what is wrong.
  static absl::StatusOr<GgufFile> Open(const std::string& path);

  const std::string& path() const { return path_; }
  int version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  // Offset of the data section in the file.
  uint64_t data_offset() const { return data_offset_; }
  uint64_t file_size() const { return size_; }

  // Metadata in file order.
  const std::vector<GgufKeyValue>& metadata() const { return metadata_; }
  // nullptr when absent.
  const GgufValue* Find(std::string_view key) const;

  // Typed accessors: the value of `key` as the asked kind. NOT_FOUND when the
  // key is absent, INVALID_ARGUMENT when it holds something else; both name
  // the file and the key, and the latter what the key holds.
  absl::StatusOr<uint64_t> GetUint(std::string_view key) const;  // an integer >= 0
  absl::StatusOr<int64_t> GetInt(std::string_view key) const;    // an integer in int64
  absl::StatusOr<double> GetFloat(std::string_view key) const;   // float32 or float64
  absl::StatusOr<bool> GetBool(std::string_view key) const;
  absl::StatusOr<std::string_view> GetString(std::string_view key) const;
  // Any array.
  absl::StatusOr<const GgufValue*> GetArray(std::string_view key) const;
  absl::StatusOr<absl::Span<const std::string_view>> GetStringArray(std::string_view key) const;
  // An array of an integer type whose every item fits in int64.
  absl::StatusOr<std::vector<int64_t>> GetIntArray(std::string_view key) const;
  // An array of float32 or float64.
  absl::StatusOr<std::vector<double>> GetFloatArray(std::string_view key) const;

  // Tensors in file order.
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  // nullptr when absent.
  const GgufTensor* FindTensor(std::string_view name) const;

  // Keeps the tensors' data alive.
  const std::shared_ptr<const void>& mapping() const { return mapping_; }

 private:
  friend class GgufParser;
  GgufFile() = default;
  absl::Status KeyError(std::string_view key, const char* expected) const;

  std::string path_;
  std::shared_ptr<const void> mapping_;
  uint64_t size_ = 0;
  int version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<GgufKeyValue> metadata_;
  std::vector<GgufTensor> tensors_;
  // name (a view into the mapping) -> index in tensors_
  absl::flat_hash_map<std::string_view, size_t> tensor_index_;
};

}  // namespace coalesce::engine
