// Command-line flags as every coalesce binary parses them.
#pragma once

#include <vector>

#include "absl/strings/string_view.h"

namespace coalesce {

// Sets the program's usage message, makes --help list the flags defined in
// this repository's sources (whatever the binary is called; Abseil's default
// lists only flags of a file named after the binary) under their paths from
// the repository's root, and parses the command line (absl::ParseCommandLine:
// --help, --version and a bad flag exit here). Returns the positional
// arguments, argv[0] first.
std::vector<char*> ParseFlags(int argc, char** argv, absl::string_view usage);

// The path Abseil's help shows for a flag defined in `file` (a __FILE__):
// relative to the repository's root for our sources, else as Abseil does.
absl::string_view FlagSourcePath(absl::string_view file);

// Whether `path` (as FlagSourcePath gives it) is one of our sources.
bool IsOwnFlagSource(absl::string_view path);

}  // namespace coalesce
