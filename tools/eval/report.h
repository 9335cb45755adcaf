// What coalesce-eval reports: the results of its three measurements (see
// scoring.h for their definitions), written as a table, as JSON, and the
// progress line. Knows nothing of gRPC.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "tools/eval/scoring.h"

namespace coalesce::eval {

// A server as GetModelInfo describes it.
struct ServerDescription {
  std::string address;
  std::string model;
  std::string backend;
  int context_length = 0;
  int vocab_size = 0;
  int bos_token_id = -1;
};

struct PerplexityReport {
  std::string file;
  int64_t file_bytes = 0;  // the whole file
  int64_t bytes = 0;       // the text scored (the first --max_bytes of it, or all)
  int64_t tokens = 0;      // the text's tokens, BOS included
  int64_t window = 0;
  int64_t stride = 0;
  std::vector<Window> windows;
  std::vector<double> window_nll;  // [windows]: each one's scored tokens' NLL
  PerplexityAccumulator result;    // tokens() == tokens - 1
};

struct ItemReport {
  int line = 0;
  int answer = 0;
  std::vector<ChoiceScore> choices;
  ItemPrediction prediction;
  int truncated_tokens = 0;  // context tokens dropped from its longest prompt
};

struct MultipleChoiceReport {
  std::string file;
  std::vector<ItemReport> items;  // in file order
  AccuracyAccumulator result;
  int64_t truncated_items = 0;  // items whose context lost tokens to fit the window
};

struct PromptReport {
  int line = 0;
  std::vector<int32_t> tokens;        // this server's greedy tokens
  std::vector<int32_t> other_tokens;  // the other server's
  Agreement agreement;
};

struct AgreementReport {
  std::string file;
  ServerDescription other;
  int max_new_tokens = 0;
  std::vector<PromptReport> prompts;  // in file order
  AgreementAccumulator result;
};

struct EvalReport {
  ServerDescription server;
  std::optional<PerplexityReport> perplexity;
  std::optional<MultipleChoiceReport> multiple_choice;
  std::optional<AgreementReport> agreement;
  int64_t requests = 0;  // Generate calls made
  double elapsed_s = 0;
};

// The report as JSON. With per_item: the window plan and each window's NLL,
// every item's choice scores and every prompt's tokens too.
nlohmann::json ToJson(const EvalReport& report, bool per_item);

// The report as Markdown tables with a heading line each.
std::string FormatTable(const EvalReport& report);

// One progress line: "[#####.......]  42% perplexity 11/26 3.1 s" with a
// bar (a terminal), else without it (a log).
std::string ProgressLine(absl::string_view phase, int64_t done, int64_t total, double elapsed_s,
                         bool bar);

}  // namespace coalesce::eval
