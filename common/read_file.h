// A whole (small) file as a string, for the configuration files a binary
// reads: TLS certificates and keys, the tenants file.
#pragma once

#include <cstddef>
#include <fstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace coalesce {

// The file's bytes. INVALID_ARGUMENT "<name>=<path>: cannot read it" (or
// ": over N bytes"), where `name` says what named the file (a flag).
inline absl::StatusOr<std::string> ReadFile(const std::string& path, const std::string& name,
                                            size_t max_bytes = size_t{4} << 20) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(name, "=", path, ": cannot read it"));
  std::string text;
  char chunk[65536];
  while (in.read(chunk, sizeof chunk) || in.gcount() > 0) {
    text.append(chunk, static_cast<size_t>(in.gcount()));
    if (text.size() > max_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, "=", path, ": over ", max_bytes, " bytes"));
    }
  }
  if (in.bad())
    return absl::InvalidArgumentError(absl::StrCat(name, "=", path, ": cannot read it"));
  return text;
}

}  // namespace coalesce
