// libFuzzer target for the tenants file (--api_keys_file, service/tenants.h).
// An input is the file's bytes: ParseTenants must return tenants that obey
// the file's rules (names of 1 to 64 allowed bytes, unique names, keys and
// subjects; weights in (0, 1000]; at most kMaxTenants) or InvalidArgument --
// never crash, hang or accept something out of range.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>
#include <string_view>

#include "service/tenants.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view json(reinterpret_cast<const char*>(data), size);
  const auto tenants = coalesce::service::ParseTenants(json);
  if (!tenants.ok()) {
    if (tenants.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  if (tenants->size() > static_cast<size_t>(coalesce::service::kMaxTenants)) std::abort();
  std::set<std::string> names, keys, subjects;
  for (const auto& t : *tenants) {
    if (t.name.empty() || t.name.size() > 64) std::abort();
    for (const char c : t.name) {
      const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '_' || c == '.' || c == '-';
      if (!ok) std::abort();
    }
    if (!(t.weight > 0 && t.weight <= 1000)) std::abort();
    if (t.max_streams < 0 || t.tokens_per_minute < 0) std::abort();
    if (t.key_sha256.empty() && t.client_cert_subject.empty()) std::abort();
    if (!t.key_sha256.empty() && t.key_sha256.size() != 64) std::abort();
    if (!names.insert(t.name).second) std::abort();
    if (!t.key_sha256.empty() && !keys.insert(t.key_sha256).second) std::abort();
    if (!t.client_cert_subject.empty() && !subjects.insert(t.client_cert_subject).second) {
      std::abort();
    }
  }
  return 0;
}
