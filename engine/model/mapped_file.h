// Read-only memory mappings of whole files: how weights reach the engine
// without a copy.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace coalesce::engine {

// Maps `path` read-only and privately; the mapping lives until its last
// owner lets go. Sets `*size` to the file's size. An empty file gives a null
// pointer (mmap rejects length 0). Errors name the file: NOT_FOUND,
// PERMISSION_DENIED, INVALID_ARGUMENT for a directory or device, INTERNAL.
absl::StatusOr<std::shared_ptr<const void>> MapFile(const std::string& path, size_t* size);

}  // namespace coalesce::engine
