// Test doubles for the engine loop: a tokenizer whose tokens are letters, a
// backend whose "model" always predicts the previous token plus one (so every
// expected output is known in advance), and a sink that records a stream.
#pragma once

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "batcher/request.h"
#include "engine/backend.h"
#include "engine/tokenizer/tokenizer.h"
#include "gtest/gtest.h"

namespace coalesce::batcher {

constexpr int kVocab = 16;
constexpr int32_t kEos = 15;

// Token t is the letter 'a' + t; kEos is a control token with no text.
class LetterTokenizer : public engine::Tokenizer {
 public:
  int vocab_size() const override { return kVocab; }
  int32_t bos_id() const override { return 0; }
  std::span<const int32_t> eos_ids() const override { return eos_; }
  std::vector<int32_t> Encode(std::string_view, bool) const override { return {}; }
  std::string TokenBytes(int32_t, int32_t token) const override {
    return token == kEos ? "" : std::string(1, static_cast<char>('a' + token));
  }

 private:
  std::vector<int32_t> eos_ = {kEos};
};

// Predicts (last token of the sequence + 1) mod kVocab. Records the shape of
// every step, and can be told to fail.
class CountingBackend : public engine::Backend {
 public:
  explicit CountingBackend(int num_blocks, int block_size = 4) : kv_{block_size, num_blocks} {
    config_.name = "counting";
    config_.vocab_size = kVocab;
    config_.max_seq_len = 64;
    // A plausible shape, for the loop's KV-bytes arithmetic.
    config_.dim = 8;
    config_.n_layers = 1;
    config_.n_heads = 2;
    config_.n_kv_heads = 2;
  }
  absl::Status Step(const engine::StepBatch& batch, std::span<float> logits) override {
    in_step_ = true;
    absl::Cleanup leaving = [this] { in_step_ = false; };
    if (fail_next_) {
      fail_next_ = false;
      return absl::Status(fail_code_, "injected failure");
    }
    {
      absl::MutexLock lock(&mu_);
      batch_sizes_.push_back(static_cast<int>(batch.seqs.size()));
      step_tokens_.push_back(static_cast<int>(batch.tokens.size()));
    }
    std::fill(logits.begin(), logits.end(), 0.0f);
    size_t offset = 0;
    for (size_t i = 0; i < batch.seqs.size(); ++i) {
      const auto& seq = batch.seqs[i];
      // The block table must cover every position this step writes.
      EXPECT_GE(static_cast<int>(seq.block_table.size()) * kv_.block_size,
                seq.start_pos + seq.num_tokens);
      offset += seq.num_tokens;
      const int32_t last = batch.tokens[offset - 1];
      logits[i * kVocab + (last + 1) % kVocab] = 10.0f;
    }
    if (step_delay_ > absl::ZeroDuration()) absl::SleepFor(step_delay_);
    return absl::OkStatus();
  }
  const engine::ModelConfig& config() const override { return config_; }
  const engine::KvCacheConfig& kv_cache() const override { return kv_; }
  std::string_view name() const override { return "counting"; }

  std::vector<int> batch_sizes() {
    absl::MutexLock lock(&mu_);
    return batch_sizes_;
  }
  std::vector<int> step_tokens() {
    absl::MutexLock lock(&mu_);
    return step_tokens_;
  }
  // The next step fails with fail_code_ (engine::kDeviceLostCode: the
  // device is gone), then steps work again.
  std::atomic<bool> fail_next_{false};
  std::atomic<absl::StatusCode> fail_code_{absl::StatusCode::kInternal};
  absl::Duration step_delay_ = absl::ZeroDuration();
  // True while a step runs (on whichever thread runs it).
  bool in_step() const { return in_step_; }

 private:
  std::atomic<bool> in_step_{false};
  engine::ModelConfig config_;
  engine::KvCacheConfig kv_;
  absl::Mutex mu_;
  std::vector<int> batch_sizes_ ABSL_GUARDED_BY(mu_);
  std::vector<int> step_tokens_ ABSL_GUARDED_BY(mu_);
};

// A backend with a real paged KV cache holding one number per position: the
// number at a position mixes the token there with the number at the position
// before, so it stands for everything up to it, as K and V do, and it can
// only be right if every block a sequence reads holds that sequence's own
// history. The next token follows from the last position's number (never
// kEos): its logit is `top_logit`, every other one 0, so sampling at a
// temperature can pick others. Every step is checked with
// engine::ValidateStep, and reading a position nobody wrote fails the test.
// It copies blocks (CopyBlocks) unless told it cannot.
class KvBackend : public engine::Backend {
 public:
  KvBackend(int num_blocks, int block_size)
      : kv_{block_size, num_blocks}, cells_(static_cast<size_t>(num_blocks) * block_size, 0) {
    config_.name = "kv";
    config_.vocab_size = kVocab;
    config_.max_seq_len = 1 << 12;
    config_.dim = 8;
    config_.n_layers = 1;
    config_.n_heads = 2;
    config_.n_kv_heads = 2;
  }
  // The number at a position from the one before it (0 before position 0).
  static uint64_t Mix(uint64_t before, int32_t token) {
    uint64_t z = before + 0x9e3779b97f4a7c15ULL * (static_cast<uint64_t>(token) + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return (z ^ (z >> 31)) | 1;  // never 0, which marks an unwritten cell
  }
  static int32_t Next(uint64_t number) { return static_cast<int32_t>((number >> 11) % kEos); }
  // What a sequence that starts with `prompt` generates, computed directly.
  static std::vector<int32_t> Expected(std::vector<int32_t> prompt, int n) {
    uint64_t number = 0;
    for (int32_t t : prompt) number = Mix(number, t);
    std::vector<int32_t> out;
    for (int i = 0; i < n; ++i) {
      out.push_back(Next(number));
      number = Mix(number, out.back());
    }
    return out;
  }

  absl::Status Step(const engine::StepBatch& batch, std::span<float> logits) override {
    EXPECT_TRUE(engine::ValidateStep(config_, kv_, batch, owner_).ok());
    if (fail_next_) {
      fail_next_ = false;
      return absl::InternalError("injected failure");
    }
    {
      absl::MutexLock lock(&mu_);
      step_tokens_.push_back(static_cast<int>(batch.tokens.size()));
    }
    size_t offset = 0, row = 0;
    for (size_t i = 0; i < batch.seqs.size(); ++i) {
      const auto& seq = batch.seqs[i];
      uint64_t number = 0;
      for (int t = 0; t < seq.num_tokens; ++t) {
        const int pos = seq.start_pos + t;
        if (pos > 0) {
          number = cells_[Cell(seq, pos - 1)];
          EXPECT_NE(number, 0u) << "position " << pos - 1 << " was never written";
        }
        number = Mix(number, batch.tokens[offset + t]);
        cells_[Cell(seq, pos)] = number;
        if (seq.all_logits || t == seq.num_tokens - 1) {
          const std::vector<float> r = Row(number);
          std::copy(r.begin(), r.end(), logits.begin() + row++ * kVocab);
        }
      }
      offset += seq.num_tokens;
    }
    return absl::OkStatus();
  }
  // The logits after a position holding `number`.
  std::vector<float> Row(uint64_t number) const {
    std::vector<float> row(kVocab, 0.0f);
    row[Next(number)] = top_logit_;
    if (never_eos_) row[kEos] = -1e9f;
    return row;
  }
  // The number at each position of `tokens`.
  static std::vector<uint64_t> Numbers(const std::vector<int32_t>& tokens) {
    std::vector<uint64_t> out;
    uint64_t number = 0;
    for (int32_t t : tokens) out.push_back(number = Mix(number, t));
    return out;
  }
  absl::Status CopyBlocks(std::span<const engine::BlockCopy> copies) override {
    if (!copies_) return Backend::CopyBlocks(copies);
    if (absl::Status s = engine::ValidateBlockCopies(kv_, copies); !s.ok()) return s;
    for (const engine::BlockCopy& c : copies) {
      std::copy_n(&cells_[static_cast<size_t>(c.from) * kv_.block_size], kv_.block_size,
                  &cells_[static_cast<size_t>(c.to) * kv_.block_size]);
    }
    copied_ += static_cast<int>(copies.size());
    return absl::OkStatus();
  }
  engine::BackendCapabilities capabilities() const override {
    return {.copies_blocks = copies_, .all_logits = true, .samples_on_host = true};
  }
  const engine::ModelConfig& config() const override { return config_; }
  const engine::KvCacheConfig& kv_cache() const override { return kv_; }
  std::string_view name() const override { return "kv"; }
  bool copies_ = true;       // set before the loop is made: it asks once
  float top_logit_ = 10.0f;  // the predicted token's logit
  bool never_eos_ = false;   // sampling never picks kEos
  int copied_ = 0;           // blocks copied
  std::vector<int> step_tokens() {
    absl::MutexLock lock(&mu_);
    return step_tokens_;
  }
  std::atomic<bool> fail_next_{false};

 private:
  size_t Cell(const engine::SequenceStep& seq, int pos) const {
    return static_cast<size_t>(seq.block_table[pos / kv_.block_size]) * kv_.block_size +
           pos % kv_.block_size;
  }
  engine::ModelConfig config_;
  engine::KvCacheConfig kv_;
  std::vector<uint64_t> cells_;
  std::vector<int32_t> owner_;
  absl::Mutex mu_;
  std::vector<int> step_tokens_ ABSL_GUARDED_BY(mu_);
};

// Collects one request's updates, for each of its samples.
class Collector : public OutputSink {
 public:
  explicit Collector(int samples = 1) : streams_(samples) {}
  void Deliver(StreamUpdate update) override {
    absl::MutexLock lock(&mu_);
    ASSERT_GE(update.index, 0);
    ASSERT_LT(update.index, static_cast<int>(streams_.size()));
    Stream& stream = streams_[update.index];
    EXPECT_FALSE(stream.final.has_value()) << "update after the final one";
    for (int32_t id : update.token_ids) stream.ids.push_back(id);
    stream.text += update.text;
    stream.logprobs.insert(stream.logprobs.end(), update.logprobs.begin(), update.logprobs.end());
    if (!update.prompt_logprobs.empty()) {
      ++prompt_logprob_updates_;
      stream.prompt_logprobs = update.prompt_logprobs;
    }
    ++updates_;
    if (update.finished) {
      ++finals_;
      stream.final = std::move(update);
    }
  }
  // Sample `index`'s final update, once every sample has one.
  StreamUpdate WaitFinal(int index = 0) {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &Collector::AllFinal));
    return *streams_[index].final;
  }
  // The final update, or nothing if not every sample's came within `timeout`.
  std::optional<StreamUpdate> WaitFinalFor(absl::Duration timeout, int index = 0) {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithTimeout(absl::Condition(this, &Collector::AllFinal), timeout)) {
      return std::nullopt;
    }
    return streams_[index].final;
  }
  // Every sample has its final update.
  bool finished() {
    absl::MutexLock lock(&mu_);
    return AllFinal();
  }
  std::vector<int32_t> ids(int index = 0) {
    absl::MutexLock lock(&mu_);
    return streams_[index].ids;
  }
  std::string text(int index = 0) {
    absl::MutexLock lock(&mu_);
    return streams_[index].text;
  }
  int updates() {
    absl::MutexLock lock(&mu_);
    return updates_;
  }
  std::vector<engine::TokenLogprob> logprobs(int index = 0) {
    absl::MutexLock lock(&mu_);
    return streams_[index].logprobs;
  }
  std::vector<engine::TokenLogprob> prompt_logprobs(int index = 0) {
    absl::MutexLock lock(&mu_);
    return streams_[index].prompt_logprobs;
  }
  // Updates that carried prompt log-probabilities, over every sample.
  int prompt_logprob_updates() {
    absl::MutexLock lock(&mu_);
    return prompt_logprob_updates_;
  }
  // Waits until `n` updates have come, or every final one.
  void WaitUpdates(int n) {
    absl::MutexLock lock(&mu_);
    wanted_ = n;
    mu_.Await(absl::Condition(this, &Collector::HasWanted));
  }

 private:
  struct Stream {
    std::vector<int32_t> ids;
    std::string text;
    std::vector<engine::TokenLogprob> logprobs;
    std::vector<engine::TokenLogprob> prompt_logprobs;
    std::optional<StreamUpdate> final;
  };
  bool AllFinal() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return finals_ == static_cast<int>(streams_.size());
  }
  bool HasWanted() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return updates_ >= wanted_ || AllFinal();
  }

  absl::Mutex mu_;
  std::vector<Stream> streams_ ABSL_GUARDED_BY(mu_);
  int updates_ ABSL_GUARDED_BY(mu_) = 0;
  int finals_ ABSL_GUARDED_BY(mu_) = 0;
  int prompt_logprob_updates_ ABSL_GUARDED_BY(mu_) = 0;
  int wanted_ ABSL_GUARDED_BY(mu_) = 0;
};

// Submits `request` to `loop` (an EngineLoop) with a new Collector as its
// sink, expecting it to be taken; its id goes to `id` when given.
template <typename Loop>
std::shared_ptr<Collector> SubmitCollected(Loop& loop, GenerationRequest request,
                                           uint64_t* id = nullptr) {
  auto sink = std::make_shared<Collector>(request.n);
  absl::StatusOr<uint64_t> submitted = loop.Submit(std::move(request), sink);
  EXPECT_TRUE(submitted.ok()) << submitted.status();
  if (id != nullptr && submitted.ok()) *id = *submitted;
  return sink;
}

}  // namespace coalesce::batcher
