#include "common/log.h"

#include <atomic>
#include <cstdio>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/utf8.h"

namespace coalesce {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

// What LogRateLimited remembers of one key.
struct Budget {
  absl::Time window_start;
  int written = 0;     // lines written in this window
  int suppressed = 0;  // lines dropped since the last one written
};

// Characters beyond ASCII that a terminal or log viewer acts on: the C1
// controls (NEL breaks a line, CSI starts an escape sequence), the line and
// paragraph separators, and the bidirectional controls that make text show
// in another order than it was written ("Trojan Source").
bool IsUnsafeCodePoint(char32_t cp) {
  return (cp >= 0x80 && cp <= 0x9F) || cp == 0x2028 || cp == 0x2029 || cp == 0x061C ||
         cp == 0x200E || cp == 0x200F || (cp >= 0x202A && cp <= 0x202E) ||
         (cp >= 0x2066 && cp <= 0x2069);
}

}  // namespace

void SetLogLevel(LogLevel level) { g_level = static_cast<int>(level); }

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level; }

std::string EscapeForLog(std::string_view message) {
  std::string out;
  out.reserve(message.size());
  size_t i = 0;
  while (i < message.size()) {
    const char c = message[i];
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x80) {
      char32_t cp = 0;
      const int length = DecodeUtf8Sequence(message.substr(i), &cp);
      if (length == 0) {
        absl::StrAppendFormat(&out, "\\x%02x", byte);
        ++i;
      } else {
        if (IsUnsafeCodePoint(cp)) {
          absl::StrAppendFormat(&out, "\\u%04x", static_cast<uint32_t>(cp));
        } else {
          out.append(message.substr(i, length));
        }
        i += length;
      }
      continue;
    }
    ++i;
    if (byte >= 0x20 && byte != 0x7f) {
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else {
      absl::StrAppendFormat(&out, "\\x%02x", byte);
    }
  }
  return out;
}

void Log(LogLevel level, std::string_view message) {
  if (!LogEnabled(level)) return;
  static constexpr char kLetters[] = {'D', 'I', 'W', 'E'};
  std::string line = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone());
  line += ' ';
  line += kLetters[static_cast<int>(level)];
  line += ' ';
  line += EscapeForLog(message);
  line += '\n';
  // One fwrite per line keeps lines from different threads whole.
  std::fwrite(line.data(), 1, line.size(), stderr);
}

void LogRateLimited(std::string_view key, LogLevel level, std::string_view message) {
  if (!LogEnabled(level)) return;
  static absl::Mutex mu(absl::kConstInit);
  static auto* budgets ABSL_GUARDED_BY(mu) = new absl::flat_hash_map<std::string, Budget>();
  int suppressed = 0;
  {
    absl::MutexLock lock(&mu);
    const absl::Time now = absl::Now();
    Budget& b = (*budgets)[std::string(key)];
    if (now - b.window_start >= absl::Seconds(kLogWindowSeconds)) {
      b.window_start = now;
      b.written = 0;
    }
    if (b.written >= kLogBurst) {
      ++b.suppressed;
      return;
    }
    ++b.written;
    suppressed = b.suppressed;
    b.suppressed = 0;
  }
  if (suppressed == 0) {
    Log(level, message);
  } else {
    Log(level, absl::StrCat(absl::string_view(message.data(), message.size()), " (", suppressed,
                            " similar lines suppressed)"));
  }
}

}  // namespace coalesce
