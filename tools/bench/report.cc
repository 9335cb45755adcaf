#include "tools/bench/report.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace coalesce::bench {

// ---------------------------------------------------------------------------
// Statistics
// ---------------------------------------------------------------------------

std::string StatusCodeName(int code) {
  // grpc::StatusCode's numbering (the gRPC wire codes).
  static const char* const kNames[] = {"OK",
                                       "CANCELLED",
                                       "UNKNOWN",
                                       "INVALID_ARGUMENT",
                                       "DEADLINE_EXCEEDED",
                                       "NOT_FOUND",
                                       "ALREADY_EXISTS",
                                       "PERMISSION_DENIED",
                                       "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION",
                                       "ABORTED",
                                       "OUT_OF_RANGE",
                                       "UNIMPLEMENTED",
                                       "INTERNAL",
                                       "UNAVAILABLE",
                                       "DATA_LOSS",
                                       "UNAUTHENTICATED"};
  if (code >= 0 && code < static_cast<int>(std::size(kNames))) return kNames[code];
  return absl::StrCat("CODE_", code);
}

LatencySummary Summarize(std::vector<double> values) {
  LatencySummary s;
  if (values.empty()) return s;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  auto rank = [&](double p) {
    // Nearest rank: ceil(p/100 * n), 1-based. The small epsilon keeps
    // p = 90, n = 10 at rank 9 despite 0.9 * 10 rounding to 9.000000000000002.
    size_t r = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(n) - 1e-9));
    return values[std::clamp<size_t>(r, 1, n) - 1];
  };
  s.count = static_cast<int64_t>(n);
  s.mean = std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(n);
  s.min = values.front();
  s.p50 = rank(50);
  s.p90 = rank(90);
  s.p99 = rank(99);
  s.max = values.back();
  return s;
}

Report BuildReport(ReportInput input) {
  Report r;
  r.sent = input.measured_sent;
  std::vector<double> ttft, itl, tpot, e2e;
  double measured_end_s = input.measured_start_s;
  int64_t measured_records = 0;
  int64_t warmup_records = 0;
  for (const RequestRecord& rec : input.records) {
    if (rec.warmup) {
      ++warmup_records;
      r.warmup_tokens += rec.tokens;
      if (rec.status_code == 0) {
        ++r.warmup_completed;
      } else {
        ++r.warmup_failed;
      }
      continue;
    }
    ++measured_records;
    measured_end_s = std::max(measured_end_s, rec.send_s + rec.e2e_s);
    r.generated_tokens += rec.tokens;
    r.max_send_lag_s = std::max(r.max_send_lag_s, rec.send_lag_s);
    const std::string status = StatusCodeName(rec.status_code);
    ++r.by_status[status];
    if (rec.cancelled_at_end) ++r.cancelled_at_end;
    if (rec.status_code != 0) {
      ++r.failed;
      r.error_examples.emplace(status, rec.error);  // keeps the first
      continue;
    }
    ++r.completed;
    ++r.finish_reasons[rec.finish_reason.empty() ? "NONE" : rec.finish_reason];
    if (rec.usage_completion_tokens != rec.tokens) ++r.usage_mismatches;
    if (rec.prompt_tokens > 0) r.prompt_tokens += rec.prompt_tokens;
    if (rec.cached_prompt_tokens > 0) r.cached_prompt_tokens += rec.cached_prompt_tokens;
    r.requested_tokens += rec.max_new_tokens;

    // Latencies of successful requests only: a failed request's timing says
    // how fast it failed, not how fast the server serves.
    e2e.push_back(rec.e2e_s);
    if (rec.ttft_s >= 0) ttft.push_back(rec.ttft_s);
    for (float gap : rec.gaps_s) itl.push_back(gap);
    double mean_gap = 0;
    if (!rec.gaps_s.empty()) {
      mean_gap = (rec.last_token_s - rec.ttft_s) / static_cast<double>(rec.gaps_s.size());
      tpot.push_back(mean_gap);
    }
    if (rec.ttft_s >= 0 && rec.ttft_s <= input.slo_ttft_s && mean_gap <= input.slo_itl_s) {
      ++r.slo_met;
    }
  }
  r.in_flight_at_end = r.sent - measured_records;
  r.warmup_in_flight_at_end = input.warmup_sent - warmup_records;
  // A timed run measures at least its whole window, even when the last
  // request ended early (an open loop whose last arrival came early).
  measured_end_s = std::max(measured_end_s, input.sending_end_s);
  r.elapsed_s = measured_end_s - input.measured_start_s;
  if (r.elapsed_s > 0) {
    r.requests_per_s = static_cast<double>(r.completed) / r.elapsed_s;
    r.generated_tokens_per_s = static_cast<double>(r.generated_tokens) / r.elapsed_s;
    r.prompt_tokens_per_s = static_cast<double>(r.prompt_tokens) / r.elapsed_s;
    r.goodput_requests_per_s = static_cast<double>(r.slo_met) / r.elapsed_s;
  }
  r.ttft = Summarize(std::move(ttft));
  r.itl = Summarize(std::move(itl));
  r.tpot = Summarize(std::move(tpot));
  r.e2e = Summarize(std::move(e2e));
  r.input = std::move(input);
  return r;
}

// ---------------------------------------------------------------------------
// Table
// ---------------------------------------------------------------------------

namespace {

std::string Seconds(double s) {
  if (s >= 1) return absl::StrFormat("%.3g s", s);
  return absl::StrFormat("%.3g ms", s * 1e3);
}

std::string LatencyRow(absl::string_view name, const LatencySummary& s) {
  if (s.count == 0) return absl::StrFormat("  %-22s %9s\n", name, "-");
  return absl::StrFormat("  %-22s %9.2f %9.2f %9.2f %9.2f %9.2f %9d\n", name, s.mean * 1e3,
                         s.p50 * 1e3, s.p90 * 1e3, s.p99 * 1e3, s.max * 1e3, s.count);
}

std::string Counts(const std::map<std::string, int64_t>& counts) {
  return absl::StrJoin(counts, ", ", [](std::string* out, const auto& kv) {
    absl::StrAppend(out, kv.first, " ", kv.second);
  });
}

}  // namespace

std::string FormatTable(const Report& r) {
  const ReportInput& in = r.input;
  std::string out;
  absl::StrAppend(&out, in.title, "\n", in.workload, "\n\n");
  absl::StrAppendFormat(&out,
                        "requests     %d sent, %d completed, %d failed "
                        "(%d cancelled at the end, %d still in flight)\n",
                        r.sent, r.completed, r.failed, r.cancelled_at_end, r.in_flight_at_end);
  if (in.warmup_sent > 0) {
    absl::StrAppendFormat(&out, "warm-up      %d sent, %d completed, %d failed (not counted)\n",
                          in.warmup_sent, r.warmup_completed, r.warmup_failed);
  }
  if (!r.finish_reasons.empty()) {
    absl::StrAppend(&out, "finished by  ", Counts(r.finish_reasons), "\n");
  }
  absl::StrAppendFormat(
      &out, "tokens       %d prompt, %d generated (%.1f per completed request)\n", r.prompt_tokens,
      r.generated_tokens,
      r.completed > 0 ? static_cast<double>(r.generated_tokens) / r.completed : 0.0);
  if (r.cached_prompt_tokens > 0) {
    absl::StrAppendFormat(&out, "prefix cache %d of the prompt tokens (%.1f%%) were cached\n",
                          r.cached_prompt_tokens,
                          100.0 * static_cast<double>(r.cached_prompt_tokens) /
                              static_cast<double>(std::max<int64_t>(1, r.prompt_tokens)));
  }
  absl::StrAppendFormat(&out, "time         %.2f s measured (drain %.2f s)\n", r.elapsed_s,
                        in.drain_s);
  absl::StrAppendFormat(&out,
                        "throughput   %.2f requests/s, %.1f generated tokens/s, "
                        "%.1f prompt tokens/s\n",
                        r.requests_per_s, r.generated_tokens_per_s, r.prompt_tokens_per_s);
  absl::StrAppendFormat(
      &out, "goodput      %.2f requests/s (%d of %d completed met TTFT <= %s and TPOT <= %s)\n",
      r.goodput_requests_per_s, r.slo_met, r.completed, Seconds(in.slo_ttft_s),
      Seconds(in.slo_itl_s));
  if (r.max_send_lag_s > 0.01) {
    // Latencies run from the actual send, so time spent held back at the
    // client is not in them.
    absl::StrAppendFormat(&out,
                          "warning      sends fell up to %s behind the arrival schedule "
                          "(held by --max_in_flight, or the client could not keep up); "
                          "latencies start at the actual send\n",
                          Seconds(r.max_send_lag_s));
  }
  absl::StrAppendFormat(&out, "\n  %-22s %9s %9s %9s %9s %9s %9s\n", "latency (ms)", "mean", "p50",
                        "p90", "p99", "max", "n");
  absl::StrAppend(&out, LatencyRow("time to first token", r.ttft));
  absl::StrAppend(&out, LatencyRow("inter-token", r.itl));
  absl::StrAppend(&out, LatencyRow("time per output token", r.tpot));
  absl::StrAppend(&out, LatencyRow("end-to-end", r.e2e));
  if (r.failed > 0) {
    absl::StrAppend(&out, "\nerrors\n");
    for (const auto& [status, count] : r.by_status) {
      if (status == "OK") continue;
      auto example = r.error_examples.find(status);
      absl::StrAppendFormat(&out, "  %-20s %6d  %s\n", status, count,
                            example == r.error_examples.end() ? "" : example->second);
    }
  }
  if (r.usage_mismatches > 0) {
    absl::StrAppendFormat(&out,
                          "\nwarning: %d requests received a different number of tokens than "
                          "their usage reports\n",
                          r.usage_mismatches);
  }
  return out;
}

// ---------------------------------------------------------------------------
// JSON
// ---------------------------------------------------------------------------

namespace {

nlohmann::json SummaryJson(const LatencySummary& s) {
  return {{"count", s.count}, {"mean", s.mean}, {"min", s.min}, {"p50", s.p50},
          {"p90", s.p90},     {"p99", s.p99},   {"max", s.max}};
}

nlohmann::json RecordJson(const RequestRecord& rec) {
  nlohmann::json j = {{"index", rec.index},
                      {"warmup", rec.warmup},
                      {"send_s", rec.send_s},
                      {"status", StatusCodeName(rec.status_code)},
                      {"prompt_tokens", rec.prompt_tokens},
                      {"max_new_tokens", rec.max_new_tokens},
                      {"tokens", rec.tokens},
                      {"messages", rec.messages},
                      {"e2e_s", rec.e2e_s}};
  if (rec.send_lag_s > 0) j["send_lag_s"] = rec.send_lag_s;
  if (rec.ttft_s >= 0) {
    j["ttft_s"] = rec.ttft_s;
    j["last_token_s"] = rec.last_token_s;
  }
  if (!rec.gaps_s.empty()) {
    j["tpot_s"] = (rec.last_token_s - rec.ttft_s) / static_cast<double>(rec.gaps_s.size());
  }
  if (!rec.finish_reason.empty()) j["finish_reason"] = rec.finish_reason;
  if (rec.usage_completion_tokens >= 0) j["usage_completion_tokens"] = rec.usage_completion_tokens;
  if (rec.cached_prompt_tokens >= 0) j["cached_prompt_tokens"] = rec.cached_prompt_tokens;
  j["conversation"] = rec.conversation;
  j["turn"] = rec.turn;
  if (rec.status_code != 0) j["error"] = rec.error;
  if (rec.cancelled_at_end) j["cancelled_at_end"] = true;
  return j;
}

}  // namespace

nlohmann::json ToJson(const Report& r, bool per_request) {
  const ReportInput& in = r.input;
  nlohmann::json j;
  j["config"] = in.config;
  j["model"] = in.model;
  j["counts"] = {{"sent", r.sent},
                 {"completed", r.completed},
                 {"failed", r.failed},
                 {"in_flight_at_end", r.in_flight_at_end},
                 {"cancelled_at_end", r.cancelled_at_end},
                 {"by_status", r.by_status},
                 {"finish_reasons", r.finish_reasons},
                 {"usage_mismatches", r.usage_mismatches}};
  j["errors"] = r.error_examples;
  j["warmup"] = {{"sent", in.warmup_sent},
                 {"completed", r.warmup_completed},
                 {"failed", r.warmup_failed},
                 {"in_flight_at_end", r.warmup_in_flight_at_end},
                 {"generated_tokens", r.warmup_tokens}};
  j["tokens"] = {{"prompt", r.prompt_tokens},
                 {"cached_prompt", r.cached_prompt_tokens},
                 {"generated", r.generated_tokens},
                 {"requested", r.requested_tokens}};
  j["time"] = {{"measured_start_s", in.measured_start_s},
               {"sending_end_s", in.sending_end_s},
               {"drain_s", in.drain_s},
               {"elapsed_s", r.elapsed_s},
               {"max_send_lag_s", r.max_send_lag_s}};
  j["throughput"] = {{"requests_per_s", r.requests_per_s},
                     {"generated_tokens_per_s", r.generated_tokens_per_s},
                     {"prompt_tokens_per_s", r.prompt_tokens_per_s},
                     {"goodput_requests_per_s", r.goodput_requests_per_s}};
  j["slo"] = {{"ttft_s", in.slo_ttft_s},
              {"tpot_s", in.slo_itl_s},
              {"met", r.slo_met},
              {"fraction_of_completed",
               r.completed > 0 ? static_cast<double>(r.slo_met) / r.completed : 0.0}};
  j["latency_s"] = {{"ttft", SummaryJson(r.ttft)},
                    {"itl", SummaryJson(r.itl)},
                    {"tpot", SummaryJson(r.tpot)},
                    {"e2e", SummaryJson(r.e2e)}};
  if (per_request) {
    nlohmann::json records = nlohmann::json::array();
    for (const RequestRecord& rec : in.records) records.push_back(RecordJson(rec));
    j["requests"] = std::move(records);
  }
  return j;
}

// ---------------------------------------------------------------------------
// CSV
// ---------------------------------------------------------------------------

namespace {

// Config values as CSV cells: strings bare (none of ours holds a comma or a
// quote), everything else as JSON writes it.
std::string ConfigCell(const nlohmann::json& config, const char* key) {
  if (!config.contains(key)) return "";
  const nlohmann::json& v = config[key];
  return v.is_string() ? v.get<std::string>() : v.dump();
}

}  // namespace

std::string CsvHeader() {
  std::vector<std::string> cols = {"mode",
                                   "concurrency",
                                   "rate",
                                   "prompt_tokens",
                                   "max_new_tokens",
                                   "sent",
                                   "completed",
                                   "failed",
                                   "elapsed_s",
                                   "requests_per_s",
                                   "generated_tokens_per_s",
                                   "goodput_requests_per_s"};
  for (const char* metric : {"ttft", "itl", "tpot", "e2e"}) {
    for (const char* stat : {"mean", "p50", "p90", "p99", "max"}) {
      cols.push_back(absl::StrCat(metric, "_", stat, "_ms"));
    }
  }
  return absl::StrJoin(cols, ",");
}

std::string CsvRow(const Report& r) {
  const nlohmann::json& config = r.input.config;
  std::vector<std::string> cells = {ConfigCell(config, "mode"),
                                    ConfigCell(config, "concurrency"),
                                    ConfigCell(config, "rate"),
                                    ConfigCell(config, "prompt_tokens"),
                                    ConfigCell(config, "max_new_tokens"),
                                    absl::StrCat(r.sent),
                                    absl::StrCat(r.completed),
                                    absl::StrCat(r.failed),
                                    absl::StrFormat("%.3f", r.elapsed_s),
                                    absl::StrFormat("%.3f", r.requests_per_s),
                                    absl::StrFormat("%.1f", r.generated_tokens_per_s),
                                    absl::StrFormat("%.3f", r.goodput_requests_per_s)};
  for (const LatencySummary* s : {&r.ttft, &r.itl, &r.tpot, &r.e2e}) {
    for (double v : {s->mean, s->p50, s->p90, s->p99, s->max}) {
      cells.push_back(absl::StrFormat("%.3f", v * 1e3));
    }
  }
  return absl::StrJoin(cells, ",");
}

absl::Status AppendCsv(const std::string& path, const Report& report) {
  bool empty = true;
  {
    std::ifstream existing(path, std::ios::binary | std::ios::ate);
    if (existing && existing.tellg() > 0) empty = false;
  }
  std::ofstream out(path, std::ios::app);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  if (empty) out << CsvHeader() << "\n";
  out << CsvRow(report) << "\n";
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat("error writing ", path));
  return absl::OkStatus();
}

}  // namespace coalesce::bench
