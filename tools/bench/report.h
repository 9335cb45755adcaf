// What coalesce-bench reports, computed from one record per finished request:
// counts, latency percentiles, throughput and goodput, written as a table, as
// JSON and as CSV. Knows nothing of gRPC beyond the numbering of its status
// codes.
//
// Definitions (also in the --help text):
// * Measured requests are those sent after the warm-up; the statistics cover
//   them only. The measured time runs from the first measured send to the end
//   of the last measured request, so it includes the drain at the end.
// * TTFT: from sending the request to the arrival of the message carrying the
//   first token.
// * ITL (inter-token latency): one value per token after the first. A message
//   carrying k tokens that arrives dt after the previous message counts as k
//   gaps of dt / k; the extra tokens of the first message count as gaps of 0.
//   So a request's gaps add up to its last token's time minus its TTFT.
// * TPOT: one value per request, the mean of its ITL gaps.
// * End-to-end: from sending the request to its final status.
// * Goodput: measured requests per second that succeeded with TTFT <= the TTFT
//   objective and TPOT <= the ITL objective (a request of one token meets the
//   latter).
// Latency summaries cover the measured requests that succeeded; token counts
// cover every token received, failed requests included, as the server counts
// them.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "nlohmann/json.hpp"

namespace coalesce::bench {

// One finished request. Times are seconds from the start of the run.
struct RequestRecord {
  int64_t index = 0;       // in send order, warm-up included
  bool warmup = false;     // sent during the warm-up: not in the statistics
  double send_s = 0;       // when it was sent
  double send_lag_s = 0;   // open loop: how late the send was against its arrival time
  int prompt_tokens = -1;  // ids sent; for a text prompt, the server's usage (-1 if none)
  int max_new_tokens = 0;
  int tokens = 0;  // token ids received
  int messages = 0;
  double ttft_s = -1;                // -1: no token arrived
  double last_token_s = -1;          // from the send, like ttft_s
  double e2e_s = 0;                  // from the send to the final status
  std::vector<float> gaps_s;         // [tokens - 1] per-token gaps, as defined above
  int status_code = 0;               // grpc::StatusCode numbering; 0 is OK
  std::string error;                 // the status message of a failed request
  std::string finish_reason;         // "LENGTH", "EOS", ...; empty for a failed request
  int usage_completion_tokens = -1;  // from the last message; -1 if none
  int cached_prompt_tokens = -1;     // usage: prompt tokens the prefix cache supplied
  bool cancelled_at_end = false;     // still running after the drain timeout: cancelled
  int64_t conversation = 0;          // --turns: which conversation, and which turn (from 1)
  int turn = 1;
  // --turns, a completed turn before the last: its prompt and the tokens it
  // got, which the next turn re-sends. Not reported.
  std::vector<int32_t> history;
};

// "OK", "CANCELLED", ... "UNAUTHENTICATED"; "CODE_<n>" outside 0..16.
std::string StatusCodeName(int code);

struct LatencySummary {
  int64_t count = 0;
  double mean = 0;
  double min = 0;
  double p50 = 0;
  double p90 = 0;
  double p99 = 0;
  double max = 0;
};

// Nearest-rank percentiles (the smallest value with at least p% of the values
// at or below it), so p50 <= p90 <= p99 <= max always holds and every
// percentile is a value that occurred. All zero for no values.
LatencySummary Summarize(std::vector<double> values);

// What the run knows besides the records.
struct ReportInput {
  nlohmann::json config;  // echoed as given
  nlohmann::json model;   // echoed as given
  std::string title;      // first line of the table
  std::string workload;   // second line of the table
  double slo_ttft_s = 1;
  double slo_itl_s = 0.1;
  int64_t measured_sent = 0;
  int64_t warmup_sent = 0;
  double measured_start_s = 0;         // the first measured send (or the end of the warm-up)
  double sending_end_s = 0;            // when the last request was sent
  double drain_s = 0;                  // from the last send until every request ended
  std::vector<RequestRecord> records;  // every finished request, warm-up included
};

struct Report {
  ReportInput input;
  // Measured requests. sent == completed + failed + in_flight_at_end.
  int64_t sent = 0;
  int64_t completed = 0;         // status OK
  int64_t failed = 0;            // any other status, cancelled_at_end included
  int64_t in_flight_at_end = 0;  // no final status even after cancelling (should be 0)
  int64_t cancelled_at_end = 0;
  std::map<std::string, int64_t> by_status;  // every measured request that ended, OK included
  std::map<std::string, std::string> error_examples;  // a message for each failed status
  std::map<std::string, int64_t> finish_reasons;      // completed requests
  // Completed requests whose token ids received differ from usage's count
  // (a server bug if ever non-zero).
  int64_t usage_mismatches = 0;
  int64_t warmup_completed = 0;
  int64_t warmup_failed = 0;
  int64_t warmup_in_flight_at_end = 0;
  int64_t warmup_tokens = 0;
  // Tokens of the measured requests.
  int64_t prompt_tokens = 0;         // of completed requests
  int64_t cached_prompt_tokens = 0;  // of those, supplied by the server's prefix cache
  int64_t generated_tokens = 0;      // every token received
  int64_t requested_tokens = 0;      // sum of max_new_tokens of completed requests
  double elapsed_s = 0;              // the measured time
  double requests_per_s = 0;         // completed / elapsed
  double generated_tokens_per_s = 0;
  double prompt_tokens_per_s = 0;
  int64_t slo_met = 0;
  double goodput_requests_per_s = 0;
  double max_send_lag_s = 0;
  LatencySummary ttft, itl, tpot, e2e;  // seconds
};

Report BuildReport(ReportInput input);

// The human-readable summary, for stdout.
std::string FormatTable(const Report& report);

// Everything: config, model, counts, tokens, throughput, latency summaries,
// and with `per_request` one object per request.
nlohmann::json ToJson(const Report& report, bool per_request);

// One summary row. The file gets the header first when it is new or empty,
// so that a sweep can append one row per run to the same file.
absl::Status AppendCsv(const std::string& path, const Report& report);
std::string CsvHeader();
std::string CsvRow(const Report& report);

}  // namespace coalesce::bench
