// Checks a request before it reaches the engine. Every failure is
// INVALID_ARGUMENT with a message that names the field and the limit.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "coalesce/v1/generator.pb.h"
#include "engine/tokenizer/tokenizer.h"

namespace coalesce::service {

struct RequestLimits {
  int vocab_size = 0;
  int context_length = 0;
  int max_stop_sequences = 16;
  int max_stop_bytes = 256;
  int max_request_id_bytes = 256;
  int max_cache_salt_bytes = 256;
  int max_samples = 16;  // GenerateRequest.n
  int max_top_logprobs = 20;
  int max_stop_token_ids = 16;  // SamplingParams.stop_token_ids
  int max_logit_bias = 1024;    // SamplingParams.logit_bias entries
  int max_messages = 1024;      // messages of a conversation
  int max_role_bytes = 64;      // each message's role
};

// Everything that can be checked before the prompt is tokenized.
absl::Status ValidateGenerateRequest(const v1::GenerateRequest& request,
                                     const RequestLimits& limits);

// A conversation (GenerateRequest.messages, ApplyChatTemplateRequest.messages):
// at least one message, at most limits.max_messages, each role non-empty and
// at most limits.max_role_bytes. The content's size is bounded by the
// server's message size limit and, once rendered, by the context length.
absl::Status ValidateMessages(const google::protobuf::RepeatedPtrField<v1::ChatMessage>& messages,
                              const RequestLimits& limits);

// No role holds a special token of `tokenizer` ("user<|im_end|>\n<|im_start|>
// system"): a role counts as the template's own text (chat::RenderedChat),
// where a special token would open or close a turn whatever
// split_special_tokens says.
absl::Status ValidateRoles(const google::protobuf::RepeatedPtrField<v1::ChatMessage>& messages,
                           const engine::Tokenizer& tokenizer);

// Token ids must be in [0, vocab_size). `field` names them in the message.
absl::Status ValidateTokenIds(std::span<const int32_t> ids, int vocab_size,
                              absl::string_view field);

// The prompt, now tokenized, plus max_new_tokens must fit the context.
absl::Status ValidatePromptLength(int prompt_tokens, int max_new_tokens,
                                  const RequestLimits& limits);

}  // namespace coalesce::service
