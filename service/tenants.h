// Tenants of a shared server (--api_keys_file): who may call, and each
// caller's weight, priority cap and limits. A client names itself with
// `authorization: Bearer KEY`; the file holds only each key's SHA-256, so a
// leaked file or log gives no key away. With mutual TLS a tenant may instead
// be named by its client certificate's subject. The file is re-read when it
// changes (its size, modification time or inode), at most once per
// `recheck`; a file that no longer parses keeps the tenants already loaded
// (and says why in the log).
//
// The file (JSON):
//   {"tenants": [
//     {"name": "search",            // [A-Za-z0-9_.-], 1 to 64 bytes, unique
//      "key_sha256": "9f86d0...",   // hex SHA-256 of the key, unique
//      "client_cert_subject": "CN=search,O=Acme",  // instead of, or beside, a key
//      "weight": 2,                 // share of the batch, (0, 1000]; default 1
//      "max_priority": 5,           // higher request priorities are capped; default 0
//      "max_streams": 64,           // Generate calls at once; default 0: no limit
//      "tokens_per_minute": 200000, // prompt + generated tokens; default 0: no limit
//      "prefix_cache_group": "acme", // shares cached prompts with the group's tenants
//      "split_special_tokens": true // its requests' special tokens are text, whatever
//                                   // they ask (GenerateRequest.split_special_tokens)
//     }, ...]}
//
// Prefix caching: a tenant's cached prompt blocks are reachable only by its
// own requests (Caller::cache_partition enters the root of the blocks'
// hash chains), or by those of the tenants of its prefix_cache_group.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace coalesce::service {

struct TenantConfig {
  std::string name;
  std::string key_sha256;  // lower-case hex; empty: named by certificate only
  std::string client_cert_subject;
  double weight = 1.0;
  int max_priority = 0;
  int max_streams = 0;
  int64_t tokens_per_minute = 0;
  std::string prefix_cache_group;  // empty: shares its cached prompts with nobody
  bool split_special_tokens = false;
};

// At most this many tenants (they label metrics).
inline constexpr int kMaxTenants = 1000;

// The file's tenants; INVALID_ARGUMENT naming the entry and the field.
absl::StatusOr<std::vector<TenantConfig>> ParseTenants(std::string_view json);

// Lower-case hex SHA-256 of `data`: how a key is stored.
std::string Sha256Hex(std::string_view data);

class Tenants {
 public:
  // Reads and parses `path`: an error names the file.
  static absl::StatusOr<std::unique_ptr<Tenants>> Load(std::string path, const Clock* clock,
                                                       absl::Duration recheck = absl::Seconds(1));

  struct Caller {
    std::string name;
    double weight = 1.0;
    int max_priority = 0;
    // Who shares its cached prompt blocks (GenerationRequest::cache_partition):
    // "tenant:NAME", or "group:GROUP" with a prefix_cache_group.
    std::string cache_partition;
    // Its requests' text is tokenized with split_special_tokens, whatever
    // they ask.
    bool split_special_tokens = false;
  };
  // The tenant of `authorization` (the header's value, "Bearer KEY") or,
  // without one, of `cert_subject` (a verified client certificate's subject;
  // empty: none). UNAUTHENTICATED otherwise; the message never holds the key.
  absl::StatusOr<Caller> Authenticate(std::string_view authorization,
                                      std::string_view cert_subject);

  // A Generate call holding one of its tenant's streams until destroyed.
  class Stream {
   public:
    ~Stream();
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    // Settles the call: it used `tokens` (prompt and generated) of those it
    // reserved; the rest go back to the tenant's budget. Once; a stream
    // destroyed unsettled gives back all it reserved.
    void Charge(int64_t tokens);

   private:
    friend class Tenants;
    Stream(Tenants* owner, std::string tenant, int64_t reserved)
        : owner_(owner), tenant_(std::move(tenant)), reserved_(reserved) {}
    Tenants* owner_;
    std::string tenant_;
    int64_t reserved_;  // from the budget, at Open
    bool settled_ = false;
  };
  // Opens a stream for `tenant`, reserving `tokens` (the most the call can
  // use: its prompt, and max_new_tokens for each sample) from its budget.
  // RESOURCE_EXHAUSTED when all its streams are in use or the budget holds
  // fewer tokens than that, with `retry_after` set to when to try again;
  // or when `tokens` exceed a whole minute's budget, so that no wait would
  // do: then `retry_after` is negative (do not retry).
  absl::StatusOr<std::unique_ptr<Stream>> Open(const std::string& tenant, int64_t tokens,
                                               absl::Duration* retry_after);

  std::vector<std::string> names();

 private:
  Tenants(std::string path, const Clock* clock, absl::Duration recheck)
      : path_(std::move(path)), clock_(clock), recheck_(recheck) {}
  struct FileStamp {
    int64_t size = -1, mtime_ns = -1, inode = -1;
    bool operator==(const FileStamp&) const = default;
  };
  // Reads the file if it changed; OK if it did not.
  absl::Status Reload(bool force) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeReload() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Refill(const std::string& tenant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Close(const std::string& tenant);
  // Returns `reserved` - `used` tokens to the tenant's budget (takes more if
  // used exceeds reserved).
  void Settle(const std::string& tenant, int64_t reserved, int64_t used);

  const std::string path_;
  const Clock* const clock_;
  const absl::Duration recheck_;
  absl::Mutex mu_;
  std::vector<TenantConfig> tenants_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, size_t> by_key_ ABSL_GUARDED_BY(mu_);      // sha256 -> index
  absl::flat_hash_map<std::string, size_t> by_subject_ ABSL_GUARDED_BY(mu_);  // subject -> index
  absl::flat_hash_map<std::string, size_t> by_name_ ABSL_GUARDED_BY(mu_);
  // What each tenant uses, kept across reloads by name.
  struct Usage {
    int streams = 0;
    double budget = 0;  // tokens available, less those reserved by open calls
    absl::Time refilled;
    bool started = false;
  };
  absl::flat_hash_map<std::string, Usage> usage_ ABSL_GUARDED_BY(mu_);
  FileStamp stamp_ ABSL_GUARDED_BY(mu_);
  absl::Time checked_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace coalesce::service
