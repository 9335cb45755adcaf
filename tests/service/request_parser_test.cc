// Requests from their wire bytes: every malformed input is INVALID_ARGUMENT
// naming the problem, and the field when one is to blame.
#include "service/request_parser.h"

#include <random>
#include <string>

#include "coalesce/v1/generator.pb.h"
#include "engine/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace coalesce::service {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// A length-delimited field: tag, one-byte length, payload.
std::string Field(int number, const std::string& payload) {
  return std::string(1, static_cast<char>(number << 3 | 2)) +
         std::string(1, static_cast<char>(payload.size())) + payload;
}

TEST(IsValidUtf8Test, AgreesWithTheReplacementRuleOnRandomBytes) {
  // Text is valid exactly when sanitizing it (each invalid subpart becomes
  // U+FFFD, an independent implementation) leaves it unchanged.
  std::mt19937 rng(3);
  for (int trial = 0; trial < 20000; ++trial) {
    std::string text;
    const int len = static_cast<int>(rng() % 8);
    for (int i = 0; i < len; ++i) {
      // Bytes near the boundaries of the UTF-8 ranges, and some ASCII.
      static const unsigned char kBytes[] = {'a',  0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF,
                                             0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1, 0xEC, 0xED,
                                             0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xFF};
      text += static_cast<char>(kBytes[rng() % sizeof(kBytes)]);
    }
    size_t bad = 0;
    const bool valid = IsValidUtf8(text, &bad);
    ASSERT_EQ(valid, engine::SanitizeUtf8(text) == text) << "trial " << trial;
    if (!valid) {
      size_t ignored;
      ASSERT_TRUE(IsValidUtf8(text.substr(0, bad), &ignored)) << "trial " << trial;
    }
  }
}

TEST(ParseRequestTest, ParsesAWellFormedRequest) {
  v1::GenerateRequest sent;
  sent.set_prompt("Once upon a time \xC3\xA9");
  sent.set_max_new_tokens(7);
  sent.add_stop("\n");
  sent.mutable_sampling()->set_top_p(0.5f);
  v1::GenerateRequest got;
  ASSERT_TRUE(ParseRequest(sent.SerializeAsString(), &got).ok());
  EXPECT_EQ(got.SerializeAsString(), sent.SerializeAsString());
}

TEST(ParseRequestTest, NamesTheStringFieldThatIsNotUtf8) {
  v1::GenerateRequest r;
  absl::Status s = ParseRequest(Field(1, "ok \xFF"), &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("coalesce.v1.GenerateRequest"),
                                 HasSubstr("field prompt"), HasSubstr("at byte 3")));
  s = ParseRequest(Field(5, "a") + Field(5, "b") + Field(5, "\xED\xA0\x80"), &r);
  EXPECT_THAT(s.message(), HasSubstr("field stop[2]"));
  s = ParseRequest(Field(6, "\xC0\xAF"), &r);
  EXPECT_THAT(s.message(), HasSubstr("field request_id"));
  v1::TokenizeRequest t;
  s = ParseRequest(Field(1, "\xF4\x90\x80\x80"), &t);  // above U+10FFFF
  EXPECT_THAT(s.message(), AllOf(HasSubstr("TokenizeRequest"), HasSubstr("field text")));
}

TEST(ParseRequestTest, GarbageAndTruncatedBytesAreNamedAsSuch) {
  v1::GenerateRequest r;
  absl::Status s = ParseRequest(std::string(12, '\xFF'), &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("not a protobuf message"));
  const std::string whole = Field(1, "Once upon a time");
  s = ParseRequest(whole.substr(0, whole.size() - 3), &r);
  EXPECT_THAT(s.message(), HasSubstr("truncated"));
  // A nested message that does not parse names its field.
  s = ParseRequest(Field(4, "\x08\xFF\xFF"), &r);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("field sampling"), HasSubstr("SamplingParams")));
}

// A varint field: tag, then the value in base 128.
std::string Varint(uint64_t value) {
  std::string out;
  do {
    out += static_cast<char>((value & 0x7F) | (value > 0x7F ? 0x80 : 0));
    value >>= 7;
  } while (value != 0);
  return out;
}
std::string VarintField(int number, uint64_t value) {
  return std::string(1, static_cast<char>(number << 3)) + Varint(value);
}

// protobuf keeps the low 32 bits of a larger varint in a 32-bit field: the
// token id 2^40 would be token 0. Such values are refused, the field and
// item named, packed or not, at any depth.
TEST(ParseRequestTest, IntegersBeyond32BitsAreRefusedNotCut) {
  const uint64_t kBig = uint64_t{1} << 40;
  v1::GenerateRequest r;
  // Packed (how every client sends them): ids 5, 7, then 2^40.
  absl::Status s =
      ParseRequest(Field(2, Varint(5) + Varint(7) + Varint(kBig)) + VarintField(3, 4), &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("coalesce.v1.GenerateRequest"),
                                 HasSubstr("field prompt_token_ids[2] is 1099511627776"),
                                 HasSubstr("does not fit in its 32 bits")));
  // Unpacked, after a packed run: items are counted across both.
  s = ParseRequest(Field(2, Varint(5)) + VarintField(2, 6) + VarintField(2, kBig), &r);
  EXPECT_THAT(s.message(), HasSubstr("field prompt_token_ids[2] is 1099511627776"));
  s = ParseRequest(VarintField(3, (uint64_t{1} << 32) + 8), &r);
  EXPECT_THAT(s.message(), HasSubstr("field max_new_tokens is 4294967304"));
  // Nested: stop_token_ids and logit_bias's keys in SamplingParams.
  s = ParseRequest(Field(4, Field(11, Varint(kBig))), &r);
  EXPECT_THAT(s.message(), HasSubstr("field sampling.stop_token_ids[0] is 1099511627776"));
  s = ParseRequest(Field(4, Field(12, VarintField(1, kBig) + std::string("\x15\0\0\0\0", 5))), &r);
  EXPECT_THAT(s.message(), HasSubstr("field sampling.logit_bias[0].key is 1099511627776"));
  v1::DetokenizeRequest d;
  s = ParseRequest(Field(1, Varint(3) + Varint(kBig)), &d);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("DetokenizeRequest"),
                                 HasSubstr("field token_ids[1] is 1099511627776")));
  // A negative int32 is sent sign-extended to 64 bits: in range; one below
  // INT32_MIN is not.
  ASSERT_TRUE(ParseRequest(VarintField(7, static_cast<uint64_t>(int64_t{-3})), &r).ok());
  EXPECT_EQ(r.priority(), -3);
  s = ParseRequest(VarintField(7, static_cast<uint64_t>(int64_t{INT32_MIN} - 1)), &r);
  EXPECT_THAT(s.message(), HasSubstr("field priority is -2147483649"));
  // The largest values that fit are taken as they are.
  ASSERT_TRUE(ParseRequest(Field(2, Varint(INT32_MAX)) + VarintField(3, 1), &r).ok());
  EXPECT_EQ(r.prompt_token_ids(0), INT32_MAX);
  // A packed list whose last varint is cut off.
  s = ParseRequest(Field(2, Varint(5) + "\x80"), &r);
  EXPECT_THAT(s.message(), HasSubstr("field prompt_token_ids[1] is a truncated varint"));
}

TEST(ParseRequestTest, UnknownFieldsAndOtherWireTypesAreLeftToProtobuf) {
  // Field 99 is unknown; field 1 as a varint is not the string it names
  // (protobuf keeps both as unknown fields). Neither is an error.
  v1::GenerateRequest r;
  EXPECT_TRUE(ParseRequest(Field(99, "\xFF\xFF") + std::string("\x08\x05", 2), &r).ok());
  EXPECT_TRUE(r.prompt().empty());
}

TEST(ParseRequestTest, ClearsTheMessageFirst) {
  v1::GenerateRequest r;
  r.set_request_id("old");
  ASSERT_TRUE(ParseRequest(Field(1, "new"), &r).ok());
  EXPECT_EQ(r.prompt(), "new");
  EXPECT_TRUE(r.request_id().empty());
}

TEST(ParseRequestTest, ReadsAByteBufferOfManySlices) {
  v1::GenerateRequest sent;
  sent.set_prompt(std::string(1000, 'x'));
  const std::string bytes = sent.SerializeAsString();
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += 100) slices.emplace_back(bytes.substr(at, 100));
  grpc::ByteBuffer buffer(slices.data(), slices.size());
  v1::GenerateRequest got;
  ASSERT_TRUE(ParseRequest(buffer, &got).ok());
  EXPECT_EQ(got.prompt(), sent.prompt());
  EXPECT_EQ(SerializeMessage(got).Length(), bytes.size());
}

}  // namespace
}  // namespace coalesce::service
