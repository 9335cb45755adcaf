// coalesce-cli: streams one generation to stdout as its tokens arrive, or
// fires N concurrent copies of it to show the server batching them; or chats:
// --chat is an interactive multi-turn conversation (the server renders it
// with the model's chat template), --messages=FILE sends one conversation.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "coalesce/v1/generator.grpc.pb.h"
#include "common/flags.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "tools/common/client_channel.h"

ABSL_FLAG(std::string, server, "localhost:50051", "Address of a coalesce server.");
ABSL_FLAG(std::string, prompt, "Once upon a time", "Prompt text.");
ABSL_FLAG(int, max_new_tokens, 64, "Most tokens to generate.");
ABSL_FLAG(double, temperature, 0.0, "Sampling temperature; 0 is greedy.");
ABSL_FLAG(int, top_k, 0, "Keep the k most likely tokens; 0 keeps all.");
ABSL_FLAG(double, top_p, 1.0, "Nucleus sampling mass in (0, 1].");
ABSL_FLAG(int64_t, seed, -1, "Sampling seed; -1 lets the server choose.");
ABSL_FLAG(std::vector<std::string>, stop, {}, "Comma-separated stop sequences.");
ABSL_FLAG(double, repetition_penalty, 1.0,
          "Divide (multiply, if negative) the logits of tokens already seen; 1 is off.");
ABSL_FLAG(double, frequency_penalty, 0.0,
          "Subtract this times each token's count in the output so far, in [-2, 2].");
ABSL_FLAG(double, presence_penalty, 0.0,
          "Subtract this from tokens the output already holds, in [-2, 2].");
ABSL_FLAG(double, min_p, 0.0,
          "Drop tokens less likely than min_p times the most likely one; 0 is off.");
ABSL_FLAG(int, min_tokens, 0, "Generate at least this many tokens before an end token.");
ABSL_FLAG(bool, ignore_eos, false, "Go on past end-of-sequence tokens.");
ABSL_FLAG(std::vector<std::string>, stop_token_ids, {},
          "Comma-separated token ids that end the generation.");
ABSL_FLAG(std::vector<std::string>, logit_bias, {},
          "Comma-separated id:bias pairs added to those tokens' logits, e.g. 13:-100,42:5.");
ABSL_FLAG(int, n, 1,
          "Samples of the prompt in one request (1 to 16): printed one after another, sample i "
          "drawn with seed + i.");
ABSL_FLAG(int, concurrency, 1,
          "Send this many copies at once. With more than 1, print one summary line "
          "per request instead of the text.");
ABSL_FLAG(double, timeout, 600, "Deadline of each request, in seconds.");
ABSL_FLAG(bool, summary, false,
          "Print one line per request (tokens, latency) instead of the text; "
          "implied by --concurrency above 1.");
ABSL_FLAG(bool, info, false, "Print the served model's description and exit.");
ABSL_FLAG(bool, chat, false,
          "Interactive chat: each line read from stdin is a user message; the reply streams "
          "back and joins the conversation, which the server renders with the model's chat "
          "template. An empty line, /exit or end of input ends it.");
ABSL_FLAG(std::string, system, "", "With --chat or --messages: a system message first.");
ABSL_FLAG(std::string, messages, "",
          "A JSON file holding a conversation, [{\"role\": ..., \"content\": ...}, ...]: "
          "send it (after --system, if given) and print the reply.");

namespace {

using coalesce::v1::GenerateRequest;
using coalesce::v1::GenerateResponse;
using coalesce::v1::Generator;
using Clock = std::chrono::steady_clock;

const char* FinishReasonName(coalesce::v1::FinishReason reason) {
  return coalesce::v1::FinishReason_Name(reason).c_str() + sizeof("FINISH_REASON_") - 1;
}

struct Result {
  grpc::Status status;
  int tokens = 0;
  int messages = 0;
  double first_token_s = 0;
  double total_s = 0;
  std::string finish_reason;
  // With several samples: each one's text and finish reason, by index.
  std::map<int, std::pair<std::string, std::string>> samples;
};

Result RunOne(Generator::Stub& stub, const GenerateRequest& request, bool print_text,
              std::string* text = nullptr) {
  grpc::ClientContext context;
  context.set_deadline(
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(absl::GetFlag(FLAGS_timeout) * 1000)));
  Result result;
  const auto start = Clock::now();
  auto reader = stub.Generate(&context, request);
  GenerateResponse response;
  while (reader->Read(&response)) {
    if (result.tokens == 0 && response.token_ids_size() > 0) {
      result.first_token_s = std::chrono::duration<double>(Clock::now() - start).count();
    }
    result.tokens += response.token_ids_size();
    ++result.messages;
    if (print_text) {
      std::cout << response.text() << std::flush;
    }
    if (text != nullptr) *text += response.text();
    auto& [sample_text, sample_finish] = result.samples[response.index()];
    sample_text += response.text();
    if (response.finish_reason() != coalesce::v1::FINISH_REASON_UNSPECIFIED) {
      result.finish_reason = FinishReasonName(response.finish_reason());
      sample_finish = result.finish_reason;
    }
  }
  result.status = reader->Finish();
  result.total_s = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

int PrintInfo(Generator::Stub& stub) {
  grpc::ClientContext context;
  coalesce::v1::ModelInfo info;
  grpc::Status status = stub.GetModelInfo(&context, {}, &info);
  if (!status.ok()) {
    std::cerr << "error: " << status.error_message() << "\n";
    return 1;
  }
  std::cout << info.DebugString();
  return 0;
}

int ReportFailure(const grpc::Status& status) {
  std::cerr << "error: " << status.error_code() << " " << status.error_message() << "\n";
  return 1;
}

void PrintStats(const Result& r) {
  std::cerr << absl::StrFormat(
      "[%d tokens in %d messages, first token %.1f ms, %.1f tokens/s, finish %s]\n", r.tokens,
      r.messages, r.first_token_s * 1e3, r.tokens / std::max(r.total_s, 1e-9), r.finish_reason);
}

void AddMessage(GenerateRequest& request, const std::string& role, const std::string& content) {
  coalesce::v1::ChatMessage* m = request.add_messages();
  m->set_role(role);
  m->set_content(content);
}

// --messages=FILE: one conversation from a JSON list, and its reply.
int SendMessagesFile(Generator::Stub& stub, GenerateRequest request, const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    std::cerr << "error: cannot read " << path << "\n";
    return 2;
  }
  const nlohmann::json list = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!list.is_array() || list.empty()) {
    std::cerr << "error: " << path
              << " must hold a non-empty JSON list of {\"role\": ..., \"content\": ...}\n";
    return 2;
  }
  for (const nlohmann::json& m : list) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
        !m["content"].is_string()) {
      std::cerr << "error: " << path << ": every message must be {\"role\": string, "
                << "\"content\": string}, got " << m.dump() << "\n";
      return 2;
    }
    AddMessage(request, m["role"].get<std::string>(), m["content"].get<std::string>());
  }
  Result r = RunOne(stub, request, /*print_text=*/true);
  std::cout << "\n";
  if (!r.status.ok()) return ReportFailure(r.status);
  PrintStats(r);
  return 0;
}

// --chat: reads user turns from stdin, streams each reply, keeps the history.
int Chat(Generator::Stub& stub, GenerateRequest request) {
  const bool interactive = isatty(fileno(stdin)) != 0;
  std::string line;
  while (true) {
    if (interactive) std::cout << "> " << std::flush;
    if (!std::getline(std::cin, line) || line.empty() || line == "/exit") break;
    AddMessage(request, "user", line);
    std::string reply;
    Result r = RunOne(stub, request, /*print_text=*/true, &reply);
    std::cout << "\n";
    if (!r.status.ok()) return ReportFailure(r.status);
    if (interactive) PrintStats(r);
    AddMessage(request, "assistant", reply);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  coalesce::ParseFlags(argc, argv,
                       "Streams a generation from a coalesce server.\n"
                       "Usage: coalesce-cli --prompt='Once upon a time' [--concurrency=8] [flags]");
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      coalesce::tools::ClientChannelFromFlags(absl::GetFlag(FLAGS_server));
  if (!channel.ok()) {
    std::cerr << channel.status().message() << "\n";
    return 2;
  }
  auto stub = Generator::NewStub(*channel);
  if (absl::GetFlag(FLAGS_info)) return PrintInfo(*stub);

  GenerateRequest request;
  request.set_prompt(absl::GetFlag(FLAGS_prompt));
  request.set_max_new_tokens(absl::GetFlag(FLAGS_max_new_tokens));
  auto* sampling = request.mutable_sampling();
  sampling->set_temperature(static_cast<float>(absl::GetFlag(FLAGS_temperature)));
  sampling->set_top_k(absl::GetFlag(FLAGS_top_k));
  sampling->set_top_p(static_cast<float>(absl::GetFlag(FLAGS_top_p)));
  if (absl::GetFlag(FLAGS_seed) >= 0) sampling->set_seed(absl::GetFlag(FLAGS_seed));
  for (const std::string& stop : absl::GetFlag(FLAGS_stop)) request.add_stop(stop);
  request.set_n(absl::GetFlag(FLAGS_n));
  if (absl::GetFlag(FLAGS_repetition_penalty) != 1.0) {
    sampling->set_repetition_penalty(static_cast<float>(absl::GetFlag(FLAGS_repetition_penalty)));
  }
  sampling->set_frequency_penalty(static_cast<float>(absl::GetFlag(FLAGS_frequency_penalty)));
  sampling->set_presence_penalty(static_cast<float>(absl::GetFlag(FLAGS_presence_penalty)));
  sampling->set_min_p(static_cast<float>(absl::GetFlag(FLAGS_min_p)));
  sampling->set_min_tokens(absl::GetFlag(FLAGS_min_tokens));
  sampling->set_ignore_eos(absl::GetFlag(FLAGS_ignore_eos));
  for (const std::string& id : absl::GetFlag(FLAGS_stop_token_ids)) {
    int32_t value = 0;
    if (!absl::SimpleAtoi(id, &value)) {
      std::cerr << "--stop_token_ids: \"" << id << "\" is not a token id\n";
      return 2;
    }
    sampling->add_stop_token_ids(value);
  }
  for (const std::string& pair : absl::GetFlag(FLAGS_logit_bias)) {
    const std::vector<std::string> parts = absl::StrSplit(pair, ':');
    int32_t id = 0;
    float bias = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &id) ||
        !absl::SimpleAtof(parts[1], &bias)) {
      std::cerr << "--logit_bias: \"" << pair << "\" is not id:bias\n";
      return 2;
    }
    (*sampling->mutable_logit_bias())[id] = bias;
  }

  if (absl::GetFlag(FLAGS_chat) || !absl::GetFlag(FLAGS_messages).empty()) {
    request.clear_prompt();
    if (!absl::GetFlag(FLAGS_system).empty()) {
      AddMessage(request, "system", absl::GetFlag(FLAGS_system));
    }
    if (absl::GetFlag(FLAGS_chat)) return Chat(*stub, request);
    return SendMessagesFile(*stub, request, absl::GetFlag(FLAGS_messages));
  }

  const int n = std::max(1, absl::GetFlag(FLAGS_concurrency));
  if (n == 1 && !absl::GetFlag(FLAGS_summary) && request.n() > 1) {
    // The samples' messages interleave: each is printed whole at the end.
    Result r = RunOne(*stub, request, /*print_text=*/false);
    if (!r.status.ok()) return ReportFailure(r.status);
    for (const auto& [index, sample] : r.samples) {
      std::cout << absl::StrFormat("--- sample %d (finish %s)\n", index, sample.second)
                << request.prompt() << sample.first << "\n";
    }
    PrintStats(r);
    return 0;
  }
  if (n == 1 && !absl::GetFlag(FLAGS_summary)) {
    std::cout << request.prompt() << std::flush;
    Result r = RunOne(*stub, request, /*print_text=*/true);
    std::cout << "\n";
    if (!r.status.ok()) return ReportFailure(r.status);
    PrintStats(r);
    return 0;
  }

  std::vector<Result> results(n);
  std::vector<std::thread> threads;
  const auto start = Clock::now();
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      GenerateRequest copy = request;
      copy.set_request_id(absl::StrFormat("cli-%d", i));
      results[i] = RunOne(*stub, copy, /*print_text=*/false);
    });
  }
  for (auto& t : threads) t.join();
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();
  int total_tokens = 0;
  int failures = 0;
  for (int i = 0; i < n; ++i) {
    const Result& r = results[i];
    if (!r.status.ok()) {
      ++failures;
      std::cout << absl::StrFormat("request %3d: error %d %s\n", i, r.status.error_code(),
                                   r.status.error_message());
      continue;
    }
    total_tokens += r.tokens;
    std::cout << absl::StrFormat(
        "request %3d: %4d tokens, first token %7.1f ms, total %7.1f ms, finish %s\n", i, r.tokens,
        r.first_token_s * 1e3, r.total_s * 1e3, r.finish_reason);
  }
  std::cout << absl::StrFormat("%d requests, %d failed, %d tokens in %.2f s: %.1f tokens/s\n", n,
                               failures, total_tokens, wall, total_tokens / wall);
  return failures == 0 ? 0 : 1;
}
