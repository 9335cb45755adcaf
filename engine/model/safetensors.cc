#include "engine/model/safetensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/json_depth.h"
#include "engine/model/json_file.h"
#include "engine/model/mapped_file.h"

namespace coalesce::engine {
namespace {

using Json = nlohmann::json;

// The safetensors crate refuses headers over 100 MB; a header that long is
// corrupt, and parsing it would only waste memory.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// A JSON integer >= 0 (nlohmann stores it signed or unsigned).
bool GetNonNegative(const Json& j, uint64_t* out) {
  if (j.is_number_unsigned()) {
    *out = j.get<uint64_t>();
    return true;
  }
  if (j.is_number_integer() && j.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(j.get<int64_t>());
    return true;
  }
  return false;
}

absl::StatusOr<SafetensorsDtype> ParseDtype(const std::string& name) {
  if (name == "F32") return SafetensorsDtype::kF32;
  if (name == "F16") return SafetensorsDtype::kF16;
  if (name == "BF16") return SafetensorsDtype::kBF16;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported dtype ", name, " (supported: F32, F16, BF16)"));
}

// One tensor's header entry, checked on its own: shape, dtype and offsets
// consistent with each other and within a data section of `data_size` bytes.
absl::StatusOr<SafetensorsTensor> ParseEntry(const std::string& name, const Json& entry,
                                             uint64_t data_size, uint64_t* begin) {
  if (!entry.is_object()) return absl::InvalidArgumentError("header entry is not an object");
  const auto dtype_it = entry.find("dtype");
  const auto shape_it = entry.find("shape");
  const auto offsets_it = entry.find("data_offsets");
  if (dtype_it == entry.end() || !dtype_it->is_string()) {
    return absl::InvalidArgumentError("header entry has no string \"dtype\"");
  }
  if (shape_it == entry.end() || !shape_it->is_array()) {
    return absl::InvalidArgumentError("header entry has no array \"shape\"");
  }
  if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
    return absl::InvalidArgumentError("header entry has no [begin, end] \"data_offsets\"");
  }
  SafetensorsTensor t;
  t.name = name;
  auto dtype = ParseDtype(dtype_it->get<std::string>());
  if (!dtype.ok()) return dtype.status();
  t.dtype = *dtype;

  // Elements, bounded by what the data section could hold so the product
  // cannot overflow.
  const uint64_t limit = data_size / DtypeSize(t.dtype);
  uint64_t elements = 1;
  bool zero = false, too_big = false;
  for (const Json& dim : *shape_it) {
    uint64_t d = 0;
    if (!GetNonNegative(dim, &d) || d > static_cast<uint64_t>(INT64_MAX)) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", shape_it->dump(), " has an entry that is not an integer >= 0"));
    }
    t.shape.push_back(static_cast<int64_t>(d));
    if (d == 0) {
      zero = true;
    } else if (too_big || elements > limit / d) {
      too_big = true;
    } else {
      elements *= d;
    }
  }
  if (zero) {  // no bytes, however large the other dimensions
    elements = 0;
    too_big = false;
  }
  uint64_t end = 0;
  if (!GetNonNegative((*offsets_it)[0], begin) || !GetNonNegative((*offsets_it)[1], &end) ||
      end < *begin) {
    return absl::InvalidArgumentError(
        absl::StrCat("data_offsets ", offsets_it->dump(), " are not integers 0 <= begin <= end"));
  }
  if (end > data_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("data_offsets ", offsets_it->dump(), " end beyond the data section (",
                     data_size, " bytes): the file is truncated or the header is wrong"));
  }
  if (too_big || elements * DtypeSize(t.dtype) != end - *begin) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape ", shape_it->dump(), " of ", DtypeName(t.dtype), " needs ",
                     too_big ? std::string("more") : absl::StrCat(elements * DtypeSize(t.dtype)),
                     " bytes but data_offsets ", offsets_it->dump(), " span ", end - *begin));
  }
  t.num_bytes = static_cast<int64_t>(end - *begin);
  return t;
}

}  // namespace

const char* DtypeName(SafetensorsDtype dtype) {
  switch (dtype) {
    case SafetensorsDtype::kF32:
      return "F32";
    case SafetensorsDtype::kF16:
      return "F16";
    case SafetensorsDtype::kBF16:
      return "BF16";
  }
  return "?";
}

int DtypeSize(SafetensorsDtype dtype) { return dtype == SafetensorsDtype::kF32 ? 4 : 2; }

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  size_t size = 0;
  auto mapped = MapFile(path, &size);
  if (!mapped.ok()) return mapped.status();
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile);
  file->path_ = path;
  file->mapping_ = *std::move(mapped);
  const auto* bytes = static_cast<const std::byte*>(file->mapping_.get());

  // 1. The header length: 8 bytes, little-endian, and a header that fits.
  if (size < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": file too short for a safetensors header (", size, " bytes, need at least 8)"));
  }
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = header_size << 8 | static_cast<uint8_t>(bytes[i]);
  if (header_size > size - 8 || header_size > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header length ", header_size, " does not fit in the file (", size,
                     " bytes): truncated, or not a safetensors file"));
  }

  // 2. The JSON header. Parsing without exceptions; every later access checks
  //    the type first, so nothing below can throw.
  const char* header = reinterpret_cast<const char*>(bytes + 8);
  if (JsonNestsDeeperThan(std::string_view(header, header_size), kMaxJsonDepth)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": the header nests more than ", kMaxJsonDepth, " levels deep"));
  }
  const Json j = Json::parse(header, header + header_size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": the header is not a JSON object (malformed or truncated)"));
  }
  const uint64_t data_size = size - 8 - header_size;
  const std::byte* data = bytes + 8 + header_size;

  // 3. Each entry, then the tiling: sorted by offset, every tensor must start
  //    where the previous one ended, and the last end where the file does.
  struct Span {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Span> spans;
  for (const auto& [name, entry] : j.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": __metadata__ is not an object"));
      }
      continue;
    }
    uint64_t begin = 0;
    auto tensor = ParseEntry(name, entry, data_size, &begin);
    if (!tensor.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor ", name, ": ", tensor.status().message()));
    }
    tensor->data = data + begin;
    tensor->file = &file->path_;
    auto [it, inserted] = file->tensors_.emplace(name, *std::move(tensor));
    spans.push_back({begin, begin + static_cast<uint64_t>(it->second.num_bytes), &it->first});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t cursor = 0;
  const std::string* previous = nullptr;
  for (const Span& s : spans) {
    if (s.begin < cursor) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor ", *s.name, " bytes [",
                                                     s.begin, ", ", s.end, ") overlap tensor ",
                                                     *previous, " (which ends at ", cursor, ")"));
    }
    if (s.begin > cursor) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": data bytes [", cursor, ", ", s.begin,
                                                     ") before tensor ", *s.name,
                                                     " belong to no tensor"));
    }
    cursor = s.end;
    previous = s.name;
  }
  if (cursor != data_size) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": data bytes [", cursor, ", ", data_size,
                                                   ") at the end belong to no tensor"));
  }
  return file;
}

// ---------------------------------------------------------------------------
// Checkpoint folders
// ---------------------------------------------------------------------------

const SafetensorsTensor* SafetensorsCheckpoint::Find(const std::string& name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second;
}

absl::StatusOr<SafetensorsCheckpoint> SafetensorsCheckpoint::Open(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string single = (fs::path(dir) / "model.safetensors").string();
  const std::string index_path = (fs::path(dir) / "model.safetensors.index.json").string();
  SafetensorsCheckpoint checkpoint;

  // As transformers does: the single file first, else the index.
  if (fs::exists(single, ec)) {
    checkpoint.source_ = single;
    auto file = SafetensorsFile::Open(single);
    if (!file.ok()) return file.status();
    for (const auto& [name, tensor] : (*file)->tensors()) checkpoint.tensors_[name] = &tensor;
    checkpoint.files_.push_back(*std::move(file));
    return checkpoint;
  }
  if (!fs::exists(index_path, ec)) {
    return absl::NotFoundError(
        absl::StrCat(dir, ": no model.safetensors or model.safetensors.index.json"));
  }
  checkpoint.source_ = index_path;
  auto index = ReadJsonFile(index_path);
  if (!index.ok()) return index.status();
  const auto map_it = index->is_object() ? index->find("weight_map") : index->end();
  if (map_it == index->end() || !map_it->is_object() || map_it->empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_path, ": no \"weight_map\" object naming the shard of each tensor"));
  }

  // Each shard once, in name order; a name with a path in it could reach
  // outside the folder, so shards are plain file names.
  std::map<std::string, std::set<std::string>> shard_tensors;  // shard -> tensors
  for (const auto& [name, shard] : map_it->items()) {
    if (!shard.is_string() || shard.get<std::string>().empty() ||
        shard.get<std::string>().find('/') != std::string::npos ||
        shard.get<std::string>() == "." || shard.get<std::string>() == "..") {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": tensor ", name, ": shard ",
                                                     shard.dump(), " is not a plain file name"));
    }
    shard_tensors[shard.get<std::string>()].insert(name);
  }
  for (const auto& [shard, names] : shard_tensors) {
    const std::string shard_path = (fs::path(dir) / shard).string();
    auto file = SafetensorsFile::Open(shard_path);
    if (!file.ok()) {
      return absl::Status(
          file.status().code(),
          absl::StrCat(file.status().message(), " (a shard listed in ", index_path, ")"));
    }
    for (const std::string& name : names) {
      const auto it = (*file)->tensors().find(name);
      if (it == (*file)->tensors().end()) {
        return absl::InvalidArgumentError(absl::StrCat(shard_path, ": has no tensor ", name,
                                                       ", which ", index_path, " places there"));
      }
      checkpoint.tensors_[name] = &it->second;
    }
    for (const auto& [name, tensor] : (*file)->tensors()) {
      if (!names.contains(name)) {
        return absl::InvalidArgumentError(absl::StrCat(
            shard_path, ": tensor ", name, " is not assigned to this shard by ", index_path));
      }
    }
    checkpoint.files_.push_back(*std::move(file));
  }
  return checkpoint;
}

}  // namespace coalesce::engine
