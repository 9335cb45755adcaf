// The tenants file (service/tenants.h): parsing and every refusal, key
// hashing, authentication by key and by certificate subject, the stream and
// token limits on a fake clock (a call reserves its most tokens and gets back
// what it did not use), the prefix-cache partitions, and re-reading the file
// when it changes.
#include "service/tenants.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace coalesce::service {
namespace {

using ::testing::HasSubstr;

const std::string kKeyA = "key-of-a";
const std::string kKeyB = "key-of-b";

std::string File(const std::string& tenants) { return R"({"tenants": [)" + tenants + "]}"; }

std::string TenantA(const std::string& extra = "") {
  return R"({"name": "a", "key_sha256": ")" + Sha256Hex(kKeyA) + "\"" + extra + "}";
}

TEST(TenantsTest, Sha256IsTheStandardDigest) {
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(TenantsTest, ParsesEveryField) {
  absl::StatusOr<std::vector<TenantConfig>> t = ParseTenants(File(
      TenantA(R"(, "weight": 2.5, "max_priority": 3, "max_streams": 4, "tokens_per_minute": 500)") +
      R"(, {"name": "b.c-d_e", "client_cert_subject": "CN=b,O=x", "prefix_cache_group": "g.1"})"));
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 2u);
  EXPECT_EQ((*t)[0].name, "a");
  EXPECT_EQ((*t)[0].key_sha256, Sha256Hex(kKeyA));
  EXPECT_EQ((*t)[0].weight, 2.5);
  EXPECT_EQ((*t)[0].max_priority, 3);
  EXPECT_EQ((*t)[0].max_streams, 4);
  EXPECT_EQ((*t)[0].tokens_per_minute, 500);
  EXPECT_EQ((*t)[0].prefix_cache_group, "");
  EXPECT_EQ((*t)[1].client_cert_subject, "CN=b,O=x");
  EXPECT_EQ((*t)[1].prefix_cache_group, "g.1");
  EXPECT_EQ((*t)[1].weight, 1.0);
  EXPECT_EQ((*t)[1].max_streams, 0);
  // Upper-case hex is the same key.
  std::string upper = Sha256Hex(kKeyA);
  for (char& c : upper) c = static_cast<char>(toupper(c));
  t = ParseTenants(File(R"({"name": "a", "key_sha256": ")" + upper + "\"}"));
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)[0].key_sha256, Sha256Hex(kKeyA));
}

TEST(TenantsTest, RefusesWhatIsWrongAndSaysWhere) {
  const std::string key = Sha256Hex(kKeyA);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "not valid JSON"},
      {"[]", R"(expected {"tenants": [...]})"},
      {R"({"tenants": [], "x": 1})", "unknown key \"x\""},
      {File("1"), "tenants[0]: not an object"},
      {File(R"({"key_sha256": ")" + key + "\"}"), "tenants[0]: name must be"},
      {File(R"({"name": "a b", "key_sha256": ")" + key + "\"}"), "name must be"},
      {File(R"({"name": "a"})"), "give key_sha256, client_cert_subject or both"},
      {File(R"({"name": "a", "key_sha256": "abc"})"), "key_sha256 must be 64 hex digits"},
      {File(TenantA(R"(, "weight": 0)")), "weight must be in (0, 1000]"},
      {File(TenantA(R"(, "weight": "2")")), "weight must be a number"},
      {File(TenantA(R"(, "max_streams": -1)")), "max_streams must be 0 (no limit)"},
      {File(TenantA(R"(, "max_streams": 1.5)")), "max_streams must be an integer"},
      {File(TenantA(R"(, "tokens_per_minute": -5)")), "tokens_per_minute must be"},
      {File(TenantA(R"(, "max_priority": 99999999)")), "max_priority must be within"},
      {File(TenantA(R"(, "prefix_cache_group": "")")), "prefix_cache_group must be 1 to 64"},
      {File(TenantA(R"(, "prefix_cache_group": "a/b")")), "prefix_cache_group must be 1 to 64"},
      {File(TenantA(R"(, "prefix_cache_group": 1)")), "prefix_cache_group must be a string"},
      {File(TenantA(R"(, "colour": 1)")), "tenants[0]: unknown key \"colour\""},
      {File(TenantA() + "," + TenantA()), "tenants[1]: name \"a\" is also tenants[0]'s"},
      {File(TenantA() + R"(, {"name": "b", "key_sha256": ")" + key + "\"}"),
       "tenants[1]: key_sha256 is also tenants[0]'s"},
      {R"({"tenants": [[[[[[[[[[1]]]]]]]]]]})", "nested deeper than 8 levels"},
  };
  for (const auto& [text, words] : cases) {
    absl::StatusOr<std::vector<TenantConfig>> t = ParseTenants(text);
    ASSERT_FALSE(t.ok()) << text;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(t.status().message()), HasSubstr(words)) << text;
  }
}

class TenantsFileTest : public ::testing::Test {
 protected:
  void Write(const std::string& text) { std::ofstream(path_, std::ios::trunc) << text; }
  std::unique_ptr<Tenants> Load() {
    absl::StatusOr<std::unique_ptr<Tenants>> t = Tenants::Load(path_, &clock_);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *std::move(t) : nullptr;
  }
  void TearDown() override { std::remove(path_.c_str()); }

  // Each test its own file: ctest runs the tests of this binary in parallel.
  std::string path_ = absl::StrCat(::testing::TempDir(), "/tenants_test_",
                                   ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                                   "_", getpid(), ".json");
  FakeClock clock_{absl::FromUnixSeconds(1000)};
};

TEST_F(TenantsFileTest, AuthenticatesByBearerKeyOrCertificateSubject) {
  Write(File(TenantA(R"(, "max_priority": 2, "weight": 3)") + R"(, {"name": "b", "key_sha256": ")" +
             Sha256Hex(kKeyB) + R"(", "client_cert_subject": "CN=b"})"));
  auto t = Load();
  ASSERT_NE(t, nullptr);
  absl::StatusOr<Tenants::Caller> c = t->Authenticate("Bearer " + kKeyA, "");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "a");
  EXPECT_EQ(c->max_priority, 2);
  EXPECT_EQ(c->weight, 3.0);
  EXPECT_EQ(t->Authenticate("bearer " + kKeyB, "").value().name, "b");
  // Each tenant its own prefix-cache partition.
  EXPECT_EQ(c->cache_partition, "tenant:a");
  EXPECT_EQ(t->Authenticate("bearer " + kKeyB, "").value().cache_partition, "tenant:b");
  // A key wins over a certificate; a certificate alone names its tenant.
  EXPECT_EQ(t->Authenticate("Bearer " + kKeyA, "CN=b").value().name, "a");
  EXPECT_EQ(t->Authenticate("", "CN=b").value().name, "b");
  for (const auto& [auth, subject, words] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"", "", "needs an API key"},
           {"Bearer wrong", "", "unknown API key"},
           {"Basic " + kKeyA, "", "must be \"Bearer KEY\""},
           {"Bearer ", "", "must be \"Bearer KEY\""},
           {"", "CN=z", "no tenant has the client certificate subject \"CN=z\""}}) {
    absl::StatusOr<Tenants::Caller> bad = t->Authenticate(auth, subject);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kUnauthenticated) << auth;
    EXPECT_THAT(std::string(bad.status().message()), HasSubstr(words));
    // The message never repeats a key.
    EXPECT_THAT(std::string(bad.status().message()), ::testing::Not(HasSubstr(kKeyA)));
  }
}

TEST_F(TenantsFileTest, StreamsAreLimitedAndFreedWhenTheyEnd) {
  Write(File(TenantA(R"(, "max_streams": 2)")));
  auto t = Load();
  ASSERT_NE(t, nullptr);
  absl::Duration retry;
  auto s1 = t->Open("a", 0, &retry);
  auto s2 = t->Open("a", 0, &retry);
  ASSERT_TRUE(s1.ok() && s2.ok());
  auto s3 = t->Open("a", 0, &retry);
  EXPECT_EQ(s3.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s3.status().message()), HasSubstr("2 streams open, its limit"));
  EXPECT_GT(retry, absl::ZeroDuration());
  s1->reset();
  EXPECT_TRUE(t->Open("a", 0, &retry).ok());
}

TEST_F(TenantsFileTest, ACallReservesItsMostTokensAndGetsBackWhatItDidNotUse) {
  Write(File(TenantA(R"(, "tokens_per_minute": 600)")));
  auto t = Load();
  ASSERT_NE(t, nullptr);
  absl::Duration retry;
  // Two calls that may use 400 tokens each: the second does not fit while
  // the first holds its reservation, however little either has used.
  auto first = t->Open("a", 400, &retry);
  ASSERT_TRUE(first.ok());
  auto second = t->Open("a", 400, &retry);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr("has used its 600 tokens per minute (this request may use 400)"));
  // 200 of 600 left, 200 more wanted at 10 a second: 20 s.
  EXPECT_NEAR(absl::ToDoubleSeconds(retry), 20.0, 1e-3);
  EXPECT_TRUE(t->Open("a", 200, &retry).ok());  // fits, and gives back its 200 unused
  // The first used 100 of its 400: 300 come back, so 500 are free.
  (*first)->Charge(100);
  (*first)->Charge(100);  // settled once
  EXPECT_FALSE(t->Open("a", 501, &retry).ok());
  EXPECT_NEAR(absl::ToDoubleSeconds(retry), 0.1, 1e-3);
  auto third = t->Open("a", 500, &retry);
  ASSERT_TRUE(third.ok());
  // A call that never settles (refused, or ended before the engine ran it)
  // gives back everything when its stream is destroyed.
  third->reset();
  EXPECT_TRUE(t->Open("a", 500, &retry).ok());
}

TEST_F(TenantsFileTest, ARequestLargerThanAMinuteSBudgetIsRefusedForGood) {
  Write(File(TenantA(R"(, "tokens_per_minute": 600)")));
  auto t = Load();
  ASSERT_NE(t, nullptr);
  absl::Duration retry;
  auto refused = t->Open("a", 601, &retry);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("may use 601 tokens (its prompt and max_new_tokens for each of its "
                        "samples) but tenant a's budget is 600 tokens per minute"));
  EXPECT_LT(retry, absl::ZeroDuration());  // no point retrying
  // Nothing was taken: a whole minute's budget is still there.
  EXPECT_TRUE(t->Open("a", 600, &retry).ok());
}

TEST_F(TenantsFileTest, TheTokenBudgetRefillsOverTheMinute) {
  Write(File(TenantA(R"(, "tokens_per_minute": 600)")));
  auto t = Load();
  ASSERT_NE(t, nullptr);
  absl::Duration retry;
  {
    auto s = t->Open("a", 100, &retry);
    ASSERT_TRUE(s.ok());
    (*s)->Charge(900);  // more than it reserved (a reload lowered nothing here): 300 in debt
  }
  auto refused = t->Open("a", 1, &retry);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("600 tokens per minute"));
  // 301 tokens at 10 a second: 30.1 s.
  EXPECT_EQ(retry, absl::Milliseconds(30100));
  clock_.Advance(absl::Seconds(30));
  EXPECT_FALSE(t->Open("a", 1, &retry).ok());
  clock_.Advance(absl::Seconds(1));
  EXPECT_TRUE(t->Open("a", 1, &retry).ok());
  // The budget never exceeds a minute's worth, refunds included.
  clock_.Advance(absl::Hours(1));
  {
    auto s = t->Open("a", 600, &retry);
    ASSERT_TRUE(s.ok());
    clock_.Advance(absl::Minutes(1));  // refilled to 600 meanwhile
    (*s)->Charge(0);                   // and 600 back: still 600
  }
  auto all = t->Open("a", 600, &retry);
  EXPECT_TRUE(all.ok());
  EXPECT_FALSE(t->Open("a", 1, &retry).ok());
}

TEST_F(TenantsFileTest, APrefixCacheGroupIsSharedByItsTenantsAlone) {
  Write(File(TenantA(R"(, "prefix_cache_group": "acme")") + R"(, {"name": "b", "key_sha256": ")" +
             Sha256Hex(kKeyB) + R"(", "prefix_cache_group": "acme"}, {"name": "acme", )" +
             R"("client_cert_subject": "CN=acme"})"));
  auto t = Load();
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->Authenticate("Bearer " + kKeyA, "").value().cache_partition, "group:acme");
  EXPECT_EQ(t->Authenticate("Bearer " + kKeyB, "").value().cache_partition, "group:acme");
  // A tenant named like the group is not in it.
  EXPECT_EQ(t->Authenticate("", "CN=acme").value().cache_partition, "tenant:acme");
}

TEST_F(TenantsFileTest, AChangedFileIsReadAgainAndABadOneKeepsTheOld) {
  Write(File(TenantA(R"(, "max_streams": 1)")));
  auto t = Load();
  ASSERT_NE(t, nullptr);
  absl::Duration retry;
  auto held = t->Open("a", 0, &retry);
  ASSERT_TRUE(held.ok());
  EXPECT_FALSE(t->Authenticate("Bearer " + kKeyB, "").ok());
  // b added, a's limit raised; seen after the recheck interval.
  Write(File(TenantA(R"(, "max_streams": 2)") + R"(, {"name": "b", "key_sha256": ")" +
             Sha256Hex(kKeyB) + "\"}"));
  EXPECT_FALSE(t->Authenticate("Bearer " + kKeyB, "").ok());
  clock_.Advance(absl::Seconds(2));
  EXPECT_EQ(t->Authenticate("Bearer " + kKeyB, "").value().name, "b");
  // a's open stream is still counted: one more, not two.
  EXPECT_TRUE(t->Open("a", 0, &retry).ok());
  // A broken file keeps the tenants loaded before.
  Write("{ not json");
  clock_.Advance(absl::Seconds(2));
  EXPECT_EQ(t->Authenticate("Bearer " + kKeyB, "").value().name, "b");
  EXPECT_EQ(t->names(), (std::vector<std::string>{"a", "b"}));
  // A missing file at start-up is an error naming it.
  EXPECT_THAT(std::string(Tenants::Load("/nonexistent/keys.json", &clock_).status().message()),
              HasSubstr("--api_keys_file=/nonexistent/keys.json: cannot read it"));
}

// "split_special_tokens": true makes its tenant's requests split their
// special tokens whatever they ask (GeneratorService).
TEST_F(TenantsFileTest, SplitSpecialTokensIsATenantsSetting) {
  Write(File(TenantA(R"(, "split_special_tokens": true)") + R"(, {"name": "b", "key_sha256": ")" +
             Sha256Hex(kKeyB) + R"(", "split_special_tokens": false})"));
  auto t = Load();
  ASSERT_NE(t, nullptr);
  EXPECT_TRUE(t->Authenticate("Bearer " + kKeyA, "").value().split_special_tokens);
  EXPECT_FALSE(t->Authenticate("Bearer " + kKeyB, "").value().split_special_tokens);
  absl::StatusOr<std::vector<TenantConfig>> bad =
      ParseTenants(File(TenantA(R"(, "split_special_tokens": 1)")));
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("tenants[0]: split_special_tokens must be true or false"));
}

}  // namespace
}  // namespace coalesce::service
