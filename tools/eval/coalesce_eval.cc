// coalesce-eval: measures the quality of the model a coalesce server serves,
// through the server, as any client gets it:
//
//   build/bin/coalesce-eval --text=/usr/share/common-licenses/GPL-3 --max_bytes=16384
//   build/bin/coalesce-eval --tasks=tools/eval/data/commonsense.jsonl
//   build/bin/coalesce-eval --prompts=tools/eval/data/prompts.jsonl --agree_with=HOST:PORT
//
// Perplexity of a text from prompt log-probabilities over sliding windows;
// accuracy on a multiple-choice task file; greedy agreement with a second
// server. scoring.h defines each; this file reads the flags, checks the input
// files, sends the requests (--concurrency at a time, so that the server
// batches them) and prints the report (report.h).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "coalesce/v1/generator.grpc.pb.h"
#include "common/flags.h"
#include "grpcpp/grpcpp.h"
#include "tools/common/client_channel.h"
#include "tools/eval/inputs.h"
#include "tools/eval/report.h"
#include "tools/eval/scoring.h"

// ---------------------------------------------------------------------------
// Flags (read once, in main, into a Config)
// ---------------------------------------------------------------------------

ABSL_FLAG(std::string, server, "localhost:50051", "Address of the coalesce server to measure.");
ABSL_FLAG(std::string, text, "",
          "Perplexity: a UTF-8 text file, tokenized by the server (BOS added as for a prompt) "
          "and scored over sliding windows (--window, --stride).");
ABSL_FLAG(int64_t, max_bytes, 0,
          "Perplexity: score only the first N bytes of --text (cut back to a whole UTF-8 "
          "character). 0: all of it.");
ABSL_FLAG(int64_t, window, 0,
          "Perplexity: the most tokens of one scored prompt, at most the context length - 1. "
          "0: the context length - 1.");
ABSL_FLAG(int64_t, stride, 0,
          "Perplexity: how many tokens each window after the first advances, and scores; "
          "1 to --window - 1, so that each of its tokens sees at least window - stride tokens "
          "of context. 0: half the window.");
ABSL_FLAG(std::string, tasks, "",
          "Multiple choice: a JSON-lines file of {\"context\": TEXT, \"choices\": [TEXT, ...], "
          "\"answer\": INDEX}; each choice is scored by its tokens' log-probabilities after the "
          "context (summed, per byte and per token).");
ABSL_FLAG(int, max_items, 0, "Multiple choice: score only the first N items. 0: all.");
ABSL_FLAG(std::string, prompts, "",
          "Greedy agreement: a JSON-lines file of {\"prompt\": TEXT}, each generated greedily "
          "by --server and by --agree_with.");
ABSL_FLAG(std::string, agree_with, "",
          "Greedy agreement: the address of a second server (another precision, KV-cache type "
          "or device) whose greedy tokens are compared with --server's.");
ABSL_FLAG(int, max_new_tokens, 64, "Greedy agreement: tokens to generate for each prompt.");
ABSL_FLAG(int, concurrency, 8,
          "Requests in flight at once, so that the server batches them (the CPU engine's "
          "results do not depend on the batch).");
ABSL_FLAG(absl::Duration, timeout, absl::Minutes(10), "Deadline of each request.");
ABSL_FLAG(absl::Duration, wait_for_server, absl::Seconds(10),
          "How long to wait for each server to answer GetModelInfo. 0: fail at once.");
ABSL_FLAG(std::string, format, "table", "What to print on stdout: table, json or none.");
ABSL_FLAG(std::string, json, "", "Also write the JSON report to this file.");
ABSL_FLAG(bool, per_item, false,
          "Include the window plan with each window's negative log-likelihood, every item's "
          "choice scores and every prompt's tokens in the JSON report.");
ABSL_FLAG(bool, progress, true,
          "Show progress on stderr: a bar when stderr is a terminal, else a line a second.");

namespace coalesce::eval {
namespace {

using coalesce::v1::Generator;

// Exit codes, also in the usage message.
constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitInput = 2;
constexpr int kExitNoServer = 3;

struct Config {
  std::string server;
  std::string text;
  int64_t max_bytes = 0;
  int64_t window = 0;
  int64_t stride = 0;
  std::string tasks;
  int max_items = 0;
  std::string prompts;
  std::string agree_with;
  int max_new_tokens = 64;
  int concurrency = 8;
  absl::Duration timeout;
  absl::Duration wait_for_server;
  std::string format;
  std::string json_path;
  bool per_item = false;
  bool progress = true;
};

absl::StatusOr<Config> ConfigFromFlags() {
  Config c;
  c.server = absl::GetFlag(FLAGS_server);
  c.text = absl::GetFlag(FLAGS_text);
  c.max_bytes = absl::GetFlag(FLAGS_max_bytes);
  c.window = absl::GetFlag(FLAGS_window);
  c.stride = absl::GetFlag(FLAGS_stride);
  c.tasks = absl::GetFlag(FLAGS_tasks);
  c.max_items = absl::GetFlag(FLAGS_max_items);
  c.prompts = absl::GetFlag(FLAGS_prompts);
  c.agree_with = absl::GetFlag(FLAGS_agree_with);
  c.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  c.concurrency = absl::GetFlag(FLAGS_concurrency);
  c.timeout = absl::GetFlag(FLAGS_timeout);
  c.wait_for_server = absl::GetFlag(FLAGS_wait_for_server);
  c.format = absl::GetFlag(FLAGS_format);
  c.json_path = absl::GetFlag(FLAGS_json);
  c.per_item = absl::GetFlag(FLAGS_per_item);
  c.progress = absl::GetFlag(FLAGS_progress);

  if (c.text.empty() && c.tasks.empty() && c.prompts.empty()) {
    return absl::InvalidArgumentError(
        "nothing to measure: give --text (perplexity), --tasks (multiple choice) or --prompts "
        "with --agree_with (greedy agreement)");
  }
  if (c.prompts.empty() != c.agree_with.empty()) {
    return absl::InvalidArgumentError("--prompts and --agree_with go together");
  }
  if (c.max_bytes < 0 || c.window < 0 || c.stride < 0 || c.max_items < 0) {
    return absl::InvalidArgumentError(
        "--max_bytes, --window, --stride and --max_items must be >= 0");
  }
  if (c.max_new_tokens < 1) return absl::InvalidArgumentError("--max_new_tokens must be >= 1");
  if (c.concurrency < 1) return absl::InvalidArgumentError("--concurrency must be at least 1");
  if (c.timeout <= absl::ZeroDuration() || c.wait_for_server < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--timeout must be positive and --wait_for_server >= 0");
  }
  if (c.format != "table" && c.format != "json" && c.format != "none") {
    return absl::InvalidArgumentError("--format must be table, json or none");
  }
  return c;
}

// An input the tool cannot evaluate (a malformed file, a choice that adds no
// tokens, a window the context cannot hold) is tagged, so that it exits with
// kExitInput rather than as a failed request.
constexpr char kInputPayload[] = "coalesce.eval/input";

absl::Status InputError(const absl::Status& status) {
  absl::Status tagged = status;
  tagged.SetPayload(kInputPayload, absl::Cord("1"));
  return tagged;
}
absl::Status InputError(absl::string_view message) {
  return InputError(absl::InvalidArgumentError(message));
}
bool IsInputError(const absl::Status& status) {
  return status.GetPayload(kInputPayload).has_value();
}

// ---------------------------------------------------------------------------
// The server
// ---------------------------------------------------------------------------

// One coalesce server, called synchronously (from many threads at once).
class Server {
 public:
  // Connects with the TLS and API-key flags (tools/common/client_channel.h).
  static absl::StatusOr<std::unique_ptr<Server>> Connect(std::string address,
                                                         absl::Duration timeout) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);  // a long text's token ids
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        coalesce::tools::ClientChannelFromFlags(address, args);
    if (!channel.ok()) return channel.status();
    return std::unique_ptr<Server>(new Server(std::move(address), *channel, timeout));
  }

  const std::string& address() const { return address_; }
  int64_t requests() const { return requests_.load(); }

  // GetModelInfo, waiting up to `wait` for the server to come up.
  absl::StatusOr<ServerDescription> Describe(absl::Duration wait) {
    grpc::ClientContext context;
    // With a wait: queue the call until the channel connects, up to `wait`.
    // Without: fail at once when it cannot connect (but give a server that
    // is up time to answer).
    const bool wait_for_ready = wait > absl::ZeroDuration();
    context.set_wait_for_ready(wait_for_ready);
    context.set_deadline(
        absl::ToChronoTime(absl::Now() + (wait_for_ready ? wait : absl::Seconds(10))));
    coalesce::v1::ModelInfo info;
    const grpc::Status status = stub_->GetModelInfo(&context, {}, &info);
    if (!status.ok()) {
      return absl::UnavailableError(absl::StrCat("no coalesce server answered at ", address_,
                                                 " (waited ", absl::FormatDuration(wait),
                                                 "): ", status.error_message()));
    }
    ServerDescription d;
    d.address = address_;
    d.model = info.name();
    d.backend = info.backend();
    d.context_length = info.context_length();
    d.vocab_size = info.vocab_size();
    d.bos_token_id = info.bos_token_id();
    return d;
  }

  absl::StatusOr<std::vector<int32_t>> Tokenize(const std::string& text) {
    grpc::ClientContext context;
    SetDeadline(context);
    coalesce::v1::TokenizeRequest request;
    request.set_text(text);
    request.set_add_special_tokens(true);  // as Generate encodes a prompt
    coalesce::v1::TokenizeResponse response;
    const grpc::Status status = stub_->Tokenize(&context, request, &response);
    if (!status.ok()) return Failed("Tokenize", status);
    return std::vector<int32_t>(response.token_ids().begin(), response.token_ids().end());
  }

  // The prompt log-probabilities of `ids`: a Generate call of one new token.
  absl::StatusOr<std::vector<TokenLogprob>> PromptLogprobs(const std::vector<int32_t>& ids) {
    coalesce::v1::GenerateRequest request;
    request.mutable_prompt_token_ids()->Add(ids.begin(), ids.end());
    request.set_max_new_tokens(1);
    request.set_prompt_logprobs(true);
    std::vector<TokenLogprob> out;
    absl::Status status = Generate(request, [&](const coalesce::v1::GenerateResponse& r) {
      for (const coalesce::v1::TokenLogprob& lp : r.prompt_logprobs()) {
        out.push_back({lp.token_id(), lp.logprob()});
      }
    });
    if (!status.ok()) return status;
    return out;
  }

  // The greedy generation of a text prompt.
  absl::StatusOr<std::vector<int32_t>> Greedy(const std::string& prompt, int max_new_tokens) {
    coalesce::v1::GenerateRequest request;
    request.set_prompt(prompt);
    request.set_max_new_tokens(max_new_tokens);  // no sampling settings: greedy
    std::vector<int32_t> out;
    absl::Status status = Generate(request, [&](const coalesce::v1::GenerateResponse& r) {
      out.insert(out.end(), r.token_ids().begin(), r.token_ids().end());
    });
    if (!status.ok()) return status;
    return out;
  }

 private:
  void SetDeadline(grpc::ClientContext& context) const {
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
  }

  absl::Status Failed(absl::string_view rpc, const grpc::Status& status) const {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        absl::StrCat(rpc, " on ", address_, " failed: ", status.error_message()));
  }

  absl::Status Generate(const coalesce::v1::GenerateRequest& request,
                        const std::function<void(const coalesce::v1::GenerateResponse&)>& each) {
    ++requests_;
    grpc::ClientContext context;
    SetDeadline(context);
    auto reader = stub_->Generate(&context, request);
    coalesce::v1::GenerateResponse response;
    while (reader->Read(&response)) each(response);
    const grpc::Status status = reader->Finish();
    if (!status.ok()) return Failed("Generate", status);
    return absl::OkStatus();
  }

  Server(std::string address, std::shared_ptr<grpc::Channel> channel, absl::Duration timeout)
      : address_(std::move(address)), timeout_(timeout), stub_(Generator::NewStub(channel)) {}

  const std::string address_;
  const absl::Duration timeout_;
  std::unique_ptr<Generator::Stub> stub_;
  std::atomic<int64_t> requests_{0};
};

// ---------------------------------------------------------------------------
// Running jobs concurrently, with progress
// ---------------------------------------------------------------------------

// What RunJobs' threads share.
struct JobState {
  absl::Mutex mu;
  int64_t done ABSL_GUARDED_BY(mu) = 0;
  int running ABSL_GUARDED_BY(mu) = 0;  // threads not yet finished
  absl::Status failure ABSL_GUARDED_BY(mu);
  bool Finished() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return running == 0; }
};

// Runs job(0) .. job(n - 1) on up to `concurrency` threads, each taking the
// next index until none are left or a job has failed, and draws the progress
// of `phase` on stderr meanwhile. Returns the first failure.
absl::Status RunJobs(const Config& config, absl::string_view phase, int64_t n,
                     const std::function<absl::Status(int64_t)>& job) {
  const absl::Time start = absl::Now();
  const bool tty = isatty(STDERR_FILENO) != 0;
  std::atomic<int64_t> next{0};
  JobState state;
  const int threads =
      static_cast<int>(std::min<int64_t>(config.concurrency, std::max<int64_t>(n, 1)));
  {
    absl::MutexLock lock(&state.mu);
    state.running = threads;
  }
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&] {
      while (true) {
        {
          absl::MutexLock lock(&state.mu);
          if (!state.failure.ok()) break;
        }
        const int64_t i = next.fetch_add(1);
        if (i >= n) break;
        absl::Status status = job(i);
        absl::MutexLock lock(&state.mu);
        if (status.ok()) {
          ++state.done;
        } else if (state.failure.ok()) {
          state.failure = std::move(status);
        }
      }
      absl::MutexLock lock(&state.mu);
      --state.running;
    });
  }
  const auto show = [&](int64_t done, bool last) {
    if (!config.progress) return;
    const std::string line =
        ProgressLine(phase, done, n, absl::ToDoubleSeconds(absl::Now() - start), tty);
    if (tty) {
      std::fprintf(stderr, "\r\033[K%s%s", line.c_str(), last ? "\n" : "");
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
    std::fflush(stderr);
  };
  // A bar redrawn 5 times a second on a terminal; a line a second in a log.
  const absl::Duration tick = tty ? absl::Milliseconds(200) : absl::Seconds(1);
  int64_t done;
  absl::Status result;
  while (true) {
    {
      absl::MutexLock lock(&state.mu);
      const bool finished =
          state.mu.AwaitWithTimeout(absl::Condition(&state, &JobState::Finished), tick);
      done = state.done;
      result = state.failure;
      if (finished) break;
    }
    show(done, false);
  }
  show(done, true);
  for (std::thread& t : workers) t.join();
  return result;
}

// ---------------------------------------------------------------------------
// The three measurements
// ---------------------------------------------------------------------------

absl::StatusOr<PerplexityReport> RunPerplexity(const Config& c, Server& server,
                                               const ServerDescription& desc,
                                               const TextInput& text) {
  PerplexityReport report;
  report.file = c.text;
  report.file_bytes = text.file_bytes;
  report.bytes = static_cast<int64_t>(text.text.size());
  absl::StatusOr<std::vector<int32_t>> tokens = server.Tokenize(text.text);
  if (!tokens.ok()) {
    if (tokens.status().code() == absl::StatusCode::kResourceExhausted) {
      return InputError(absl::StrCat(tokens.status().message(),
                                     " (the text is too large for one request: score part of "
                                     "it with --max_bytes)"));
    }
    return tokens.status();
  }
  report.tokens = static_cast<int64_t>(tokens->size());
  const int64_t longest = desc.context_length - 1;  // a prompt plus one new token
  report.window = c.window > 0 ? c.window : longest;
  if (report.window > longest) {
    return InputError(absl::StrCat("--window=", report.window, " does not fit the context of ",
                                   desc.context_length, " tokens (at most ", longest, ")"));
  }
  report.stride = c.stride > 0 ? c.stride : std::max<int64_t>(1, report.window / 2);
  absl::StatusOr<std::vector<Window>> plan =
      PlanWindows(report.tokens, report.window, report.stride);
  if (!plan.ok()) return InputError(absl::StrCat(c.text, ": ", plan.status().message()));
  report.windows = *std::move(plan);

  std::vector<std::vector<double>> scored(report.windows.size());
  absl::Status status = RunJobs(c, "perplexity windows", report.windows.size(), [&](int64_t i) {
    const Window& w = report.windows[i];
    const std::vector<int32_t> ids(tokens->begin() + w.begin, tokens->begin() + w.end);
    absl::StatusOr<std::vector<TokenLogprob>> lps = server.PromptLogprobs(ids);
    if (!lps.ok()) return lps.status();
    absl::StatusOr<std::vector<double>> s = ScoredLogprobs(w, *tokens, *lps);
    if (!s.ok()) return s.status();
    scored[i] = *std::move(s);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  // Added in window order, whatever order they finished in.
  for (const std::vector<double>& s : scored) {
    PerplexityAccumulator window;
    window.AddAll(s);
    report.window_nll.push_back(window.nll());
    report.result.AddAll(s);
  }
  return report;
}

absl::StatusOr<MultipleChoiceReport> RunMultipleChoice(const Config& c, Server& server,
                                                       const ServerDescription& desc,
                                                       const std::vector<TaskItem>& items) {
  MultipleChoiceReport report;
  report.file = c.tasks;
  report.items.resize(items.size());
  const int max_prompt = desc.context_length - 1;  // a prompt plus one new token

  // 1. Tokenize each item's context and each context + choice, and make the
  //    prompts that score the choices.
  std::vector<std::vector<ChoicePrompt>> prompts(items.size());
  absl::Status status = RunJobs(c, "multiple choice: tokenize", items.size(), [&](int64_t i) {
    const TaskItem& item = items[i];
    // The split depends on the context alone: the same for every choice.
    const std::string context = SplitContinuation(item.context, "").first;
    absl::StatusOr<std::vector<int32_t>> context_ids = server.Tokenize(context);
    if (!context_ids.ok()) return context_ids.status();
    for (size_t k = 0; k < item.choices.size(); ++k) {
      const auto [ctx, continuation] = SplitContinuation(item.context, item.choices[k]);
      absl::StatusOr<std::vector<int32_t>> whole_ids = server.Tokenize(ctx + continuation);
      if (!whole_ids.ok()) return whole_ids.status();
      absl::StatusOr<ChoicePrompt> prompt = MakeChoicePrompt(*context_ids, *whole_ids, max_prompt);
      if (!prompt.ok()) {
        return InputError(absl::StrCat(c.tasks, " line ", item.line, ", choice ", k, ": ",
                                       prompt.status().message()));
      }
      prompts[i].push_back(*std::move(prompt));
    }
    return absl::OkStatus();
  });
  if (!status.ok()) return status;

  // 2. Score every choice of every item.
  std::vector<std::pair<int, int>> jobs;  // (item, choice)
  for (size_t i = 0; i < items.size(); ++i) {
    report.items[i].line = items[i].line;
    report.items[i].answer = items[i].answer;
    report.items[i].choices.resize(items[i].choices.size());
    for (size_t k = 0; k < items[i].choices.size(); ++k) jobs.emplace_back(i, k);
  }
  status = RunJobs(c, "multiple choice: score", jobs.size(), [&](int64_t j) {
    const auto [i, k] = jobs[j];
    const ChoicePrompt& prompt = prompts[i][k];
    absl::StatusOr<std::vector<TokenLogprob>> lps = server.PromptLogprobs(prompt.prompt_ids);
    if (!lps.ok()) return lps.status();
    // The choice's tokens are the prompt's last ones: a window that scores
    // exactly them.
    const int64_t n = static_cast<int64_t>(prompt.prompt_ids.size());
    absl::StatusOr<std::vector<double>> s =
        ScoredLogprobs({0, n, n - prompt.choice_tokens}, prompt.prompt_ids, *lps);
    if (!s.ok()) return s.status();
    ChoiceScore& score = report.items[i].choices[k];
    for (double lp : *s) score.logprob += lp;
    score.tokens = prompt.choice_tokens;
    score.bytes = static_cast<int64_t>(items[i].choices[k].size());
    return absl::OkStatus();
  });
  if (!status.ok()) return status;

  for (size_t i = 0; i < items.size(); ++i) {
    ItemReport& item = report.items[i];
    item.prediction = Predict(item.choices);
    for (const ChoicePrompt& p : prompts[i]) {
      item.truncated_tokens = std::max(item.truncated_tokens, p.truncated);
    }
    report.truncated_items += item.truncated_tokens > 0;
    report.result.Add(item.prediction, item.answer);
  }
  return report;
}

absl::StatusOr<AgreementReport> RunAgreement(const Config& c, Server& server, Server& other,
                                             const ServerDescription& other_desc,
                                             const std::vector<PromptItem>& prompts) {
  AgreementReport report;
  report.file = c.prompts;
  report.other = other_desc;
  report.max_new_tokens = c.max_new_tokens;
  report.prompts.resize(prompts.size());
  absl::Status status = RunJobs(c, "greedy agreement", prompts.size(), [&](int64_t i) {
    PromptReport& p = report.prompts[i];
    p.line = prompts[i].line;
    absl::StatusOr<std::vector<int32_t>> a = server.Greedy(prompts[i].prompt, c.max_new_tokens);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::vector<int32_t>> b = other.Greedy(prompts[i].prompt, c.max_new_tokens);
    if (!b.ok()) return b.status();
    p.tokens = *std::move(a);
    p.other_tokens = *std::move(b);
    p.agreement = CompareGenerations(p.tokens, p.other_tokens);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  for (const PromptReport& p : report.prompts) report.result.Add(p.agreement);
  return report;
}

// ---------------------------------------------------------------------------
// main
// ---------------------------------------------------------------------------

int Fail(int code, const absl::Status& status) {
  std::fprintf(stderr, "coalesce-eval: %s\n", std::string(status.message()).c_str());
  return code;
}

int Main() {
  absl::StatusOr<Config> config = ConfigFromFlags();
  if (!config.ok()) return Fail(kExitInput, config.status());
  const Config& c = *config;

  // 1. Every input file, checked before any server is asked.
  std::optional<TextInput> text;
  std::vector<TaskItem> items;
  std::vector<PromptItem> prompts;
  if (!c.text.empty()) {
    absl::StatusOr<TextInput> t = ReadText(c.text, c.max_bytes);
    if (!t.ok()) return Fail(kExitInput, t.status());
    text = *std::move(t);
  }
  if (!c.tasks.empty()) {
    absl::StatusOr<std::string> contents = ReadFile(c.tasks);
    if (!contents.ok()) return Fail(kExitInput, contents.status());
    absl::StatusOr<std::vector<TaskItem>> parsed = ParseTaskFile(*contents);
    if (!parsed.ok()) {
      return Fail(kExitInput, absl::InvalidArgumentError(
                                  absl::StrCat(c.tasks, " ", parsed.status().message())));
    }
    items = *std::move(parsed);
    if (c.max_items > 0 && static_cast<int>(items.size()) > c.max_items) items.resize(c.max_items);
  }
  if (!c.prompts.empty()) {
    absl::StatusOr<std::string> contents = ReadFile(c.prompts);
    if (!contents.ok()) return Fail(kExitInput, contents.status());
    absl::StatusOr<std::vector<PromptItem>> parsed = ParsePromptFile(*contents);
    if (!parsed.ok()) {
      return Fail(kExitInput, absl::InvalidArgumentError(
                                  absl::StrCat(c.prompts, " ", parsed.status().message())));
    }
    prompts = *std::move(parsed);
  }

  // 2. The servers.
  absl::StatusOr<std::unique_ptr<Server>> connected = Server::Connect(c.server, c.timeout);
  if (!connected.ok()) return Fail(kExitInput, connected.status());
  Server& server = **connected;
  absl::StatusOr<ServerDescription> desc = server.Describe(c.wait_for_server);
  if (!desc.ok()) return Fail(kExitNoServer, desc.status());
  std::unique_ptr<Server> other;
  std::optional<ServerDescription> other_desc;
  if (!c.agree_with.empty()) {
    absl::StatusOr<std::unique_ptr<Server>> second = Server::Connect(c.agree_with, c.timeout);
    if (!second.ok()) return Fail(kExitInput, second.status());
    other = *std::move(second);
    absl::StatusOr<ServerDescription> d = other->Describe(c.wait_for_server);
    if (!d.ok()) return Fail(kExitNoServer, d.status());
    if (d->vocab_size != desc->vocab_size) {
      return Fail(kExitInput,
                  absl::InvalidArgumentError(absl::StrFormat(
                      "%s serves a vocabulary of %d tokens and %s one of %d: their tokens cannot "
                      "be compared",
                      c.server, desc->vocab_size, c.agree_with, d->vocab_size)));
    }
    other_desc = *d;
  }

  // 3. The measurements.
  EvalReport report;
  report.server = *desc;
  const absl::Time start = absl::Now();
  const auto failed = [](const absl::Status& s) {
    return Fail(IsInputError(s) ? kExitInput : kExitFailed, s);
  };
  if (text) {
    absl::StatusOr<PerplexityReport> r = RunPerplexity(c, server, *desc, *text);
    if (!r.ok()) return failed(r.status());
    report.perplexity = *std::move(r);
  }
  if (!items.empty()) {
    absl::StatusOr<MultipleChoiceReport> r = RunMultipleChoice(c, server, *desc, items);
    if (!r.ok()) return failed(r.status());
    report.multiple_choice = *std::move(r);
  }
  if (other) {
    absl::StatusOr<AgreementReport> r = RunAgreement(c, server, *other, *other_desc, prompts);
    if (!r.ok()) return failed(r.status());
    report.agreement = *std::move(r);
  }
  report.elapsed_s = absl::ToDoubleSeconds(absl::Now() - start);
  report.requests = server.requests() + (other ? other->requests() : 0);

  // 4. Outputs.
  const nlohmann::json json = ToJson(report, c.per_item);
  if (c.format == "table") std::fputs(FormatTable(report).c_str(), stdout);
  if (c.format == "json") std::printf("%s\n", json.dump(2).c_str());
  std::fflush(stdout);
  if (!c.json_path.empty()) {
    std::ofstream out(c.json_path);
    out << json.dump(2) << "\n";
    out.close();
    if (!out) return Fail(kExitInput, absl::InvalidArgumentError("cannot write " + c.json_path));
  }
  return kExitOk;
}

}  // namespace
}  // namespace coalesce::eval

int main(int argc, char** argv) {
  coalesce::ParseFlags(
      argc, argv,
      "Measures the quality of the model a coalesce server serves, through the server: "
      "perplexity of a text (--text), accuracy on a multiple-choice task file (--tasks), and "
      "greedy agreement with a second server (--prompts, --agree_with). docs/quality.md "
      "defines each.\n"
      "Usage: coalesce-eval --server=HOST:PORT [--text=FILE] [--tasks=FILE] "
      "[--prompts=FILE --agree_with=HOST:PORT] [--format=json] [--json=FILE]\n"
      "Exit status: 0 done; 1 a request failed (the server's message is printed); 2 a flag "
      "value or an input the tool cannot evaluate (a malformed file, a choice that adds no "
      "tokens, a window the context cannot hold), or an output file that cannot be written; "
      "3 a server did not answer GetModelInfo.");
  return coalesce::eval::Main();
}
