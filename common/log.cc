#include "common/log.h"

#include <atomic>
#include <cstdio>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace coalesce {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
}  // namespace

void SetLogLevel(LogLevel level) { g_level = static_cast<int>(level); }

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level; }

void Log(LogLevel level, std::string_view message) {
  if (!LogEnabled(level)) return;
  static constexpr char kLetters[] = {'D', 'I', 'W', 'E'};
  std::string line = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone());
  line += ' ';
  line += kLetters[static_cast<int>(level)];
  line += ' ';
  line.append(message);
  line += '\n';
  // One fwrite per line keeps lines from different threads whole.
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace coalesce
