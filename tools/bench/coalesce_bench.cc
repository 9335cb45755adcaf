// coalesce-bench: drives a running coalesce server with many concurrent
// streams and reports throughput, latency percentiles and goodput.
//
//   build/bin/coalesce-bench --concurrency=16 --duration=30s            # closed loop
//   build/bin/coalesce-bench --rate=20 --duration=60s --json=out.json  # open loop
//
// This file reads the flags into a Config, asks the server for its model,
// runs the load (tools/bench/load_runner.h) and prints the report
// (tools/bench/report.h).
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/flags.h"
#include "grpcpp/grpcpp.h"
#include "tools/bench/load_runner.h"
#include "tools/bench/report.h"
#include "tools/bench/workload.h"
#include "tools/common/client_channel.h"

using coalesce::bench::IntRange;

// ---------------------------------------------------------------------------
// Flags (read once, in main, into a Config)
// ---------------------------------------------------------------------------

ABSL_FLAG(std::string, server, "localhost:50051", "Address of a coalesce server.");
ABSL_FLAG(int, concurrency, 16,
          "Closed loop: keep this many streams in flight, sending a new request as soon as "
          "one ends.");
ABSL_FLAG(double, rate, 0,
          "Open loop: send this many requests per second on average, with Poisson arrivals "
          "(exponential gaps from --seed), whatever the server's pace. 0: closed loop.");
ABSL_FLAG(int, max_in_flight, 0,
          "Open loop: delay arrivals while this many streams are in flight (the delays are "
          "reported as send lag). 0: no limit.");
ABSL_FLAG(absl::Duration, duration, absl::Seconds(30),
          "How long to send measured requests, after the warm-up. Ignored with --requests.");
ABSL_FLAG(int64_t, requests, 0, "Send this many measured requests instead of using --duration.");
ABSL_FLAG(absl::Duration, warmup, absl::Seconds(5),
          "Requests sent during this first period are not in the statistics (the server's "
          "caches, allocator and the connection settle).");
ABSL_FLAG(int64_t, warmup_requests, 0,
          "If above 0: the first N requests are the warm-up, instead of --warmup.");
ABSL_FLAG(IntRange, prompt_tokens, (IntRange{128, 128}),
          "Prompt length in tokens, BOS included: N, or LO:HI for uniform lengths.");
ABSL_FLAG(IntRange, max_new_tokens, (IntRange{128, 128}),
          "max_new_tokens of each request: N or LO:HI. An upper bound: the server has no "
          "'ignore EOS', so the model may end a generation early; the report counts the tokens "
          "that arrived.");
ABSL_FLAG(int, shared_prefix_tokens, 0,
          "Generated prompts: every request starts with the same system prompt of this many "
          "tokens (BOS first); --prompt_tokens is then the length of each request's own part.");
ABSL_FLAG(int, turns, 1,
          "Generated prompts, closed loop: conversations of this many requests; each turn "
          "re-sends the conversation so far (the previous prompt and its answer) plus a new "
          "message of --prompt_tokens tokens.");
ABSL_FLAG(std::string, workload, "",
          "JSON-lines file of requests, used in order and cycled: {\"prompt\": TEXT} or "
          "{\"prompt_token_ids\": [IDS]}, optionally with \"max_new_tokens\" (else "
          "--max_new_tokens).");
ABSL_FLAG(uint64_t, seed, 1,
          "Seed of the prompts, lengths, arrival times and sampling seeds: the same seed sends "
          "the same requests.");
ABSL_FLAG(double, temperature, 0,
          "Sampling temperature; 0 is greedy. Sampled requests get the seed --seed + index.");
ABSL_FLAG(absl::Duration, timeout, absl::Minutes(10), "Deadline of each request.");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(60),
          "After the last send, wait this long for the streams in flight, then cancel them.");
ABSL_FLAG(absl::Duration, wait_for_server, absl::Seconds(10),
          "How long GetModelInfo waits for the server to come up. 0: fail at once.");
ABSL_FLAG(int, vocab_size, 0,
          "If above 0: skip GetModelInfo and use this vocabulary size (with "
          "--context_length), e.g. to measure a server that is not up yet.");
ABSL_FLAG(int, context_length, 2048, "The context length used with --vocab_size.");
ABSL_FLAG(absl::Duration, slo_ttft, absl::Seconds(1),
          "Goodput objective: time to first token at most this.");
ABSL_FLAG(absl::Duration, slo_itl, absl::Milliseconds(100),
          "Goodput objective: mean inter-token latency of the request (time per output token) "
          "at most this.");
ABSL_FLAG(std::string, format, "table", "What to print on stdout: table, json or none.");
ABSL_FLAG(std::string, json, "", "Also write the JSON report to this file.");
ABSL_FLAG(std::string, csv, "",
          "Append a one-row CSV summary to this file (with a header when the file is new), "
          "so that a sweep can collect one row per run.");
ABSL_FLAG(bool, per_request, false, "Include one record per request in the JSON report.");
ABSL_FLAG(bool, progress, true,
          "Show progress on stderr: a bar when stderr is a terminal, else a line a second.");
ABSL_FLAG(int, channels, 1,
          "gRPC channels (TCP connections) to spread the streams over, round robin. One "
          "connection serializes its frames; several spread the client's work.");

namespace coalesce::bench {
namespace {

using coalesce::v1::Generator;

// Exit codes, also in the usage message.
constexpr int kExitOk = 0;
constexpr int kExitRequestsFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitNoServer = 3;

extern "C" void OnInterrupt(int) { Interrupt(); }

absl::StatusOr<Config> ConfigFromFlags() {
  Config c;
  c.server = absl::GetFlag(FLAGS_server);
  c.rate = absl::GetFlag(FLAGS_rate);
  c.mode = c.rate > 0 ? Mode::kOpenLoop : Mode::kClosedLoop;
  c.concurrency = absl::GetFlag(FLAGS_concurrency);
  c.max_in_flight = absl::GetFlag(FLAGS_max_in_flight);
  c.duration = absl::GetFlag(FLAGS_duration);
  c.requests = absl::GetFlag(FLAGS_requests);
  c.warmup = absl::GetFlag(FLAGS_warmup);
  c.warmup_requests = absl::GetFlag(FLAGS_warmup_requests);
  c.workload.prompt_tokens = absl::GetFlag(FLAGS_prompt_tokens);
  c.workload.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  c.workload.file = absl::GetFlag(FLAGS_workload);
  c.workload.seed = absl::GetFlag(FLAGS_seed);
  c.workload.shared_prefix_tokens = absl::GetFlag(FLAGS_shared_prefix_tokens);
  c.workload.turns = absl::GetFlag(FLAGS_turns);
  c.temperature = absl::GetFlag(FLAGS_temperature);
  c.timeout = absl::GetFlag(FLAGS_timeout);
  c.drain_timeout = absl::GetFlag(FLAGS_drain_timeout);
  c.wait_for_server = absl::GetFlag(FLAGS_wait_for_server);
  c.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  c.context_length = absl::GetFlag(FLAGS_context_length);
  c.slo_ttft_s = absl::ToDoubleSeconds(absl::GetFlag(FLAGS_slo_ttft));
  c.slo_itl_s = absl::ToDoubleSeconds(absl::GetFlag(FLAGS_slo_itl));
  c.format = absl::GetFlag(FLAGS_format);
  c.json_path = absl::GetFlag(FLAGS_json);
  c.csv_path = absl::GetFlag(FLAGS_csv);
  c.per_request = absl::GetFlag(FLAGS_per_request);
  c.progress = absl::GetFlag(FLAGS_progress);
  c.channels = absl::GetFlag(FLAGS_channels);

  if (c.rate < 0) return absl::InvalidArgumentError("--rate must be >= 0");
  if (c.mode == Mode::kClosedLoop && c.concurrency < 1) {
    return absl::InvalidArgumentError("--concurrency must be at least 1");
  }
  if (c.max_in_flight < 0) return absl::InvalidArgumentError("--max_in_flight must be >= 0");
  if (c.requests < 0 || c.warmup_requests < 0) {
    return absl::InvalidArgumentError("--requests and --warmup_requests must be >= 0");
  }
  if (c.requests == 0 && c.duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--duration must be positive (or give --requests)");
  }
  if (c.warmup < absl::ZeroDuration()) return absl::InvalidArgumentError("--warmup must be >= 0");
  if (c.timeout <= absl::ZeroDuration() || c.drain_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--timeout must be positive and --drain_timeout >= 0");
  }
  if (c.format != "table" && c.format != "json" && c.format != "none") {
    return absl::InvalidArgumentError("--format must be table, json or none");
  }
  if (c.channels < 1) return absl::InvalidArgumentError("--channels must be at least 1");
  if (c.workload.turns > 1 && c.mode != Mode::kClosedLoop) {
    return absl::InvalidArgumentError(
        "--turns needs the closed loop (no --rate): a turn is sent when the previous one ends");
  }
  return c;
}

nlohmann::json ConfigJson(const Config& c) {
  nlohmann::json j = {
      {"server", c.server},
      {"mode", c.mode == Mode::kOpenLoop ? "open" : "closed"},
      {"concurrency", c.mode == Mode::kClosedLoop ? c.concurrency : 0},
      {"rate", c.rate},
      {"max_in_flight", c.max_in_flight},
      {"duration_s", c.requests > 0 ? nlohmann::json(nullptr)
                                    : nlohmann::json(absl::ToDoubleSeconds(c.duration))},
      {"requests", c.requests},
      {"warmup_s", c.warmup_requests > 0 ? 0.0 : absl::ToDoubleSeconds(c.warmup)},
      {"warmup_requests", c.warmup_requests},
      {"prompt_tokens", AbslUnparseFlag(c.workload.prompt_tokens)},
      {"max_new_tokens", AbslUnparseFlag(c.workload.max_new_tokens)},
      {"workload", c.workload.file},
      {"shared_prefix_tokens", c.workload.shared_prefix_tokens},
      {"turns", c.workload.turns},
      {"seed", c.workload.seed},
      {"temperature", c.temperature},
      {"timeout_s", absl::ToDoubleSeconds(c.timeout)},
      {"drain_timeout_s", absl::ToDoubleSeconds(c.drain_timeout)},
      {"slo_ttft_s", c.slo_ttft_s},
      {"slo_itl_s", c.slo_itl_s},
      {"channels", c.channels},
  };
  return j;
}

std::string Title(const Config& c, const std::string& model) {
  std::string how =
      c.mode == Mode::kClosedLoop
          ? absl::StrFormat("closed loop, %d streams", c.concurrency)
          : absl::StrFormat("open loop, Poisson %g requests/s%s", c.rate,
                            c.max_in_flight > 0
                                ? absl::StrCat(", at most ", c.max_in_flight, " in flight")
                                : "");
  std::string amount = c.requests > 0 ? absl::StrCat(c.requests, " requests")
                                      : absl::StrCat(absl::FormatDuration(c.duration));
  std::string warmup = c.warmup_requests > 0
                           ? absl::StrCat(c.warmup_requests, " warm-up requests")
                           : absl::StrCat(absl::FormatDuration(c.warmup), " warm-up");
  return absl::StrCat("coalesce-bench: ", how, ", ", amount, " after ", warmup, "\nserver  ",
                      c.server, ": ", model);
}

int Main() {
  absl::StatusOr<Config> config = ConfigFromFlags();
  if (!config.ok()) {
    std::fprintf(stderr, "coalesce-bench: %s\n", std::string(config.status().message()).c_str());
    return kExitUsage;
  }
  const Config& c = *config;

  // One channel per --channels, each its own connection: gRPC shares a
  // subchannel between equal channels unless told otherwise.
  std::vector<std::unique_ptr<Generator::Stub>> stubs;
  for (int i = 0; i < c.channels; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("coalesce.bench.channel", i);
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        coalesce::tools::ClientChannelFromFlags(c.server, args);
    if (!channel.ok()) {
      std::fprintf(stderr, "coalesce-bench: %s\n", std::string(channel.status().message()).c_str());
      return kExitUsage;
    }
    stubs.push_back(Generator::NewStub(*channel));
  }

  absl::StatusOr<ModelDescription> model = DescribeModel(c, *stubs[0]);
  if (!model.ok()) {
    std::fprintf(stderr, "coalesce-bench: %s\n", std::string(model.status().message()).c_str());
    return kExitNoServer;
  }
  absl::StatusOr<Workload> workload = Workload::Create(c.workload, model->limits);
  if (!workload.ok()) {
    std::fprintf(stderr, "coalesce-bench: %s\n", std::string(workload.status().message()).c_str());
    return kExitUsage;
  }
  const std::string workload_line =
      absl::StrCat("load    ", workload->Describe(),
                   c.temperature > 0 ? absl::StrFormat(", temperature %g", c.temperature)
                                     : std::string(", greedy"),
                   "; EOS may end a generation early");

  std::signal(SIGINT, OnInterrupt);
  // Leaked on purpose when streams never ended: their reactors hold it.
  auto* runner = new Runner(c, std::move(stubs), *std::move(workload));
  ReportInput input = runner->Run();
  const int64_t unfinished = runner->Unfinished();
  std::signal(SIGINT, SIG_DFL);

  input.config = ConfigJson(c);
  input.config["interrupted"] = Interrupts() > 0;
  input.model = model->json;
  input.title = Title(c, model->summary);
  input.workload = workload_line;
  input.slo_ttft_s = c.slo_ttft_s;
  input.slo_itl_s = c.slo_itl_s;
  const Report report = BuildReport(std::move(input));

  // 4. Outputs. A file that cannot be written is an error, after the others.
  int exit_code = kExitOk;
  const nlohmann::json json = ToJson(report, c.per_request);
  if (c.format == "table") std::fputs(FormatTable(report).c_str(), stdout);
  if (c.format == "json") std::printf("%s\n", json.dump(2).c_str());
  std::fflush(stdout);
  if (!c.json_path.empty()) {
    std::ofstream out(c.json_path);
    out << json.dump(2) << "\n";
    out.close();
    if (!out) {
      std::fprintf(stderr, "coalesce-bench: cannot write %s\n", c.json_path.c_str());
      exit_code = kExitUsage;
    }
  }
  if (!c.csv_path.empty()) {
    if (absl::Status s = AppendCsv(c.csv_path, report); !s.ok()) {
      std::fprintf(stderr, "coalesce-bench: %s\n", std::string(s.message()).c_str());
      exit_code = kExitUsage;
    }
  }
  if (exit_code == kExitOk && (report.failed > 0 || report.in_flight_at_end > 0 ||
                               report.warmup_failed > 0 || report.warmup_in_flight_at_end > 0)) {
    exit_code = kExitRequestsFailed;
  }
  if (unfinished > 0) {
    // Streams gRPC never ended still point at the runner: leave without
    // destructors rather than race them.
    std::fflush(nullptr);
    std::_Exit(exit_code);
  }
  delete runner;
  return exit_code;
}

}  // namespace
}  // namespace coalesce::bench

int main(int argc, char** argv) {
  coalesce::ParseFlags(
      argc, argv,
      "Load generator for a coalesce server: closed loop (--concurrency) or open loop "
      "(--rate), reporting throughput, TTFT, inter-token and end-to-end latency "
      "percentiles, and goodput under --slo_ttft/--slo_itl.\n"
      "Usage: coalesce-bench --server=HOST:PORT [--concurrency=16 | --rate=20] "
      "[--duration=30s | --requests=N] [--json=FILE] [--csv=FILE]\n"
      "Exit status: 0 every request succeeded; 1 some request failed or was cancelled at "
      "the end (or a flag did not parse: absl's own exit); 2 a flag value or workload the "
      "bench refuses, or an output file that cannot be written; 3 the server did not answer "
      "GetModelInfo.");
  return coalesce::bench::Main();
}
