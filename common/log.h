// One line per event on stderr: "2026-11-29T16:50:01.123Z I message".
// The level is set once, from a flag, in main().
//
// A message can never forge a line: control characters in it (a newline in
// a client's request_id, say) are written escaped ("\n", "\x1b"), and so are
// the characters beyond ASCII that terminals and log viewers act on (NEL,
// U+2028 and U+2029 break lines, the C1 CSI starts an escape sequence, the
// bidirectional controls reorder what follows): "\u2028". Bytes that are not
// UTF-8 are escaped one by one, so a line is always UTF-8.
#pragma once

#include <string>
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

// For lines that clients can cause as often as they like (a malformed
// request, gRPC's and protobuf's own complaints about one): at most
// kLogBurst lines per `key` in any kLogWindowSeconds, after which the next
// line written for that key says how many were suppressed. Keys are a small
// fixed set (a call site), never client data.
inline constexpr int kLogBurst = 5;
inline constexpr int kLogWindowSeconds = 10;
void LogRateLimited(std::string_view key, LogLevel level, std::string_view message);

// `message` with every control character (and DEL), the Unicode line breaks
// and bidirectional controls, and every byte that is not UTF-8 escaped.
std::string EscapeForLog(std::string_view message);

}  // namespace coalesce
