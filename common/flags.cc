#include "common/flags.h"

#include <array>
#include <string>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"

namespace coalesce {
namespace {

// The folders of this repository whose sources may define flags.
constexpr std::array<absl::string_view, 7> kSourceRooms = {
    "batcher/", "common/", "engine/", "metrics/", "service/", "tests/", "tools/"};

}  // namespace

absl::string_view FlagSourcePath(absl::string_view file) {
  // COALESCE_SOURCE_DIR is the repository's root as the build saw it (the
  // prefix of every __FILE__ of ours).
  absl::string_view inside = file;
  if (absl::ConsumePrefix(&inside, COALESCE_SOURCE_DIR) && absl::ConsumePrefix(&inside, "/")) {
    return inside;
  }
  while (absl::ConsumePrefix(&file, "/")) {
  }
  return file;
}

bool IsOwnFlagSource(absl::string_view path) {
  for (absl::string_view room : kSourceRooms) {
    if (absl::StartsWith(path, room)) return true;
  }
  return false;
}

std::vector<char*> ParseFlags(int argc, char** argv, absl::string_view usage) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [](absl::string_view path) { return IsOwnFlagSource(path); };
  config.contains_helpshort_flags = config.contains_help_flags;
  config.normalize_filename = [](absl::string_view file) {
    return std::string(FlagSourcePath(file));
  };
  absl::SetFlagsUsageConfig(config);
  return absl::ParseCommandLine(argc, argv);
}

}  // namespace coalesce
