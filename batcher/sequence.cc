#include "batcher/sequence.h"

namespace coalesce::batcher {

std::unique_ptr<Sequence> ForkSample(const Sequence& parent, int index, SequenceBlocks kv,
                                     int computed) {
  auto child = std::make_unique<Sequence>(parent.id, parent.request, parent.sink, index);
  child->state = SequenceState::kRunning;
  child->role = SampleRole::kSample;
  child->group = parent.group;
  child->tenant = parent.tenant;
  child->kv = std::move(kv);
  child->num_cached = computed;
  child->cached_prompt_tokens = parent.cached_prompt_tokens;
  child->output.prompt_scored = parent.output.prompt_scored;
  child->output.prompt_logprobs_sent = true;
  child->end_tokens = parent.end_tokens;
  return child;
}

}  // namespace coalesce::batcher
