#include "service/validation.h"

#include <cmath>
#include <optional>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace coalesce::service {

absl::Status ValidateTokenIds(std::span<const int32_t> ids, int vocab_size,
                              absl::string_view field) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, "[", i, "] = ", ids[i], " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateGenerateRequest(const v1::GenerateRequest& request,
                                     const RequestLimits& limits) {
  using absl::InvalidArgumentError;
  using absl::StrCat;
  const bool has_text = !request.prompt().empty();
  const bool has_ids = request.prompt_token_ids_size() > 0;
  const bool has_messages = request.messages_size() > 0;
  // None is an empty prompt: unconditional generation, from BOS alone
  // (Prepare refuses it when the tokenizer adds no BOS).
  if (has_text + has_ids + has_messages > 1) {
    return InvalidArgumentError(
        StrCat("set exactly one of prompt, prompt_token_ids and messages; this request sets ",
               has_text ? (has_ids ? (has_messages ? "all three" : "prompt and prompt_token_ids")
                                   : "prompt and messages")
                        : "prompt_token_ids and messages"));
  }
  if (has_messages) {
    if (absl::Status s = ValidateMessages(request.messages(), limits); !s.ok()) return s;
  }
  if (has_ids) {
    const auto& ids = request.prompt_token_ids();
    if (absl::Status s = ValidateTokenIds({ids.data(), static_cast<size_t>(ids.size())},
                                          limits.vocab_size, "prompt_token_ids");
        !s.ok()) {
      return s;
    }
  }
  if (request.max_new_tokens() < 1) {
    return InvalidArgumentError(
        StrCat("max_new_tokens must be at least 1, got ", request.max_new_tokens()));
  }
  if (request.max_new_tokens() > limits.context_length) {
    return InvalidArgumentError(StrCat("max_new_tokens = ", request.max_new_tokens(),
                                       " exceeds the context length of ", limits.context_length,
                                       " tokens"));
  }
  const auto& sampling = request.sampling();
  if (!std::isfinite(sampling.temperature()) || sampling.temperature() < 0) {
    return InvalidArgumentError(
        StrCat("sampling.temperature must be finite and >= 0, got ", sampling.temperature()));
  }
  if (sampling.top_k() < 0) {
    return InvalidArgumentError(
        StrCat("sampling.top_k must be >= 0 (0: no limit), got ", sampling.top_k()));
  }
  if (sampling.has_top_p() && !(sampling.top_p() > 0.0f && sampling.top_p() <= 1.0f)) {
    return InvalidArgumentError(StrCat("sampling.top_p must be in (0, 1], got ", sampling.top_p()));
  }
  if (sampling.has_repetition_penalty() &&
      !(sampling.repetition_penalty() > 0.0f && sampling.repetition_penalty() <= 10.0f)) {
    return InvalidArgumentError(
        StrCat("sampling.repetition_penalty must be in (0, 10] (1: off), got ",
               sampling.repetition_penalty()));
  }
  if (!(sampling.frequency_penalty() >= -2.0f && sampling.frequency_penalty() <= 2.0f)) {
    return InvalidArgumentError(StrCat("sampling.frequency_penalty must be in [-2, 2], got ",
                                       sampling.frequency_penalty()));
  }
  if (!(sampling.presence_penalty() >= -2.0f && sampling.presence_penalty() <= 2.0f)) {
    return InvalidArgumentError(
        StrCat("sampling.presence_penalty must be in [-2, 2], got ", sampling.presence_penalty()));
  }
  if (!(sampling.min_p() >= 0.0f && sampling.min_p() <= 1.0f)) {
    return InvalidArgumentError(
        StrCat("sampling.min_p must be in [0, 1] (0: off), got ", sampling.min_p()));
  }
  if (sampling.min_tokens() < 0 || sampling.min_tokens() > request.max_new_tokens()) {
    return InvalidArgumentError(StrCat("sampling.min_tokens must be 0 to max_new_tokens (",
                                       request.max_new_tokens(), "), got ", sampling.min_tokens()));
  }
  if (sampling.stop_token_ids_size() > limits.max_stop_token_ids) {
    return InvalidArgumentError(StrCat("at most ", limits.max_stop_token_ids,
                                       " sampling.stop_token_ids are allowed, got ",
                                       sampling.stop_token_ids_size()));
  }
  {
    const auto& ids = sampling.stop_token_ids();
    if (absl::Status s = ValidateTokenIds({ids.data(), static_cast<size_t>(ids.size())},
                                          limits.vocab_size, "sampling.stop_token_ids");
        !s.ok()) {
      return s;
    }
  }
  if (static_cast<int>(sampling.logit_bias_size()) > limits.max_logit_bias) {
    return InvalidArgumentError(StrCat("sampling.logit_bias may have at most ",
                                       limits.max_logit_bias, " entries, got ",
                                       sampling.logit_bias_size()));
  }
  for (const auto& [id, bias] : sampling.logit_bias()) {
    if (id < 0 || id >= limits.vocab_size) {
      return InvalidArgumentError(StrCat("sampling.logit_bias key ", id,
                                         " is outside the vocabulary [0, ", limits.vocab_size,
                                         ")"));
    }
    if (!(bias >= -100.0f && bias <= 100.0f)) {
      return InvalidArgumentError(
          StrCat("sampling.logit_bias[", id, "] must be in [-100, 100], got ", bias));
    }
  }
  if (request.stop_size() > limits.max_stop_sequences) {
    return InvalidArgumentError(StrCat("at most ", limits.max_stop_sequences,
                                       " stop sequences are allowed, got ", request.stop_size()));
  }
  for (int i = 0; i < request.stop_size(); ++i) {
    const std::string& stop = request.stop(i);
    if (stop.empty() || static_cast<int>(stop.size()) > limits.max_stop_bytes) {
      return InvalidArgumentError(StrCat("stop[", i, "] must be 1 to ", limits.max_stop_bytes,
                                         " bytes, got ", stop.size()));
    }
  }
  if (static_cast<int>(request.request_id().size()) > limits.max_request_id_bytes) {
    return InvalidArgumentError(StrCat("request_id must be at most ", limits.max_request_id_bytes,
                                       " bytes, got ", request.request_id().size()));
  }
  if (static_cast<int>(request.cache_salt().size()) > limits.max_cache_salt_bytes) {
    return InvalidArgumentError(StrCat("cache_salt must be at most ", limits.max_cache_salt_bytes,
                                       " bytes, got ", request.cache_salt().size()));
  }
  if (request.top_logprobs() < 0 || request.top_logprobs() > limits.max_top_logprobs) {
    return InvalidArgumentError(StrCat("top_logprobs must be 0 to ", limits.max_top_logprobs,
                                       ", got ", request.top_logprobs()));
  }
  if (request.n() < 0 || request.n() > limits.max_samples) {
    return InvalidArgumentError(
        StrCat("n must be 1 to ", limits.max_samples, " samples (0: 1), got ", request.n()));
  }
  return absl::OkStatus();
}

absl::Status ValidateMessages(const google::protobuf::RepeatedPtrField<v1::ChatMessage>& messages,
                              const RequestLimits& limits) {
  if (messages.empty()) return absl::InvalidArgumentError("messages is empty: give at least one");
  if (messages.size() > limits.max_messages) {
    return absl::InvalidArgumentError(absl::StrCat("at most ", limits.max_messages,
                                                   " messages are allowed, got ", messages.size()));
  }
  for (int i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role();
    if (role.empty() || static_cast<int>(role.size()) > limits.max_role_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("messages[", i, "].role must be 1 to ",
                                                     limits.max_role_bytes, " bytes, got ",
                                                     role.size()));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateRoles(const google::protobuf::RepeatedPtrField<v1::ChatMessage>& messages,
                           const engine::Tokenizer& tokenizer) {
  for (int i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role();
    if (const std::optional<std::string> token = tokenizer.FindSpecialToken(role)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "messages[", i, "].role \"", absl::CHexEscape(role), "\" holds the special token \"",
          absl::CHexEscape(*token), "\": a role may not hold the model's special tokens"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidatePromptLength(int prompt_tokens, int max_new_tokens,
                                  const RequestLimits& limits) {
  if (prompt_tokens + max_new_tokens > limits.context_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the prompt (", prompt_tokens, " tokens) plus max_new_tokens (", max_new_tokens,
        ") exceeds the context length of ", limits.context_length, " tokens"));
  }
  return absl::OkStatus();
}

}  // namespace coalesce::service
