#include "engine/logits_processor.h"

#include <limits>

namespace coalesce::engine {

LogitsProcessor::LogitsProcessor(LogitsControls controls, std::span<const int32_t> prompt)
    : controls_(std::move(controls)) {
  if (controls_.repetition_penalty != 1.0f) seen_.insert(prompt.begin(), prompt.end());
}

void LogitsProcessor::Accept(int32_t token) {
  if (controls_.repetition_penalty != 1.0f) seen_.insert(token);
  if (controls_.frequency_penalty != 0.0f || controls_.presence_penalty != 0.0f) ++counts_[token];
}

void LogitsProcessor::Apply(std::span<float> logits, std::span<const int32_t> banned) const {
  const auto in_row = [&logits](int32_t id) {
    return id >= 0 && static_cast<size_t>(id) < logits.size();
  };
  for (const auto& [id, bias] : controls_.logit_bias) {
    if (in_row(id)) logits[id] += bias;
  }
  // Each id is changed once and on its own, so the sets' order is irrelevant.
  const float penalty = controls_.repetition_penalty;
  for (const int32_t id : seen_) {
    if (!in_row(id)) continue;
    float& l = logits[id];
    l = l < 0.0f ? l * penalty : l / penalty;
  }
  for (const auto& [id, count] : counts_) {
    if (!in_row(id)) continue;
    float& l = logits[id];
    l -= static_cast<float>(count) * controls_.frequency_penalty;
    l -= controls_.presence_penalty;
  }
  for (const int32_t id : banned) {
    if (in_row(id)) logits[id] = -std::numeric_limits<float>::infinity();
  }
}

}  // namespace coalesce::engine
