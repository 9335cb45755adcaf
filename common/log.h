// One line per event on stderr: "2026-11-29T16:50:01.123Z I message".
// The level is set once, from a flag, in main().
#pragma once

#include <string_view>

#include "absl/strings/str_format.h"

namespace coalesce {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

void SetLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);
void Log(LogLevel level, std::string_view message);

// LogF(LogLevel::kInfo, "loaded %s in %.1f s", name, seconds);
template <typename... Args>
void LogF(LogLevel level, const absl::FormatSpec<Args...>& format, const Args&... args) {
  if (LogEnabled(level)) Log(level, absl::StrFormat(format, args...));
}

}  // namespace coalesce
