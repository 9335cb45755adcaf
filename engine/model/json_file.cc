#include "engine/model/json_file.h"

#include <fstream>
#include <iterator>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/json_depth.h"

namespace coalesce::engine {

absl::StatusOr<nlohmann::json> ReadJsonFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (JsonNestsDeeperThan(text, kMaxJsonDepth)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": JSON nested more than ", kMaxJsonDepth, " levels deep"));
  }
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path, ": malformed JSON"));
  return j;
}

}  // namespace coalesce::engine
