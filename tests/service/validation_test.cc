#include "service/validation.h"

#include <cmath>
#include <limits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace coalesce::service {
namespace {

using ::testing::HasSubstr;

const RequestLimits kLimits{.vocab_size = 512, .context_length = 512};

v1::GenerateRequest Valid() {
  v1::GenerateRequest r;
  r.set_prompt("Once upon a time");
  r.set_max_new_tokens(16);
  return r;
}

// Expects INVALID_ARGUMENT whose message contains `words`.
void ExpectInvalid(const v1::GenerateRequest& r, const std::string& words) {
  absl::Status s = ValidateGenerateRequest(r, kLimits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(words));
}

TEST(ValidationTest, AcceptsAValidRequest) {
  EXPECT_TRUE(ValidateGenerateRequest(Valid(), kLimits).ok());
  v1::GenerateRequest ids = Valid();
  ids.clear_prompt();
  ids.add_prompt_token_ids(1);
  ids.add_prompt_token_ids(511);
  ids.mutable_sampling()->set_temperature(0.7f);
  ids.mutable_sampling()->set_top_p(1.0f);
  ids.mutable_sampling()->set_top_k(40);
  EXPECT_TRUE(ValidateGenerateRequest(ids, kLimits).ok());
}

TEST(ValidationTest, TakesNoInputAsAnEmptyPromptButNotTwo) {
  // None: unconditional generation (the service refuses it only when the
  // tokenizer adds no BOS to start from).
  v1::GenerateRequest none = Valid();
  none.clear_prompt();
  EXPECT_TRUE(ValidateGenerateRequest(none, kLimits).ok());
  v1::GenerateRequest both = Valid();
  both.add_prompt_token_ids(1);
  ExpectInvalid(both, "sets prompt and prompt_token_ids");
  v1::GenerateRequest chat = Valid();
  chat.clear_prompt();
  v1::ChatMessage* m = chat.add_messages();
  m->set_role("user");
  m->set_content("hi");
  EXPECT_TRUE(ValidateGenerateRequest(chat, kLimits).ok());
  chat.set_prompt("x");
  ExpectInvalid(chat, "sets prompt and messages");
  chat.add_prompt_token_ids(1);
  ExpectInvalid(chat, "sets all three");
  chat.clear_prompt();
  ExpectInvalid(chat, "sets prompt_token_ids and messages");
}

TEST(ValidationTest, MessagesHaveLimits) {
  v1::GenerateRequest r = Valid();
  r.clear_prompt();
  r.add_messages()->set_role("");
  ExpectInvalid(r, "messages[0].role must be 1 to 64 bytes, got 0");
  r.mutable_messages(0)->set_role(std::string(65, 'r'));
  ExpectInvalid(r, "got 65");
  r.mutable_messages(0)->set_role("user");
  EXPECT_TRUE(ValidateGenerateRequest(r, kLimits).ok());
  for (int i = 0; i < 1024; ++i) r.add_messages()->set_role("user");
  ExpectInvalid(r, "at most 1024 messages are allowed, got 1025");
  google::protobuf::RepeatedPtrField<v1::ChatMessage> empty;
  EXPECT_FALSE(ValidateMessages(empty, kLimits).ok());
}

TEST(ValidationTest, TokenIdsMustBeInTheVocabulary) {
  for (int32_t bad : {-1, 512}) {
    v1::GenerateRequest r = Valid();
    r.clear_prompt();
    r.add_prompt_token_ids(1);
    r.add_prompt_token_ids(bad);
    ExpectInvalid(r, "prompt_token_ids[1] = " + std::to_string(bad));
  }
}

TEST(ValidationTest, MaxNewTokensMustBePositiveAndFit) {
  v1::GenerateRequest r = Valid();
  r.set_max_new_tokens(0);
  ExpectInvalid(r, "max_new_tokens must be at least 1");
  r.set_max_new_tokens(1000000);
  ExpectInvalid(r, "exceeds the context length");
  EXPECT_EQ(ValidatePromptLength(500, 13, kLimits).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidatePromptLength(500, 12, kLimits).ok());
}

TEST(ValidationTest, SamplingParametersAreChecked) {
  for (float t : {-1.0f, std::nanf(""), std::numeric_limits<float>::infinity()}) {
    v1::GenerateRequest r = Valid();
    r.mutable_sampling()->set_temperature(t);
    ExpectInvalid(r, "temperature");
  }
  for (float p : {0.0f, -0.5f, 1.5f}) {
    v1::GenerateRequest r = Valid();
    r.mutable_sampling()->set_top_p(p);
    ExpectInvalid(r, "top_p must be in (0, 1]");
  }
  v1::GenerateRequest r = Valid();
  r.mutable_sampling()->set_top_k(-1);
  ExpectInvalid(r, "top_k must be >= 0");
}

TEST(ValidationTest, SamplingControlsAreChecked) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  auto with = [](auto set) {
    v1::GenerateRequest r = Valid();
    set(*r.mutable_sampling());
    return r;
  };
  // At the edges of their ranges they are accepted.
  EXPECT_TRUE(ValidateGenerateRequest(with([](v1::SamplingParams& s) {
                                        s.set_repetition_penalty(10.0f);
                                        s.set_frequency_penalty(-2.0f);
                                        s.set_presence_penalty(2.0f);
                                        s.set_min_p(1.0f);
                                        s.set_min_tokens(16);
                                        s.set_ignore_eos(true);
                                        for (int i = 0; i < 16; ++i) s.add_stop_token_ids(511 - i);
                                        (*s.mutable_logit_bias())[0] = -100.0f;
                                        (*s.mutable_logit_bias())[511] = 100.0f;
                                      }),
                                      kLimits)
                  .ok());
  for (float bad : {0.0f, -1.0f, 10.5f, nan, inf}) {
    ExpectInvalid(with([&](v1::SamplingParams& s) { s.set_repetition_penalty(bad); }),
                  "sampling.repetition_penalty must be in (0, 10]");
  }
  for (float bad : {-2.5f, 2.01f, nan}) {
    ExpectInvalid(with([&](v1::SamplingParams& s) { s.set_frequency_penalty(bad); }),
                  "sampling.frequency_penalty must be in [-2, 2]");
    ExpectInvalid(with([&](v1::SamplingParams& s) { s.set_presence_penalty(bad); }),
                  "sampling.presence_penalty must be in [-2, 2]");
  }
  for (float bad : {-0.1f, 1.5f, nan}) {
    ExpectInvalid(with([&](v1::SamplingParams& s) { s.set_min_p(bad); }),
                  "sampling.min_p must be in [0, 1]");
  }
  ExpectInvalid(with([](v1::SamplingParams& s) { s.set_min_tokens(-1); }),
                "sampling.min_tokens must be 0 to max_new_tokens (16), got -1");
  ExpectInvalid(with([](v1::SamplingParams& s) { s.set_min_tokens(17); }),
                "sampling.min_tokens must be 0 to max_new_tokens (16), got 17");
  ExpectInvalid(with([](v1::SamplingParams& s) {
                  for (int i = 0; i < 17; ++i) s.add_stop_token_ids(i);
                }),
                "at most 16 sampling.stop_token_ids are allowed, got 17");
  ExpectInvalid(with([](v1::SamplingParams& s) {
                  s.add_stop_token_ids(3);
                  s.add_stop_token_ids(512);
                }),
                "sampling.stop_token_ids[1] = 512 is outside the vocabulary [0, 512)");
  ExpectInvalid(with([](v1::SamplingParams& s) { (*s.mutable_logit_bias())[-1] = 1.0f; }),
                "sampling.logit_bias key -1 is outside the vocabulary [0, 512)");
  for (float bad : {100.5f, -101.0f, nan, inf}) {
    ExpectInvalid(with([&](v1::SamplingParams& s) { (*s.mutable_logit_bias())[7] = bad; }),
                  "sampling.logit_bias[7] must be in [-100, 100]");
  }
  ExpectInvalid(with([](v1::SamplingParams& s) {
                  for (int i = 0; i < 1025; ++i) (*s.mutable_logit_bias())[i] = 1.0f;
                }),
                "sampling.logit_bias may have at most 1024 entries, got 1025");
}

TEST(ValidationTest, StopSequencesAndRequestIdAreBounded) {
  v1::GenerateRequest many = Valid();
  for (int i = 0; i < 17; ++i) many.add_stop("x");
  ExpectInvalid(many, "at most 16 stop sequences");
  v1::GenerateRequest empty = Valid();
  empty.add_stop("");
  ExpectInvalid(empty, "stop[0]");
  v1::GenerateRequest long_id = Valid();
  long_id.set_request_id(std::string(257, 'a'));
  ExpectInvalid(long_id, "request_id");
}

TEST(ValidationTest, SamplesAreOneToSixteen) {
  for (const int n : {-1, 17, 1000}) {
    v1::GenerateRequest r = Valid();
    r.set_n(n);
    ExpectInvalid(r, "n must be 1 to 16");
  }
  for (const int n : {0, 1, 16}) {
    v1::GenerateRequest r = Valid();
    r.set_n(n);
    EXPECT_TRUE(ValidateGenerateRequest(r, kLimits).ok()) << n;
  }
}

}  // namespace
}  // namespace coalesce::service
