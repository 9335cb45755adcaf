#include "service/tenants.h"

#include <openssl/evp.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/read_file.h"
#include "nlohmann/json.hpp"

namespace coalesce::service {
namespace {

constexpr size_t kMaxFileBytes = 4 << 20;

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-';
  });
}

bool IsHex64(const std::string& s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) {
           return absl::ascii_isxdigit(static_cast<unsigned char>(c));
         });
}

}  // namespace

std::string Sha256Hex(std::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(data.data(), data.size(), digest, &length, EVP_sha256(), nullptr);
  std::string hex;
  for (unsigned int i = 0; i < length; ++i) absl::StrAppendFormat(&hex, "%02x", digest[i]);
  return hex;
}

absl::StatusOr<std::vector<TenantConfig>> ParseTenants(std::string_view text) {
  // Depth-limited by nlohmann's parser callback: a hostile file cannot
  // exhaust the stack.
  int depth = 0;
  bool too_deep = false;
  auto limit = [&](int d, nlohmann::json::parse_event_t event, nlohmann::json&) {
    (void)d;
    if (event == nlohmann::json::parse_event_t::object_start ||
        event == nlohmann::json::parse_event_t::array_start) {
      if (++depth > 8) too_deep = true;
    } else if (event == nlohmann::json::parse_event_t::object_end ||
               event == nlohmann::json::parse_event_t::array_end) {
      --depth;
    }
    return !too_deep;
  };
  nlohmann::json doc = nlohmann::json::parse(text.begin(), text.end(), limit,
                                             /*allow_exceptions=*/false);
  if (too_deep) return absl::InvalidArgumentError("nested deeper than 8 levels");
  if (doc.is_discarded()) return absl::InvalidArgumentError("not valid JSON");
  if (!doc.is_object() || !doc.contains("tenants") || !doc["tenants"].is_array()) {
    return absl::InvalidArgumentError(R"(expected {"tenants": [...]})");
  }
  for (const auto& [key, value] : doc.items()) {
    if (key != "tenants")
      return absl::InvalidArgumentError(absl::StrCat("unknown key \"", key, "\""));
  }
  const nlohmann::json& list = doc["tenants"];
  if (list.size() > static_cast<size_t>(kMaxTenants)) {
    return absl::InvalidArgumentError(absl::StrCat(list.size(), " tenants: at most ", kMaxTenants));
  }
  std::vector<TenantConfig> out;
  absl::flat_hash_map<std::string, size_t> names, keys, subjects;
  for (size_t i = 0; i < list.size(); ++i) {
    const nlohmann::json& t = list[i];
    auto fail = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat("tenants[", i, "]: ", why));
    };
    if (!t.is_object()) return fail("not an object");
    TenantConfig c;
    for (const auto& [key, value] : t.items()) {
      if (key == "name" || key == "key_sha256" || key == "client_cert_subject" ||
          key == "prefix_cache_group") {
        if (!value.is_string()) return fail(absl::StrCat(key, " must be a string"));
        std::string s = value.get<std::string>();
        if (key == "name") c.name = std::move(s);
        if (key == "key_sha256") c.key_sha256 = absl::AsciiStrToLower(s);
        if (key == "client_cert_subject") c.client_cert_subject = std::move(s);
        if (key == "prefix_cache_group") {
          if (!ValidName(s)) return fail("prefix_cache_group must be 1 to 64 of A-Z a-z 0-9 _ . -");
          c.prefix_cache_group = std::move(s);
        }
      } else if (key == "split_special_tokens") {
        if (!value.is_boolean()) return fail("split_special_tokens must be true or false");
        c.split_special_tokens = value.get<bool>();
      } else if (key == "weight") {
        if (!value.is_number()) return fail("weight must be a number");
        c.weight = value.get<double>();
        if (!(c.weight > 0 && c.weight <= 1000)) return fail("weight must be in (0, 1000]");
      } else if (key == "max_priority" || key == "max_streams" || key == "tokens_per_minute") {
        if (!value.is_number_integer()) return fail(absl::StrCat(key, " must be an integer"));
        const int64_t v = value.get<int64_t>();
        if (key == "max_priority") {
          if (v < -1000000 || v > 1000000) return fail("max_priority must be within ±1000000");
          c.max_priority = static_cast<int>(v);
        } else if (key == "max_streams") {
          if (v < 0 || v > 1000000) return fail("max_streams must be 0 (no limit) to 1000000");
          c.max_streams = static_cast<int>(v);
        } else {
          if (v < 0 || v > (int64_t{1} << 40))
            return fail("tokens_per_minute must be 0 (no limit) or positive");
          c.tokens_per_minute = v;
        }
      } else {
        return fail(absl::StrCat("unknown key \"", key, "\""));
      }
    }
    if (!ValidName(c.name)) return fail("name must be 1 to 64 of A-Z a-z 0-9 _ . -");
    if (c.key_sha256.empty() && c.client_cert_subject.empty()) {
      return fail("give key_sha256, client_cert_subject or both");
    }
    if (!c.key_sha256.empty() && !IsHex64(c.key_sha256)) {
      return fail("key_sha256 must be 64 hex digits (sha256sum of the key)");
    }
    if (!names.emplace(c.name, i).second) {
      return fail(absl::StrCat("name \"", c.name, "\" is also tenants[", names[c.name], "]'s"));
    }
    if (!c.key_sha256.empty() && !keys.emplace(c.key_sha256, i).second) {
      return fail(absl::StrCat("key_sha256 is also tenants[", keys[c.key_sha256], "]'s"));
    }
    if (!c.client_cert_subject.empty() && !subjects.emplace(c.client_cert_subject, i).second) {
      return fail(absl::StrCat("client_cert_subject is also tenants[",
                               subjects[c.client_cert_subject], "]'s"));
    }
    out.push_back(std::move(c));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Tenants>> Tenants::Load(std::string path, const Clock* clock,
                                                       absl::Duration recheck) {
  std::unique_ptr<Tenants> t(new Tenants(std::move(path), clock, recheck));
  absl::MutexLock lock(&t->mu_);
  if (absl::Status s = t->Reload(/*force=*/true); !s.ok()) return s;
  return t;
}

absl::Status Tenants::Reload(bool force) {
  struct stat st;
  if (stat(path_.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--api_keys_file=", path_, ": cannot read it"));
  }
  const FileStamp stamp{static_cast<int64_t>(st.st_size),
                        static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
                        static_cast<int64_t>(st.st_ino)};
  if (!force && stamp == stamp_) return absl::OkStatus();
  absl::StatusOr<std::string> text = ReadFile(path_, "--api_keys_file", kMaxFileBytes);
  if (!text.ok()) return text.status();
  absl::StatusOr<std::vector<TenantConfig>> parsed = ParseTenants(*text);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--api_keys_file=", path_, ": ", parsed.status().message()));
  }
  stamp_ = stamp;
  tenants_ = *std::move(parsed);
  by_key_.clear();
  by_subject_.clear();
  by_name_.clear();
  for (size_t i = 0; i < tenants_.size(); ++i) {
    if (!tenants_[i].key_sha256.empty()) by_key_[tenants_[i].key_sha256] = i;
    if (!tenants_[i].client_cert_subject.empty()) by_subject_[tenants_[i].client_cert_subject] = i;
    by_name_[tenants_[i].name] = i;
  }
  return absl::OkStatus();
}

void Tenants::MaybeReload() {
  const absl::Time now = clock_->Now();
  if (now - checked_ < recheck_) return;
  checked_ = now;
  const FileStamp before = stamp_;
  if (absl::Status s = Reload(/*force=*/false); !s.ok()) {
    Log(LogLevel::kError,
        absl::StrCat(s.message(), "; keeping the ", tenants_.size(), " tenants loaded before"));
    return;
  }
  if (!(stamp_ == before)) {
    Log(LogLevel::kInfo,
        absl::StrCat("--api_keys_file=", path_, ": reloaded, ", tenants_.size(), " tenants"));
  }
}

absl::StatusOr<Tenants::Caller> Tenants::Authenticate(std::string_view authorization,
                                                      std::string_view cert_subject) {
  absl::MutexLock lock(&mu_);
  MaybeReload();
  const TenantConfig* found = nullptr;
  if (!authorization.empty()) {
    constexpr std::string_view kBearer = "bearer ";
    if (authorization.size() <= kBearer.size() ||
        !absl::EqualsIgnoreCase(std::string(authorization.substr(0, kBearer.size())),
                                std::string(kBearer))) {
      return absl::UnauthenticatedError("the authorization header must be \"Bearer KEY\"");
    }
    const auto it = by_key_.find(Sha256Hex(authorization.substr(kBearer.size())));
    if (it == by_key_.end()) return absl::UnauthenticatedError("unknown API key");
    found = &tenants_[it->second];
  } else if (!cert_subject.empty()) {
    const auto it = by_subject_.find(std::string(cert_subject));
    if (it == by_subject_.end()) {
      return absl::UnauthenticatedError(
          absl::StrCat("no API key, and no tenant has the client certificate subject \"",
                       std::string(cert_subject), "\""));
    }
    found = &tenants_[it->second];
  } else {
    return absl::UnauthenticatedError(
        "this server needs an API key: send the metadata \"authorization: Bearer KEY\"");
  }
  Caller caller{found->name, found->weight, found->max_priority,
                found->prefix_cache_group.empty()
                    ? absl::StrCat("tenant:", found->name)
                    : absl::StrCat("group:", found->prefix_cache_group)};
  caller.split_special_tokens = found->split_special_tokens;
  return caller;
}

void Tenants::Refill(const std::string& tenant) {
  const TenantConfig& c = tenants_[by_name_.at(tenant)];
  Usage& u = usage_[tenant];
  const absl::Time now = clock_->Now();
  const double capacity = static_cast<double>(c.tokens_per_minute);
  if (!u.started) {
    u.started = true;
    u.budget = capacity;
  } else {
    u.budget = std::min(capacity, u.budget + capacity * absl::ToDoubleMinutes(now - u.refilled));
  }
  u.refilled = now;
}

absl::StatusOr<std::unique_ptr<Tenants::Stream>> Tenants::Open(const std::string& tenant,
                                                               int64_t tokens,
                                                               absl::Duration* retry_after) {
  absl::MutexLock lock(&mu_);
  const auto it = by_name_.find(tenant);
  if (it == by_name_.end()) {
    return absl::UnauthenticatedError(absl::StrCat("tenant ", tenant, " was removed"));
  }
  const TenantConfig& c = tenants_[it->second];
  Usage& u = usage_[tenant];
  if (c.max_streams > 0 && u.streams >= c.max_streams) {
    *retry_after = absl::Seconds(1);
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant ", tenant, " has ", u.streams, " streams open, its limit; retry when one ends"));
  }
  int64_t reserved = 0;
  if (c.tokens_per_minute > 0) {
    if (tokens > c.tokens_per_minute) {
      *retry_after = -absl::Milliseconds(1);
      return absl::ResourceExhaustedError(
          absl::StrCat("the request may use ", tokens,
                       " tokens (its prompt and max_new_tokens for each of "
                       "its samples) but tenant ",
                       tenant, "'s budget is ", c.tokens_per_minute,
                       " tokens per minute: lower max_new_tokens or n, or shorten the prompt"));
    }
    Refill(tenant);
    if (u.budget < static_cast<double>(tokens)) {
      const double per_minute = static_cast<double>(c.tokens_per_minute);
      *retry_after = absl::Minutes((static_cast<double>(tokens) - u.budget) / per_minute);
      return absl::ResourceExhaustedError(
          absl::StrCat("tenant ", tenant, " has used its ", c.tokens_per_minute,
                       " tokens per minute (this request may use ", tokens, "); retry in ",
                       absl::FormatDuration(absl::Ceil(*retry_after, absl::Milliseconds(1)))));
    }
    u.budget -= static_cast<double>(tokens);
    reserved = tokens;
  }
  ++u.streams;
  return std::unique_ptr<Stream>(new Stream(this, tenant, reserved));
}

void Tenants::Close(const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  --usage_[tenant].streams;
}

void Tenants::Settle(const std::string& tenant, int64_t reserved, int64_t used) {
  absl::MutexLock lock(&mu_);
  const auto it = by_name_.find(tenant);
  if (it == by_name_.end() || tenants_[it->second].tokens_per_minute == 0) return;
  Refill(tenant);
  // A budget never holds more than a minute's worth, refunds included.
  Usage& u = usage_[tenant];
  u.budget = std::min(static_cast<double>(tenants_[it->second].tokens_per_minute),
                      u.budget + static_cast<double>(reserved - used));
}

std::vector<std::string> Tenants::names() {
  absl::MutexLock lock(&mu_);
  MaybeReload();
  std::vector<std::string> out;
  for (const TenantConfig& c : tenants_) out.push_back(c.name);
  return out;
}

Tenants::Stream::~Stream() {
  if (!settled_) owner_->Settle(tenant_, reserved_, 0);
  owner_->Close(tenant_);
}

void Tenants::Stream::Charge(int64_t tokens) {
  if (std::exchange(settled_, true)) return;
  owner_->Settle(tenant_, reserved_, tokens);
}

}  // namespace coalesce::service
