#include "tools/eval/report.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace coalesce::eval {

namespace {

nlohmann::json ServerJson(const ServerDescription& s) {
  return {{"address", s.address},       {"model", s.model},
          {"backend", s.backend},       {"context_length", s.context_length},
          {"vocab_size", s.vocab_size}, {"bos_token_id", s.bos_token_id}};
}

nlohmann::json MetricJson(const AccuracyAccumulator::Metric& m) {
  return {{"correct", m.correct}, {"accuracy", m.accuracy}, {"stderr", m.stderr_}};
}

template <typename T>
nlohmann::json OptionalJson(const std::optional<T>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

}  // namespace

nlohmann::json ToJson(const EvalReport& report, bool per_item) {
  nlohmann::json out = {{"server", ServerJson(report.server)},
                        {"requests", report.requests},
                        {"elapsed_s", report.elapsed_s}};
  if (report.perplexity) {
    const PerplexityReport& p = *report.perplexity;
    nlohmann::json j = {{"file", p.file},
                        {"file_bytes", p.file_bytes},
                        {"bytes", p.bytes},
                        {"tokens", p.tokens},
                        {"scored_tokens", p.result.tokens()},
                        {"window", p.window},
                        {"stride", p.stride},
                        {"windows", p.windows.size()},
                        {"nll", p.result.nll()},
                        {"mean_nll", p.result.mean_nll()},
                        {"perplexity", p.result.perplexity()},
                        {"bits_per_byte", p.result.bits_per_byte(p.bytes)}};
    if (per_item) {
      nlohmann::json plan = nlohmann::json::array();
      for (const Window& w : p.windows) plan.push_back({w.begin, w.end, w.score_begin});
      j["window_plan"] = std::move(plan);  // [begin, end, score_begin]
      j["window_nll"] = p.window_nll;
    }
    out["perplexity"] = std::move(j);
  }
  if (report.multiple_choice) {
    const MultipleChoiceReport& mc = *report.multiple_choice;
    nlohmann::json j = {{"file", mc.file},
                        {"items", mc.result.items()},
                        {"acc", MetricJson(mc.result.acc())},
                        {"acc_norm", MetricJson(mc.result.acc_norm())},
                        {"acc_per_token", MetricJson(mc.result.acc_per_token())},
                        {"truncated_items", mc.truncated_items}};
    if (per_item) {
      nlohmann::json items = nlohmann::json::array();
      for (const ItemReport& item : mc.items) {
        nlohmann::json choices = nlohmann::json::array();
        for (const ChoiceScore& c : item.choices) {
          choices.push_back({{"logprob", c.logprob}, {"tokens", c.tokens}, {"bytes", c.bytes}});
        }
        items.push_back({{"line", item.line},
                         {"answer", item.answer},
                         {"prediction", item.prediction.by_sum},
                         {"prediction_norm", item.prediction.by_byte},
                         {"prediction_per_token", item.prediction.by_token},
                         {"truncated_tokens", item.truncated_tokens},
                         {"choices", std::move(choices)}});
      }
      j["per_item"] = std::move(items);
    }
    out["multiple_choice"] = std::move(j);
  }
  if (report.agreement) {
    const AgreementReport& a = *report.agreement;
    nlohmann::json j = {{"file", a.file},
                        {"other", ServerJson(a.other)},
                        {"max_new_tokens", a.max_new_tokens},
                        {"prompts", a.result.prompts()},
                        {"compared_tokens", a.result.compared()},
                        {"identical_tokens", a.result.identical()},
                        {"token_share", a.result.token_share()},
                        {"identical_prompts", a.result.identical_prompts()},
                        {"parted_prompts", a.result.parted_prompts()},
                        {"earliest_parting", OptionalJson(a.result.earliest_parting())},
                        {"mean_first_parting", OptionalJson(a.result.mean_first_parting())}};
    if (per_item) {
      nlohmann::json prompts = nlohmann::json::array();
      for (const PromptReport& p : a.prompts) {
        prompts.push_back({{"line", p.line},
                           {"tokens", p.tokens},
                           {"other_tokens", p.other_tokens},
                           {"identical", p.agreement.identical},
                           {"compared", p.agreement.compared},
                           {"first_parting", OptionalJson(p.agreement.first_parting)}});
      }
      j["per_prompt"] = std::move(prompts);
    }
    out["agreement"] = std::move(j);
  }
  return out;
}

std::string FormatTable(const EvalReport& report) {
  const ServerDescription& s = report.server;
  std::string out = absl::StrFormat("%s at %s (%s backend, vocabulary %d, context %d)\n", s.model,
                                    s.address, s.backend, s.vocab_size, s.context_length);
  if (report.perplexity) {
    const PerplexityReport& p = *report.perplexity;
    absl::StrAppendFormat(&out, "\nperplexity of %s (%d of its %d bytes)\n\n", p.file, p.bytes,
                          p.file_bytes);
    out += "| tokens | scored | windows | window | stride | mean NLL | perplexity | bits/byte |\n";
    out += "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n";
    absl::StrAppendFormat(&out, "| %d | %d | %d | %d | %d | %.4f | %.4f | %.4f |\n", p.tokens,
                          p.result.tokens(), p.windows.size(), p.window, p.stride,
                          p.result.mean_nll(), p.result.perplexity(),
                          p.result.bits_per_byte(p.bytes));
  }
  if (report.multiple_choice) {
    const MultipleChoiceReport& mc = *report.multiple_choice;
    absl::StrAppendFormat(&out, "\nmultiple choice: %s (%d items", mc.file, mc.result.items());
    if (mc.truncated_items > 0) {
      absl::StrAppendFormat(&out, ", %d with their context cut to fit", mc.truncated_items);
    }
    out += ")\n\n| score | correct | accuracy | stderr |\n| --- | ---: | ---: | ---: |\n";
    const auto row = [&](const char* name, const AccuracyAccumulator::Metric& m) {
      absl::StrAppendFormat(&out, "| %s | %d | %.4f | %.4f |\n", name, m.correct, m.accuracy,
                            m.stderr_);
    };
    row("acc (sum of log-probabilities)", mc.result.acc());
    row("acc_norm (per byte)", mc.result.acc_norm());
    row("acc_per_token (per token)", mc.result.acc_per_token());
  }
  if (report.agreement) {
    const AgreementReport& a = *report.agreement;
    absl::StrAppendFormat(&out,
                          "\ngreedy agreement with %s on %s at %s: %s (%d prompts, at most %d "
                          "new tokens)\n\n",
                          a.other.model, a.other.backend, a.other.address, a.file,
                          a.result.prompts(), a.max_new_tokens);
    out +=
        "| identical tokens | share | identical prompts | earliest parting | mean first "
        "parting |\n| ---: | ---: | ---: | ---: | ---: |\n";
    const std::optional<int64_t> earliest = a.result.earliest_parting();
    const std::optional<double> mean = a.result.mean_first_parting();
    absl::StrAppendFormat(&out, "| %d of %d | %.4f | %d of %d | %s | %s |\n", a.result.identical(),
                          a.result.compared(), a.result.token_share(), a.result.identical_prompts(),
                          a.result.prompts(), earliest ? absl::StrCat(*earliest) : "none",
                          mean ? absl::StrFormat("%.1f", *mean) : "none");
  }
  absl::StrAppendFormat(&out, "\n%d requests in %.1f s\n", report.requests, report.elapsed_s);
  return out;
}

std::string ProgressLine(absl::string_view phase, int64_t done, int64_t total, double elapsed_s,
                         bool bar) {
  const double fraction =
      total <= 0 ? 1.0
                 : std::clamp(static_cast<double>(done) / static_cast<double>(total), 0.0, 1.0);
  std::string line =
      absl::StrFormat("%3.0f%% %s %d/%d %.1f s", fraction * 100, phase, done, total, elapsed_s);
  if (!bar) return line;
  constexpr int kWidth = 24;
  const int filled = static_cast<int>(fraction * kWidth);
  return absl::StrCat("[", std::string(filled, '#'), std::string(kWidth - filled, '.'), "] ", line);
}

}  // namespace coalesce::eval
