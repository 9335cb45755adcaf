// Reading Hugging Face .safetensors checkpoints: an 8-byte little-endian
// header length N, N bytes of JSON mapping each tensor name to
// {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the
// data section that follows the header), and an optional "__metadata__"
// object of strings. Files are memory-mapped and validated as strictly as the
// reference reader (the safetensors Rust crate): the tensors tile the data
// section exactly, without gaps or overlaps. A sharded checkpoint adds
// model.safetensors.index.json, whose "weight_map" names the shard of every
// tensor.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace coalesce::engine {

// Only the float types a Llama-family checkpoint uses; any other dtype is
// rejected by name when the file is opened.
enum class SafetensorsDtype { kF32, kF16, kBF16 };

const char* DtypeName(SafetensorsDtype dtype);  // "F32", "F16", "BF16"
int DtypeSize(SafetensorsDtype dtype);          // bytes per element

struct SafetensorsTensor {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;       // [] for a scalar
  const std::byte* data = nullptr;  // into the file's mapping
  int64_t num_bytes = 0;
  const std::string* file = nullptr;  // path of the file holding it, for messages

  int64_t num_elements() const { return num_bytes / DtypeSize(dtype); }
};

// One mapped and validated .safetensors file. The tensors' data pointers stay
// valid while the mapping (mapping()) has an owner.
class SafetensorsFile {
 public:
  // Maps `path` and validates its header; every error names the file and,
  // where one is at fault, the tensor.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

  const std::string& path() const { return path_; }
  // By name; sorted, so messages and iteration are deterministic.
  const std::map<std::string, SafetensorsTensor>& tensors() const { return tensors_; }
  const std::shared_ptr<const void>& mapping() const { return mapping_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  std::shared_ptr<const void> mapping_;
  std::map<std::string, SafetensorsTensor> tensors_;
};

// Every tensor of a checkpoint folder: model.safetensors, or the shards that
// model.safetensors.index.json lists (each opened once). The index and the
// shards must agree exactly: a tensor the index names must be in its shard,
// and a shard must hold no tensor the index does not assign to it.
class SafetensorsCheckpoint {
 public:
  static absl::StatusOr<SafetensorsCheckpoint> Open(const std::string& dir);

  // nullptr when absent.
  const SafetensorsTensor* Find(const std::string& name) const;
  // name -> tensor over all files, sorted.
  const std::map<std::string, const SafetensorsTensor*>& tensors() const { return tensors_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  // The file that names every tensor (model.safetensors or the index), for
  // messages about a tensor that is missing.
  const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsTensor*> tensors_;
};

}  // namespace coalesce::engine
