#include "tools/bench/report.h"

#include <algorithm>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace coalesce::bench {
namespace {

TEST(SummarizeTest, NearestRankPercentiles) {
  std::vector<double> values;
  for (int i = 100; i >= 1; --i) values.push_back(i);  // unsorted on purpose
  const LatencySummary s = Summarize(values);
  EXPECT_EQ(s.count, 100);
  EXPECT_DOUBLE_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.p50, 50);
  EXPECT_DOUBLE_EQ(s.p90, 90);
  EXPECT_DOUBLE_EQ(s.p99, 99);
  EXPECT_DOUBLE_EQ(s.max, 100);
  EXPECT_DOUBLE_EQ(s.mean, 50.5);
}

TEST(SummarizeTest, SmallSamplesTakeOccurringValues) {
  // n = 10: p90 is the 9th value (0.9 * 10 must not round up to rank 10).
  const LatencySummary ten = Summarize({1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  EXPECT_DOUBLE_EQ(ten.p50, 5);
  EXPECT_DOUBLE_EQ(ten.p90, 9);
  EXPECT_DOUBLE_EQ(ten.p99, 10);
  const LatencySummary one = Summarize({0.25});
  EXPECT_DOUBLE_EQ(one.p50, 0.25);
  EXPECT_DOUBLE_EQ(one.max, 0.25);
  const LatencySummary none = Summarize({});
  EXPECT_EQ(none.count, 0);
  EXPECT_DOUBLE_EQ(none.max, 0);
}

RequestRecord Ok(int64_t index, double send_s, double ttft_s, std::vector<float> gaps,
                 double e2e_s) {
  RequestRecord r;
  r.index = index;
  r.send_s = send_s;
  r.prompt_tokens = 10;
  r.max_new_tokens = 8;
  r.tokens = static_cast<int>(gaps.size()) + 1;
  r.usage_completion_tokens = r.tokens;
  r.ttft_s = ttft_s;
  double last = ttft_s;
  for (float g : gaps) last += g;
  r.last_token_s = last;
  r.gaps_s = std::move(gaps);
  r.e2e_s = e2e_s;
  r.finish_reason = "LENGTH";
  return r;
}

TEST(BuildReportTest, CountsThroughputAndGoodput) {
  ReportInput in;
  in.slo_ttft_s = 0.5;
  in.slo_itl_s = 0.1;
  in.warmup_sent = 1;
  in.measured_sent = 5;  // one still in flight at the end
  in.measured_start_s = 1;
  in.sending_end_s = 3;
  RequestRecord warm = Ok(0, 0, 0.1, {0.01f}, 0.2);
  warm.warmup = true;
  in.records.push_back(warm);
  in.records.push_back(Ok(1, 1.0, 0.2, {0.05f, 0.05f}, 0.4));  // meets both
  in.records.push_back(Ok(2, 1.5, 0.9, {0.05f}, 1.0));         // TTFT too long
  in.records.push_back(Ok(3, 2.0, 0.1, {0.3f, 0.1f}, 2.0));    // TPOT 0.2 too long
  RequestRecord failed;
  failed.index = 4;
  failed.send_s = 2.5;
  failed.e2e_s = 0.01;
  failed.status_code = 14;
  failed.error = "connection refused";
  in.records.push_back(failed);

  const Report r = BuildReport(in);
  EXPECT_EQ(r.sent, 5);
  EXPECT_EQ(r.completed, 3);
  EXPECT_EQ(r.failed, 1);
  EXPECT_EQ(r.in_flight_at_end, 1);
  EXPECT_EQ(r.sent, r.completed + r.failed + r.in_flight_at_end);
  EXPECT_EQ(r.by_status.at("OK"), 3);
  EXPECT_EQ(r.by_status.at("UNAVAILABLE"), 1);
  EXPECT_EQ(r.error_examples.at("UNAVAILABLE"), "connection refused");
  EXPECT_EQ(r.warmup_completed, 1);
  EXPECT_EQ(r.warmup_tokens, 2);
  EXPECT_EQ(r.generated_tokens, 3 + 2 + 3);
  // Measured from 1 s to the end of request 3 (2 + 2 = 4 s).
  EXPECT_DOUBLE_EQ(r.elapsed_s, 3);
  EXPECT_DOUBLE_EQ(r.requests_per_s, 1);
  EXPECT_EQ(r.slo_met, 1);
  EXPECT_DOUBLE_EQ(r.goodput_requests_per_s, 1.0 / 3);
  // Latencies of the successful measured requests only.
  EXPECT_EQ(r.ttft.count, 3);
  EXPECT_EQ(r.e2e.count, 3);
  EXPECT_EQ(r.itl.count, 5);
  EXPECT_EQ(r.tpot.count, 3);
  EXPECT_NEAR(r.tpot.max, 0.2, 1e-6);
}

TEST(BuildReportTest, UsageMismatchIsCounted) {
  ReportInput in;
  in.measured_sent = 1;
  RequestRecord r = Ok(0, 0, 0.1, {0.1f}, 0.3);
  r.usage_completion_tokens = 3;  // two tokens arrived
  in.records.push_back(r);
  EXPECT_EQ(BuildReport(in).usage_mismatches, 1);
}

TEST(CsvTest, HeaderAndRowHaveTheSameColumns) {
  ReportInput in;
  in.config = {{"mode", "closed"}, {"concurrency", 4}};
  in.measured_sent = 1;
  in.records.push_back(Ok(0, 0, 0.1, {0.1f}, 0.3));
  const Report r = BuildReport(in);
  auto columns = [](const std::string& line) { return std::count(line.begin(), line.end(), ','); };
  EXPECT_EQ(columns(CsvHeader()), columns(CsvRow(r)));
  EXPECT_EQ(CsvRow(r).substr(0, 9), "closed,4,");
}

TEST(StatusCodeNameTest, NamesGrpcCodes) {
  EXPECT_EQ(StatusCodeName(0), "OK");
  EXPECT_EQ(StatusCodeName(8), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(StatusCodeName(14), "UNAVAILABLE");
  EXPECT_EQ(StatusCodeName(16), "UNAUTHENTICATED");
  EXPECT_EQ(StatusCodeName(42), "CODE_42");
}

}  // namespace
}  // namespace coalesce::bench
