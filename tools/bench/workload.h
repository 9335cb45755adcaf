// What coalesce-bench sends: the prompt and output length of each request,
// drawn from fixed values, uniform ranges, or a JSON-lines file.
//
// Generated prompts are token ids, not text, so that their length is exact
// whatever the tokenizer does: a BOS token, then ids drawn uniformly from the
// vocabulary (special ids excluded). The server has no "ignore EOS" switch, so
// max_new_tokens is an upper bound: the model may end a generation early with
// EOS, and the report counts the tokens that actually arrived.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace coalesce::bench {

// An inclusive range of ints, written "128" (lo == hi), "64:256" (uniform)
// or "16:512:log" (log-uniform: every factor of 2 in the range equally
// likely, so short values are common and long ones rare, as output lengths
// of real traffic are). Usable as an absl flag type.
struct IntRange {
  int lo = 0;
  int hi = 0;
  bool log = false;
};
bool AbslParseFlag(absl::string_view text, IntRange* range, std::string* error);
std::string AbslUnparseFlag(const IntRange& range);

// One request. Exactly one of `prompt` and `prompt_token_ids` is set.
struct RequestSpec {
  std::string prompt;                     // text, encoded by the server (BOS added)
  std::vector<int32_t> prompt_token_ids;  // [prompt_tokens], used as given
  int max_new_tokens = 0;
};

// What the server told GetModelInfo, as far as building requests needs it.
struct ModelLimits {
  int vocab_size = 0;
  int context_length = 0;
  int bos_token_id = -1;  // -1: none; otherwise the first id of every generated prompt
  std::vector<int32_t> eos_token_ids;
};

struct WorkloadOptions {
  IntRange prompt_tokens{128, 128};   // generated prompts, BOS included
  IntRange max_new_tokens{128, 128};  // also the default of file entries without one
  std::string file;                   // JSON lines; empty: generated prompts
  uint64_t seed = 0;
  // Generated prompts only. A system prompt of this many tokens (BOS first)
  // that every request starts with; prompt_tokens is then the length of
  // each request's own part after it.
  int shared_prefix_tokens = 0;
  // Generated prompts only. Each conversation is this many requests: the
  // first sends its prompt; each next one re-sends the conversation so far
  // (the previous prompt and the answer it got) plus a new message of
  // prompt_tokens tokens (NextTurn).
  int turns = 1;
};

// Hands out requests in a fixed order that depends only on the options and
// the seed, so that closed- and open-loop runs with the same seed send the same
// requests. Not thread-safe: the bench's driver thread alone calls Next().
class Workload {
 public:
  // Fails on ranges that are empty, below 1, or do not fit the context, and on
  // a file that cannot be read or parsed (the message names the line).
  static absl::StatusOr<Workload> Create(const WorkloadOptions& options, const ModelLimits& limits);

  // The first request of a conversation.
  RequestSpec Next();
  // The next turn: `history` (the previous turn's prompt and answer) plus a
  // new message.
  RequestSpec NextTurn(std::vector<int32_t> history);

  // "prompt 64:256 tokens, max_new_tokens 128" or "workload FILE (N entries)".
  std::string Describe() const;

 private:
  Workload(const WorkloadOptions& options, const ModelLimits& limits);

  WorkloadOptions options_;
  ModelLimits limits_;
  std::vector<RequestSpec> entries_;  // from the file; cycled through in order
  size_t next_entry_ = 0;
  int Draw(IntRange range);
  void AppendRandom(std::vector<int32_t>& ids, int n);

  std::vector<int32_t> ordinary_ids_;  // ids a generated prompt may use (no BOS/EOS)
  std::vector<int32_t> shared_prefix_;
  std::mt19937_64 rng_;
};

// Parses a JSON-lines workload: one object per non-blank line, with "prompt"
// (a string) or "prompt_token_ids" (an array of ids), and optionally
// "max_new_tokens". Entries without max_new_tokens get 0, for the caller to
// fill. Exposed for tests.
absl::StatusOr<std::vector<RequestSpec>> ParseWorkload(absl::string_view contents,
                                                       const ModelLimits& limits);

}  // namespace coalesce::bench
