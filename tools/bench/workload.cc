#include "tools/bench/workload.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace coalesce::bench {

// ---------------------------------------------------------------------------
// IntRange
// ---------------------------------------------------------------------------

bool AbslParseFlag(absl::string_view text, IntRange* range, std::string* error) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  IntRange r;
  if (parts.size() == 3 && parts[2] == "log") {
    r.log = true;
    parts.pop_back();
  }
  if (parts.size() > 2) {
    *error = "expected N, LO:HI or LO:HI:log";
    return false;
  }
  if (!absl::SimpleAtoi(parts[0], &r.lo)) {
    *error = absl::StrCat("not an integer: '", parts[0], "'");
    return false;
  }
  r.hi = r.lo;
  if (parts.size() == 2 && !absl::SimpleAtoi(parts[1], &r.hi)) {
    *error = absl::StrCat("not an integer: '", parts[1], "'");
    return false;
  }
  if (r.lo > r.hi) {
    *error = "LO must not exceed HI";
    return false;
  }
  if (r.log && r.lo < 1) {
    *error = "a log-uniform range must start at 1 or more";
    return false;
  }
  *range = r;
  return true;
}

std::string AbslUnparseFlag(const IntRange& range) {
  if (range.lo == range.hi) return absl::StrCat(range.lo);
  return absl::StrCat(range.lo, ":", range.hi, range.log ? ":log" : "");
}

// ---------------------------------------------------------------------------
// File
// ---------------------------------------------------------------------------

absl::StatusOr<std::vector<RequestSpec>> ParseWorkload(absl::string_view contents,
                                                       const ModelLimits& limits) {
  std::vector<RequestSpec> entries;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(contents, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    auto fail = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_number, ": ", why));
    };
    const nlohmann::json j =
        nlohmann::json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) return fail("not a JSON object");
    RequestSpec spec;
    const bool has_text = j.contains("prompt");
    const bool has_ids = j.contains("prompt_token_ids");
    if (has_text == has_ids) return fail("needs exactly one of prompt and prompt_token_ids");
    if (has_text) {
      if (!j["prompt"].is_string() || j["prompt"].get<std::string>().empty()) {
        return fail("prompt must be a non-empty string");
      }
      spec.prompt = j["prompt"].get<std::string>();
    } else {
      const nlohmann::json& ids = j["prompt_token_ids"];
      if (!ids.is_array() || ids.empty()) return fail("prompt_token_ids must be a non-empty array");
      for (const nlohmann::json& id : ids) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
            id.get<int64_t>() >= limits.vocab_size) {
          return fail(
              absl::StrCat("prompt_token_ids must be integers in [0, ", limits.vocab_size, ")"));
        }
        spec.prompt_token_ids.push_back(id.get<int32_t>());
      }
    }
    if (j.contains("max_new_tokens")) {
      const nlohmann::json& n = j["max_new_tokens"];
      if (!n.is_number_integer() || n.get<int64_t>() < 1 || n.get<int64_t>() > (1 << 30)) {
        return fail("max_new_tokens must be a positive integer");
      }
      spec.max_new_tokens = n.get<int>();
    }
    entries.push_back(std::move(spec));
  }
  if (entries.empty()) return absl::InvalidArgumentError("no requests in the file");
  return entries;
}

// ---------------------------------------------------------------------------
// Workload
// ---------------------------------------------------------------------------

Workload::Workload(const WorkloadOptions& options, const ModelLimits& limits)
    : options_(options), limits_(limits), rng_(options.seed) {}

absl::StatusOr<Workload> Workload::Create(const WorkloadOptions& options,
                                          const ModelLimits& limits) {
  if (limits.vocab_size < 1 || limits.context_length < 2) {
    return absl::InvalidArgumentError("the model reports no vocabulary or context");
  }
  if (options.max_new_tokens.lo < 1) {
    return absl::InvalidArgumentError("--max_new_tokens must be at least 1");
  }
  if (options.shared_prefix_tokens < 0 || options.turns < 1) {
    return absl::InvalidArgumentError("--shared_prefix_tokens must be >= 0 and --turns at least 1");
  }
  if (!options.file.empty() && (options.shared_prefix_tokens > 0 || options.turns > 1)) {
    return absl::InvalidArgumentError(
        "--shared_prefix_tokens and --turns generate their prompts: not with --workload");
  }
  Workload workload(options, limits);
  if (!options.file.empty()) {
    std::ifstream in(options.file, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", options.file));
    std::stringstream contents;
    contents << in.rdbuf();
    absl::StatusOr<std::vector<RequestSpec>> entries = ParseWorkload(contents.str(), limits);
    if (!entries.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(options.file, ": ", entries.status().message()));
    }
    workload.entries_ = *std::move(entries);
    return workload;
  }

  if (options.prompt_tokens.lo < 1) {
    return absl::InvalidArgumentError("--prompt_tokens must be at least 1");
  }
  // Checked here rather than left to the server: a range the server refuses
  // would turn the whole run into INVALID_ARGUMENT failures.
  const int64_t longest =
      options.shared_prefix_tokens +
      static_cast<int64_t>(options.turns) * (options.prompt_tokens.hi + options.max_new_tokens.hi);
  if (longest > limits.context_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        options.shared_prefix_tokens > 0
            ? absl::StrCat("--shared_prefix_tokens (", options.shared_prefix_tokens, ") plus ")
            : "",
        options.turns > 1 ? absl::StrCat(options.turns, " turns of ") : "",
        "--prompt_tokens (up to ", options.prompt_tokens.hi, ") plus --max_new_tokens (up to ",
        options.max_new_tokens.hi, ") exceed the model's context of ", limits.context_length,
        " tokens"));
  }
  // Special ids are left out of the random part of a prompt: an EOS or BOS in
  // the middle of a prompt is not what real traffic looks like.
  for (int32_t id = 0; id < limits.vocab_size; ++id) {
    if (id == limits.bos_token_id) continue;
    if (std::find(limits.eos_token_ids.begin(), limits.eos_token_ids.end(), id) !=
        limits.eos_token_ids.end()) {
      continue;
    }
    workload.ordinary_ids_.push_back(id);
  }
  if (workload.ordinary_ids_.empty()) workload.ordinary_ids_.push_back(0);
  if (options.shared_prefix_tokens > 0) {
    if (limits.bos_token_id >= 0) workload.shared_prefix_.push_back(limits.bos_token_id);
    workload.AppendRandom(
        workload.shared_prefix_,
        options.shared_prefix_tokens - static_cast<int>(workload.shared_prefix_.size()));
  }
  return workload;
}

int Workload::Draw(IntRange r) {
  if (r.log && r.lo < r.hi) {
    // exp of a uniform draw over [ln lo, ln (hi + 1)), rounded down.
    const double u =
        std::uniform_real_distribution<double>(std::log(r.lo), std::log(r.hi + 1.0))(rng_);
    return std::clamp(static_cast<int>(std::exp(u)), r.lo, r.hi);
  }
  return std::uniform_int_distribution<int>(r.lo, r.hi)(rng_);
}

void Workload::AppendRandom(std::vector<int32_t>& ids, int n) {
  std::uniform_int_distribution<size_t> pick(0, ordinary_ids_.size() - 1);
  for (int i = 0; i < n; ++i) ids.push_back(ordinary_ids_[pick(rng_)]);
}

RequestSpec Workload::NextTurn(std::vector<int32_t> history) {
  RequestSpec spec;
  spec.prompt_token_ids = std::move(history);
  const int length = Draw(options_.prompt_tokens);
  spec.max_new_tokens = Draw(options_.max_new_tokens);
  AppendRandom(spec.prompt_token_ids, length);
  return spec;
}

RequestSpec Workload::Next() {
  if (!entries_.empty()) {
    RequestSpec spec = entries_[next_entry_];
    next_entry_ = (next_entry_ + 1) % entries_.size();
    if (spec.max_new_tokens == 0) spec.max_new_tokens = Draw(options_.max_new_tokens);
    return spec;
  }
  RequestSpec spec;
  const int length = Draw(options_.prompt_tokens);
  spec.max_new_tokens = Draw(options_.max_new_tokens);
  spec.prompt_token_ids.reserve(shared_prefix_.size() + length);
  spec.prompt_token_ids = shared_prefix_;
  // Without a shared prefix, the request's own part starts with BOS.
  if (shared_prefix_.empty() && length > 0 && limits_.bos_token_id >= 0) {
    spec.prompt_token_ids.push_back(limits_.bos_token_id);
    AppendRandom(spec.prompt_token_ids, length - 1);
  } else {
    AppendRandom(spec.prompt_token_ids, length);
  }
  return spec;
}

std::string Workload::Describe() const {
  if (!entries_.empty()) {
    return absl::StrCat("workload ", options_.file, " (", entries_.size(),
                        " entries, in order), max_new_tokens ",
                        AbslUnparseFlag(options_.max_new_tokens), " where unset");
  }
  std::string out;
  if (!shared_prefix_.empty()) {
    absl::StrAppend(&out, "shared prefix ", shared_prefix_.size(), " tokens + ");
  }
  absl::StrAppend(&out, "prompt ", AbslUnparseFlag(options_.prompt_tokens),
                  " tokens, max_new_tokens ", AbslUnparseFlag(options_.max_new_tokens));
  if (options_.turns > 1) {
    absl::StrAppend(&out, "; conversations of ", options_.turns,
                    " turns, each re-sending the conversation so far");
  }
  return out;
}

}  // namespace coalesce::bench
