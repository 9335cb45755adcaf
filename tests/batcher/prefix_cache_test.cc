// Prefix caching in the engine loop, driven one Tick at a time against a
// backend whose KV cache really carries each sequence's history (KvBackend):
// reuse of cached blocks, exact outputs with caching on and off, salts,
// eviction, preemption, chunked prefill, cancellation, a failed step, and a
// randomized run that checks reference counts and ownership after every step.
#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "batcher/engine_loop.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/batcher/fakes.h"
#include "tests/batcher/kv_loop.h"

namespace coalesce::batcher {
namespace {

using ::testing::ElementsAreArray;

class PrefixCacheTest : public KvLoopTest {};

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

const std::vector<int32_t> kSystem = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};  // 2.5 blocks of 4

TEST_F(PrefixCacheTest, ASharedPrefixIsComputedOnceAndTheOutputIsTheSame) {
  MakeLoop({});
  const auto a_prompt = Concat(kSystem, {11, 12});
  const auto b_prompt = Concat(kSystem, {13});
  StreamUpdate a = Run(Request(a_prompt, 5));
  EXPECT_EQ(a.cached_prompt_tokens, 0);
  const size_t before = backend_->step_tokens().size();
  auto b_sink = Submit(Request(b_prompt, 5));
  Tick();
  // Two full blocks (8 tokens) came from the cache: 3 tokens were computed.
  EXPECT_EQ(StepTokensSince(before), 3);
  RunUntilFinished({b_sink});
  StreamUpdate b = b_sink->WaitFinal();
  EXPECT_EQ(b.cached_prompt_tokens, 8);
  EXPECT_THAT(b_sink->ids(), ElementsAreArray(KvBackend::Expected(b_prompt, 5)));
  EXPECT_EQ(observer_.lookups, 2);
  EXPECT_EQ(observer_.looked_up, 12 + 11);
  EXPECT_EQ(observer_.found, 8);
  EXPECT_EQ(Available(), 32);
}

TEST_F(PrefixCacheTest, APromptEndingOnABlockBoundaryStillComputesItsLastToken) {
  MakeLoop({});
  const std::vector<int32_t> eight(kSystem.begin(), kSystem.begin() + 8);
  Run(Request(eight, 3));
  const size_t before = backend_->step_tokens().size();
  auto sink = Submit(Request(eight, 3));
  Tick();
  // Block 1 holds the last token, which must run to give logits.
  EXPECT_EQ(StepTokensSince(before), 4);
  RunUntilFinished({sink});
  EXPECT_EQ(sink->WaitFinal().cached_prompt_tokens, 4);
  EXPECT_THAT(sink->ids(), ElementsAreArray(KvBackend::Expected(eight, 3)));
}

TEST_F(PrefixCacheTest, ANextTurnReusesTheGeneratedTokensToo) {
  MakeLoop({});
  const auto first = Concat(kSystem, {11});
  auto a = Submit(Request(first, 9));
  RunUntilFinished({a});
  // The conversation so far (prompt + answer: 20 tokens, of which the first
  // 19 went through the model, so 4 whole blocks) plus a new message.
  const auto second = Concat(Concat(first, a->ids()), {12, 13});
  StreamUpdate b = Run(Request(second, 4));
  EXPECT_EQ(b.cached_prompt_tokens, 16);
  auto c = Submit(Request(second, 4));
  RunUntilFinished({c});
  EXPECT_THAT(c->ids(), ElementsAreArray(KvBackend::Expected(second, 4)));
}

TEST_F(PrefixCacheTest, OutputsAreTheSameWithCachingOnAndOff) {
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 12; ++i) {
    prompts.push_back(Concat(std::vector<int32_t>(kSystem.begin(), kSystem.begin() + i % 11),
                             std::vector<int32_t>(1 + i % 5, static_cast<int32_t>(i % 14))));
  }
  std::map<bool, std::vector<std::vector<int32_t>>> outputs;
  for (bool caching : {false, true}) {
    // Chunked prefill (8 tokens a step), a small pool, several at once.
    MakeLoop({.num_blocks = 14, .block_size = 4, .max_batch_size = 3, .max_batch_tokens = 8},
             caching);
    std::vector<std::shared_ptr<Collector>> sinks;
    for (const auto& p : prompts) {
      sinks.push_back(Submit(Request(p, 6)));
      Tick();
    }
    RunUntilFinished(sinks);
    for (auto& s : sinks) outputs[caching].push_back(s->ids());
  }
  EXPECT_EQ(outputs[true], outputs[false]);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_THAT(outputs[true][i], ElementsAreArray(KvBackend::Expected(prompts[i], 6)));
  }
  EXPECT_GT(observer_.found, 0);
}

TEST_F(PrefixCacheTest, DifferentSaltsNeverShare) {
  MakeLoop({});
  Run(Request(kSystem, 2, "tenant-a"));
  EXPECT_EQ(Run(Request(kSystem, 2, "tenant-b")).cached_prompt_tokens, 0);
  EXPECT_EQ(Run(Request(kSystem, 2, "")).cached_prompt_tokens, 0);
  EXPECT_EQ(Run(Request(kSystem, 2, "tenant-a")).cached_prompt_tokens, 8);
  EXPECT_EQ(Run(Request(kSystem, 2, "tenant-b")).cached_prompt_tokens, 8);
}

TEST_F(PrefixCacheTest, CachingOffFindsNothing) {
  MakeLoop({}, /*caching=*/false);
  Run(Request(kSystem, 2));
  EXPECT_EQ(Run(Request(kSystem, 2)).cached_prompt_tokens, 0);
  EXPECT_EQ(observer_.lookups, 0);
  EXPECT_TRUE(loop_->Snapshot().cached_blocks.empty());
}

TEST_F(PrefixCacheTest, UnderPressureCachedBlocksAreEvictedLeastRecentlyUsedFirst) {
  MakeLoop({.num_blocks = 6, .block_size = 4});
  const std::vector<int32_t> x = {1, 1, 1, 1, 2, 2, 2, 2, 3};
  const std::vector<int32_t> y = {4, 4, 4, 4, 5, 5, 5, 5, 6};
  Run(Request(x, 3));  // registers x's 2 full blocks (+ its third, with the answer)
  Run(Request(y, 3));
  Run(Request(x, 3));  // touches x again: y is now the least recently used
  // A request that needs every block evicts what it must, y's first.
  const std::vector<int32_t> z(17, 7);
  StreamUpdate big = Run(Request(z, 3));
  EXPECT_TRUE(big.status.ok());
  EXPECT_GE(loop_->queue_stats().kv_block_evictions, 1);
  EXPECT_EQ(Run(Request(y, 3)).cached_prompt_tokens, 0);
}

TEST_F(PrefixCacheTest, AResumedSequenceFindsItsOwnBlocksButTheyAreNotHits) {
  // Three blocks of 4: A and B grow until B (admitted last) is preempted;
  // B's full blocks stay cached while A runs, and B resumes from them.
  for (bool overlap : {false, true}) {
    SCOPED_TRACE(overlap);
    MakeLoop({.num_blocks = 3, .block_size = 4, .overlap = overlap});
    const std::vector<int32_t> a_prompt = {1};
    const std::vector<int32_t> b_prompt = {2, 3, 4, 5, 6};
    auto a = Submit(Request(a_prompt, 7));
    auto b = Submit(Request(b_prompt, 5));
    RunUntilFinished({a, b});
    EXPECT_GE(observer_.preemptions, 1);
    EXPECT_THAT(a->ids(), ElementsAreArray(KvBackend::Expected(a_prompt, 7)));
    EXPECT_THAT(b->ids(), ElementsAreArray(KvBackend::Expected(b_prompt, 5)));
    EXPECT_EQ(b->WaitFinal().cached_prompt_tokens, 0);
    EXPECT_EQ(observer_.lookups, 2);
    EXPECT_EQ(observer_.found, 0);
    EXPECT_EQ(Available(), 3);
  }
}

TEST_F(PrefixCacheTest, CancelledMidPrefillLeavesOnlyWholeComputedBlocks) {
  MakeLoop({.max_batch_tokens = 6});
  const std::vector<int32_t> prompt(23, 9);
  uint64_t id = 0;
  auto sink = Submit(Request(prompt, 2), &id);
  Tick();  // 6 of 23 tokens: block 0 is whole, block 1 half
  loop_->Cancel(id, absl::CancelledError("bye"));
  Tick();
  ASSERT_TRUE(sink->finished());
  EXPECT_EQ(Available(), 32);
  EXPECT_EQ(loop_->Snapshot().cached_blocks.size(), 1u);
  // The next one with that prompt finds exactly the one whole block.
  StreamUpdate again = Run(Request(prompt, 2));
  EXPECT_EQ(again.cached_prompt_tokens, 4);
}

TEST_F(PrefixCacheTest, AFailedStepForgetsTheCache) {
  MakeLoop({});
  Run(Request(kSystem, 2));
  EXPECT_GT(loop_->queue_stats().cached_kv_blocks, 0);
  backend_->fail_next_ = true;
  StreamUpdate failed = Run(Request({13, 13}, 2));
  EXPECT_EQ(failed.status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(loop_->queue_stats().cached_kv_blocks, 0);
  EXPECT_EQ(Run(Request(kSystem, 2)).cached_prompt_tokens, 0);
  EXPECT_EQ(Available(), 32);
}

TEST_F(PrefixCacheTest, StaticBatchingModesShareToo) {
  for (BatchingMode mode : {BatchingMode::kStatic, BatchingMode::kStaticPadded}) {
    SCOPED_TRACE(BatchingModeName(mode));
    MakeLoop({.mode = mode});
    Run(Request(kSystem, 2));
    auto a = Submit(Request(Concat(kSystem, {3}), 2));
    auto b = Submit(Request(Concat(kSystem, {4}), 6));
    RunUntilFinished({a, b});
    EXPECT_EQ(a->WaitFinal().cached_prompt_tokens, 8);
    EXPECT_EQ(b->WaitFinal().cached_prompt_tokens, 8);
    EXPECT_THAT(b->ids(), ElementsAreArray(KvBackend::Expected(Concat(kSystem, {4}), 6)));
    EXPECT_EQ(Available(), 32);
  }
}

// Random arrivals over a few shared prefixes, salts, priorities, deadlines,
// several samples and cancellations against a small pool with chunked
// prefill, on a backend that copies blocks and one that cannot: after every
// step the holders of each block are exactly what the reference counts say;
// every sample of a request that ends OK produced exactly its solo output; at
// the end every block is available again.
TEST_F(PrefixCacheTest, RandomizedRunKeepsCountsAndOutputsExact) {
  int total_samples_ok = 0;
  for (uint32_t seed = 1; seed <= 16; ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    LoopSetup setup{.num_blocks = 8 + static_cast<int>(rng() % 12),
                    .block_size = 1 + static_cast<int>(rng() % 4),
                    .max_batch_size = 1 + static_cast<int>(rng() % 5),
                    .max_batch_tokens = 6 + static_cast<int>(rng() % 20),
                    .overlap = rng() % 2 == 0,
                    .mode = kBatchingModes[rng() % 3],
                    .copies = rng() % 2 == 0};
    MakeLoop(setup);
    const int capacity = setup.num_blocks * setup.block_size;
    std::vector<std::vector<int32_t>> prefixes;
    for (int i = 0; i < 3; ++i) {
      std::vector<int32_t> p(1 + rng() % 10);
      for (auto& t : p) t = static_cast<int32_t>(rng() % 14);
      prefixes.push_back(p);
    }
    struct Sent {
      std::vector<int32_t> prompt;
      std::shared_ptr<Collector> sink;
      uint64_t id;
      int n;
    };
    std::vector<Sent> sent;
    for (int round = 0; round < 250; ++round) {
      if (rng() % 3 == 0) {
        std::vector<int32_t> prompt = prefixes[rng() % prefixes.size()];
        for (int n = rng() % 4; n > 0; --n) prompt.push_back(static_cast<int32_t>(rng() % 14));
        prompt.resize(std::min<size_t>(prompt.size(), capacity - 1));
        GenerationRequest r = Request(
            prompt, 1 + rng() % std::max<int>(1, std::min<int>(10, capacity - prompt.size())),
            rng() % 5 == 0 ? "salt" : "", static_cast<int>(rng() % 3));
        if (rng() % 5 == 0) r.deadline = clock_.Now() + absl::Milliseconds(rng() % 100);
        if (rng() % 4 == 0) {
          // As many samples as fit the batch, and the pool with the prompt.
          const int prompt_blocks = BlocksForTokens(prompt.size(), setup.block_size);
          r.n = std::min({2 + static_cast<int>(rng() % 3), setup.max_batch_size,
                          setup.num_blocks - prompt_blocks + 1});
        }
        const int n = r.n;
        auto sink = std::make_shared<Collector>(n);
        absl::StatusOr<uint64_t> id = loop_->Submit(std::move(r), sink);
        ASSERT_TRUE(id.ok()) << id.status();
        sent.push_back({prompt, sink, *id, n});
      }
      if (!sent.empty() && rng() % 12 == 0) {
        loop_->Cancel(sent[rng() % sent.size()].id, absl::CancelledError("random"));
      }
      clock_.Advance(absl::Milliseconds(rng() % 5));
      Tick();
      if (HasFatalFailure()) return;
    }
    for (int i = 0; i < 5000 && !std::all_of(sent.begin(), sent.end(),
                                             [](auto& s) { return s.sink->finished(); });
         ++i) {
      clock_.Advance(absl::Milliseconds(1));
      Tick();
      if (HasFatalFailure()) return;
    }
    int ok = 0, samples_ok = 0;
    for (auto& s : sent) {
      ASSERT_TRUE(s.sink->finished());
      for (int i = 0; i < s.n; ++i) {
        StreamUpdate last = s.sink->WaitFinal(i);
        if (!last.status.ok()) continue;
        ++ok;
        samples_ok += s.n > 1 ? 1 : 0;
        const auto ids = s.sink->ids(i);
        EXPECT_THAT(ids, ElementsAreArray(KvBackend::Expected(s.prompt, ids.size())))
            << "sample " << i << " of " << s.n;
        EXPECT_LT(last.cached_prompt_tokens, static_cast<int>(s.prompt.size()));
      }
    }
    EXPECT_GT(ok, 0);
    total_samples_ok += samples_ok;
    EXPECT_EQ(Available(), setup.num_blocks);
  }
  EXPECT_GT(observer_.found, 0);
  EXPECT_GT(total_samples_ok, 0);
}

}  // namespace
}  // namespace coalesce::batcher
