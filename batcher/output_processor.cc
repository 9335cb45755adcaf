#include "batcher/output_processor.h"

#include <algorithm>
#include <utility>

namespace coalesce::batcher {

void OutputProcessor::Begin(const GenerationRequest& request, int32_t last_prompt_token,
                            OutputState& out) const {
  out.text.emplace(*tokenizer_, last_prompt_token, request.stop);
}

void OutputProcessor::ScorePrompt(const GenerationRequest& request, int first,
                                  std::span<const float> rows, OutputState& out) const {
  const size_t vocab = static_cast<size_t>(vocab_size_);
  const std::vector<int32_t>& prompt = request.prompt;
  const int n = static_cast<int>(rows.size() / vocab);
  for (int t = 0; t < n; ++t) {
    // The row after position p scores prompt token p + 1; positions scored
    // before a preemption are not scored again.
    const int p = first + t;
    if (p + 1 >= static_cast<int>(prompt.size())) break;
    if (p != out.prompt_scored) continue;
    out.prompt_logprobs.push_back(
        engine::Logprob(rows.subspan(t * vocab, vocab), prompt[p + 1], request.top_logprobs));
    ++out.prompt_scored;
  }
}

OutputProcessor::Output OutputProcessor::Process(const GenerationRequest& request, int sample,
                                                 int32_t token, int length,
                                                 std::span<const float> logits,
                                                 OutputState& out) const {
  ++out.generated;
  // A stop token's text is not sent, as a stop sequence's is not.
  const bool stop_token = std::find(request.stop_token_ids.begin(), request.stop_token_ids.end(),
                                    token) != request.stop_token_ids.end();
  engine::TextStream::Piece piece;
  if (!stop_token) piece = out.text->Push(token);
  Output result;
  StreamUpdate& update = result.update;
  update.index = sample;
  update.token_ids.push_back(token);
  update.text = std::move(piece.text);
  if (request.logprobs) {
    update.logprobs.push_back(engine::Logprob(logits, token, request.top_logprobs));
  }
  if (request.prompt_logprobs && !out.prompt_logprobs_sent) {
    update.prompt_logprobs = std::move(out.prompt_logprobs);
    out.prompt_logprobs_sent = true;
  }
  const auto eos = tokenizer_->eos_ids();
  if (!request.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end()) {
    result.finish = FinishReason::kEos;
  } else if (stop_token || piece.stopped) {
    result.finish = FinishReason::kStop;
  } else if (out.generated >= request.max_new_tokens || length >= max_seq_len_) {
    result.finish = FinishReason::kLength;
  }
  // Unless a stop sequence ended it, the text the stream still holds goes out.
  if (result.finish.has_value() && !piece.stopped) update.text += out.text->Finish();
  return result;
}

}  // namespace coalesce::batcher
