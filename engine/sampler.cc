#include "engine/sampler.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "engine/simd.h"

namespace coalesce::engine {
namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

// Lowest id among the largest values; NaN never wins (all NaN: 0). Two
// vector passes: the maximum, then its first position.
int32_t Argmax(std::span<const float> logits) {
  const size_t n = logits.size();
  const float* x = logits.data();
  // _mm256_max_ps(v, acc) returns acc where v is NaN, so NaN is skipped.
  __m256 acc = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  size_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(_mm256_loadu_ps(x + i), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float best = lanes[0];
  for (float v : lanes) best = std::max(v, best);
  for (; i < n; ++i) best = x[i] > best ? x[i] : best;
  for (size_t j = 0; j < n; ++j) {
    if (x[j] == best) return static_cast<int32_t>(j);
  }
  return 0;
}

struct Candidate {
  float p;
  int32_t id;
};
// Descending probability, lowest id first among equals: the order greedy
// uses, so top_k = 1 and a tiny top_p both give the argmax. A strict total
// order, so selecting by it gives the same set as sorting by it.
bool MoreLikely(const Candidate& a, const Candidate& b) {
  return a.p != b.p ? a.p > b.p : a.id < b.id;
}

// Reorders `c` so that its first k elements are the smallest prefix, in
// MoreLikely order, whose mass reaches `target`, and returns k (all of c if
// none does). Quickselect on mass: expected linear time, where sorting a
// flat 32000-token distribution would cost milliseconds.
size_t SelectNucleus(std::vector<Candidate>& c, double target) {
  size_t lo = 0, hi = c.size();
  double before = 0.0;  // mass of c[0, lo), all in the nucleus
  while (lo < hi) {
    // Median-of-three pivot, moved to hi - 1.
    const size_t mid = lo + (hi - lo) / 2;
    if (MoreLikely(c[hi - 1], c[lo])) std::swap(c[hi - 1], c[lo]);
    if (MoreLikely(c[mid], c[lo])) std::swap(c[mid], c[lo]);
    if (MoreLikely(c[hi - 1], c[mid])) std::swap(c[hi - 1], c[mid]);
    std::swap(c[mid], c[hi - 1]);
    const Candidate pivot = c[hi - 1];
    const auto split = std::partition(c.begin() + lo, c.begin() + hi - 1,
                                      [&](const Candidate& x) { return MoreLikely(x, pivot); });
    const size_t m = split - c.begin();
    std::swap(c[m], c[hi - 1]);  // pivot in its sorted place
    double upper = 0.0;
    for (size_t i = lo; i < m; ++i) upper += c[i].p;
    if (before + upper >= target) {
      hi = m;  // the boundary lies among the more likely ones
    } else if (before + upper + c[m].p >= target) {
      return m + 1;
    } else {
      before += upper + c[m].p;
      lo = m + 1;
    }
  }
  return std::max<size_t>(lo, 1);
}

}  // namespace

Rng::Rng(uint64_t seed) {
  uint64_t state = seed;
  for (uint64_t& s : s_) s = SplitMix64(state);
}

uint64_t Rng::NextU64() {
  const uint64_t result = Rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = Rotl(s_[3], 45);
  return result;
}

float Rng::NextFloat() {
  // The top 24 bits: every value is exactly representable and below 1.
  return static_cast<float>(NextU64() >> 40) * 0x1.0p-24f;
}

namespace {

// The sampler proper; draw() is called at most once, and only when the token
// is random.
template <typename Draw>
int32_t SampleImpl(std::span<const float> logits, const SamplingParams& params, Draw draw) {
  const int n = static_cast<int>(logits.size());
  if (n == 0) return 0;
  const int32_t argmax = Argmax(logits);
  const float max_logit = logits[argmax];
  if (!(params.temperature > 0.0f) || !std::isfinite(max_logit)) return argmax;

  // Unnormalised probabilities exp((l - max) / T): the maximum maps to 1, so
  // the sum is at least 1 and nothing overflows. NaN logits get 0.
  std::vector<float> probs(logits.begin(), logits.end());  // [vocab]
  const double sum = simd::ExpShiftedInPlace(probs.data(), n, max_logit, 1.0f / params.temperature);

  const int top_k = params.top_k > 0 ? std::min(params.top_k, n) : n;
  const bool use_top_p = params.top_p < 1.0f;
  // min_p's threshold, against the most likely token's (unnormalised: 1).
  const bool use_min_p = params.min_p > 0.0f;
  const float min_p_cutoff = params.min_p * probs[argmax];
  if (top_k == n && !use_top_p && !use_min_p) {
    // No restriction: walk the vocabulary in id order.
    const double r = draw() * sum;
    double cumulative = 0.0;
    int32_t last_positive = argmax;
    for (int i = 0; i < n; ++i) {
      if (probs[i] <= 0.0f) continue;
      cumulative += probs[i];
      last_positive = i;
      if (r < cumulative) return i;
    }
    return last_positive;  // rounding left r at the very top
  }

  // The candidates that can survive. For top_p alone, run.c's cutoff
  // (1 - top_p) / (n - 1) drops most of a peaked distribution cheaply: a token
  // below it cannot be in the nucleus unless it is the most likely one, since
  // it and everything after it would weigh less than 1 - top_p. Halved to
  // stay clear of rounding.
  std::vector<Candidate> cand;  // [<= vocab]
  if (top_k < n) {
    // A heap of the k best so far, least likely on top: after the first few
    // hundred tokens almost every other one fails the single comparison.
    cand.reserve(top_k);
    for (int i = 0; i < top_k; ++i) cand.push_back({probs[i], i});
    std::make_heap(cand.begin(), cand.end(), MoreLikely);
    for (int i = top_k; i < n; ++i) {
      const Candidate c{probs[i], i};
      if (!MoreLikely(c, cand.front())) continue;
      std::pop_heap(cand.begin(), cand.end(), MoreLikely);
      cand.back() = c;
      std::push_heap(cand.begin(), cand.end(), MoreLikely);
    }
  } else {
    double cutoff = n > 1 ? 0.5 * (1.0 - params.top_p) / (n - 1) * sum : 0.0;
    // A token below min_p survives in no case (a prefix of the order, as
    // the nucleus is: the nucleus of what is left, measured against the
    // whole mass, ends where the nucleus would or earlier).
    if (use_min_p) cutoff = std::max(cutoff, static_cast<double>(min_p_cutoff));
    for (int i = 0; i < n; ++i) {
      if (probs[i] >= cutoff || i == argmax) cand.push_back({probs[i], i});
    }
  }
  double kept_mass = 0.0;
  for (const Candidate& c : cand) kept_mass += c.p;
  size_t keep = cand.size();
  if (use_top_p) {
    // The nucleus is measured within what top_k kept (as Hugging Face and
    // vLLM do: top_k renormalises before top_p looks).
    const double total = top_k < n ? kept_mass : sum;
    keep = SelectNucleus(cand, std::max(params.top_p, 0.0f) * total);
    kept_mass = 0.0;
    for (size_t i = 0; i < keep; ++i) kept_mass += cand[i].p;
  }
  if (use_min_p) {
    // Filter cand[0, keep) in place, keeping its order; the most likely
    // token always stays.
    size_t kept = 0;
    kept_mass = 0.0;
    for (size_t i = 0; i < keep; ++i) {
      if (cand[i].p >= min_p_cutoff || cand[i].id == argmax) {
        kept_mass += cand[i].p;
        cand[kept++] = cand[i];
      }
    }
    keep = kept;
  }
  // Draw within cand[0, keep), in the (deterministic) order selection left.
  const double r = draw() * kept_mass;
  double cumulative = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    cumulative += cand[i].p;
    if (r < cumulative) return cand[i].id;
  }
  return cand[keep - 1].id;
}

}  // namespace

int32_t Sample(std::span<const float> logits, const SamplingParams& params, Rng& rng) {
  return SampleImpl(logits, params, [&rng] { return rng.NextFloat(); });
}

int32_t SampleWithUniform(std::span<const float> logits, const SamplingParams& params,
                          float uniform) {
  return SampleImpl(logits, params, [uniform] { return uniform; });
}

TokenLogprob Logprob(std::span<const float> logits, int32_t token, int top) {
  float max = -std::numeric_limits<float>::infinity();
  for (const float x : logits) max = std::max(max, x);
  double sum = 0.0;
  for (const float x : logits) sum += std::exp(static_cast<double>(x) - max);
  const double log_normalizer = max + std::log(sum);
  auto logprob = [&](int32_t id) {
    return static_cast<float>(static_cast<double>(logits[id]) - log_normalizer);
  };
  TokenLogprob out;
  out.token = token;
  out.logprob = logprob(token);
  if (top > 0) {
    // NaN ranks below everything (a strict weak order); among equals, the
    // lower id first.
    auto key = [&](int32_t id) {
      return std::isnan(logits[id]) ? -std::numeric_limits<float>::infinity() : logits[id];
    };
    auto better = [&](int32_t a, int32_t b) { return key(a) != key(b) ? key(a) > key(b) : a < b; };
    // A heap of the best `top` so far, the worst of them on top: one
    // comparison for most of the vocabulary, no vocabulary-sized buffer.
    const size_t k = std::min<size_t>(top, logits.size());
    std::vector<int32_t> best;
    best.reserve(k);
    for (size_t i = 0; i < logits.size(); ++i) {
      const auto id = static_cast<int32_t>(i);
      if (best.size() < k) {
        best.push_back(id);
        std::push_heap(best.begin(), best.end(), better);
      } else if (better(id, best.front())) {
        std::pop_heap(best.begin(), best.end(), better);
        best.back() = id;
        std::push_heap(best.begin(), best.end(), better);
      }
    }
    std::sort_heap(best.begin(), best.end(), better);  // the best first
    for (const int32_t id : best) out.top.emplace_back(id, logprob(id));
  }
  return out;
}

}  // namespace coalesce::engine
