#include "batcher/step_sampler.h"

#include "common/status_macros.h"

namespace coalesce::batcher {

void StepSampler::Clear(int vocab_size) {
  vocab_ = static_cast<size_t>(vocab_size);
  wants_logits_ = false;
  on_host_ = false;
  specs_.clear();
  chunks_.clear();
}

void StepSampler::Add(const Chunk& chunk) {
  specs_.push_back(chunk.spec);
  chunks_.push_back(chunk);
  wants_logits_ |= chunk.wants_logits || chunk.processor != nullptr;
}

absl::Status StepSampler::Run(engine::Backend& backend, const engine::StepBatch& batch) {
  next_.resize(chunks_.size());
  first_row_.resize(chunks_.size());
  on_host_ = wants_logits_;
  for (const engine::SequenceStep& seq : batch.seqs) on_host_ |= seq.all_logits;
  if (!on_host_) return backend.StepAndSample(batch, specs_, std::span<int32_t>(next_));
  return SampleOnTheHost(backend, batch);
}

absl::Status StepSampler::SampleOnTheHost(engine::Backend& backend,
                                          const engine::StepBatch& batch) {
  logits_.resize(engine::LogitRows(batch) * vocab_);
  RETURN_IF_ERROR(backend.Step(batch, std::span<float>(logits_)));
  size_t row = 0;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    first_row_[i] = row;
    row += batch.seqs[i].all_logits ? batch.seqs[i].num_tokens : 1;
    std::span<const float> logits =
        std::span<const float>(logits_).subspan((row - 1) * vocab_, vocab_);
    if (const Chunk& chunk = chunks_[i]; chunk.processor != nullptr) {
      // A copy: the row itself stays the model's, for log-probabilities.
      scratch_.assign(logits.begin(), logits.end());
      chunk.processor->Apply(scratch_, chunk.banned);
      logits = scratch_;
    }
    next_[i] = engine::SampleWithUniform(logits, specs_[i].params, specs_[i].uniform);
  }
  return absl::OkStatus();
}

std::span<const float> StepSampler::logits(size_t i, int rows) const {
  return std::span<const float>(logits_).subspan(first_row_[i] * vocab_, rows * vocab_);
}

std::span<const float> StepSampler::sampled_row(size_t i, const engine::SequenceStep& seq) const {
  const size_t last = first_row_[i] + (seq.all_logits ? seq.num_tokens - 1 : 0);
  return std::span<const float>(logits_).subspan(last * vocab_, vocab_);
}

}  // namespace coalesce::batcher
