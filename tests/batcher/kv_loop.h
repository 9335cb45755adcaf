// An engine loop over KvBackend (fakes.h), driven one Tick at a time by a
// test, which checks the KV blocks' reference counts and ownership after
// every step.
#pragma once

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "batcher/engine_loop.h"
#include "gtest/gtest.h"
#include "tests/batcher/fakes.h"

namespace coalesce::batcher {

class LookupObserver : public LoopObserver {
 public:
  void OnPreempted() override { ++preemptions; }
  void OnPreemptedForAdmission(std::string_view reason, std::string_view tenant) override {
    if (reason == "tenant_share") ++fairness_preemptions[std::string(tenant)];
    ++admission_preemptions[std::string(reason)];
  }
  void OnPrefixCacheLookup(int prompt_tokens, int cached_tokens) override {
    ++lookups;
    looked_up += prompt_tokens;
    found += cached_tokens;
  }
  void OnFirstToken(absl::Duration, std::string_view) override { ++first_tokens; }
  void OnFinished(const RequestSummary& summary) override {
    ++finished;
    completion_tokens += summary.completion_tokens;
    statuses.push_back(summary.status);
  }
  int preemptions = 0, lookups = 0, looked_up = 0, found = 0;
  int first_tokens = 0, finished = 0, completion_tokens = 0;
  std::vector<std::string> statuses;                 // of the finished requests, in order
  std::map<std::string, int> fairness_preemptions;   // by the victim's tenant
  std::map<std::string, int> admission_preemptions;  // by reason
};

struct LoopSetup {
  int num_blocks = 32;
  int block_size = 4;
  int max_batch_size = 4;
  int max_batch_tokens = 256;
  bool overlap = false;
  BatchingMode mode = BatchingMode::kContinuous;
  bool copies = true;  // the backend copies KV blocks
};

class KvLoopTest : public ::testing::Test {
 protected:
  void MakeLoop(LoopSetup setup, bool caching = true) {
    EngineLoopOptions o;
    o.scheduler.max_batch_size = setup.max_batch_size;
    o.scheduler.batch_window = absl::ZeroDuration();
    o.scheduler.priority_aging = absl::InfiniteDuration();
    o.scheduler.mode = setup.mode;
    o.max_batch_tokens = setup.max_batch_tokens;
    o.overlap_steps = setup.overlap;
    o.kv_cache.prefix_caching = caching;
    o.kv_cache.prefix_cache_namespace = "kv-model";
    loop_.reset();
    backend_ = std::make_unique<KvBackend>(setup.num_blocks, setup.block_size);
    backend_->copies_ = setup.copies;
    observer_ = LookupObserver();
    loop_ = std::make_unique<EngineLoop>(backend_.get(), &tokenizer_, o, &clock_, &observer_);
  }
  GenerationRequest Request(std::vector<int32_t> prompt, int max_new_tokens, std::string salt = "",
                            int priority = 0) {
    GenerationRequest r;
    r.prompt = std::move(prompt);
    r.max_new_tokens = max_new_tokens;
    r.arrival = clock_.Now();
    r.cache_salt = std::move(salt);
    r.priority = priority;
    return r;
  }
  std::shared_ptr<Collector> Submit(GenerationRequest request, uint64_t* id = nullptr) {
    return SubmitCollected(*loop_, std::move(request), id);
  }
  void Tick() {
    loop_->Tick();
    CheckBlocks();
  }
  void RunUntilFinished(const std::vector<std::shared_ptr<Collector>>& sinks, int limit = 2000) {
    for (int i = 0; i < limit; ++i) {
      if (std::all_of(sinks.begin(), sinks.end(), [](auto& s) { return s->finished(); })) return;
      Tick();
    }
    FAIL() << "not finished after " << limit << " ticks";
  }
  // Runs one request alone to its end; its final update.
  StreamUpdate Run(GenerationRequest request) {
    auto sink = Submit(std::move(request));
    RunUntilFinished({sink});
    return sink->WaitFinal();
  }
  // Every block's count of holders is the number of running sequences (and
  // padding rows) whose table names it; the available blocks are exactly the
  // unheld ones, each once; cached blocks are among them.
  void CheckBlocks() {
    const LoopSnapshot s = loop_->Snapshot();
    std::vector<int> holders(s.total_blocks, 0);
    for (const auto& seq : s.running) {
      std::set<int32_t> own(seq.blocks.begin(), seq.blocks.end());
      ASSERT_EQ(own.size(), seq.blocks.size()) << "a sequence holds a block twice";
      for (int32_t id : seq.blocks) ++holders[id];
    }
    ASSERT_EQ(static_cast<int>(s.refs.size()), s.total_blocks);
    for (int id = 0; id < s.total_blocks; ++id) {
      ASSERT_EQ(s.refs[id], holders[id]) << "block " << id;
    }
    std::set<int32_t> available(s.free_blocks.begin(), s.free_blocks.end());
    ASSERT_EQ(available.size(), s.free_blocks.size()) << "a block is available twice";
    for (int id = 0; id < s.total_blocks; ++id) {
      ASSERT_EQ(available.count(id) == 1, holders[id] == 0) << "block " << id;
    }
    for (int32_t id : s.cached_blocks) ASSERT_EQ(available.count(id), 1u);
  }
  int Available() { return static_cast<int>(loop_->Snapshot().free_blocks.size()); }
  int StepTokensSince(size_t from) {
    auto t = backend_->step_tokens();
    int sum = 0;
    for (size_t i = from; i < t.size(); ++i) sum += t[i];
    return sum;
  }

  FakeClock clock_{absl::FromUnixSeconds(1000)};
  LetterTokenizer tokenizer_;
  LookupObserver observer_;
  std::unique_ptr<KvBackend> backend_;
  std::unique_ptr<EngineLoop> loop_;
};

}  // namespace coalesce::batcher
