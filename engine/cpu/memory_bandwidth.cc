#include "engine/cpu/memory_bandwidth.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <thread>
#include <vector>

namespace coalesce::engine {
namespace {

// Sums [begin, end) with four independent AVX accumulators, so the loop is
// bound by loads, not by the add latency.
float SumFloats(const float* begin, const float* end) {
  __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
  for (const float* p = begin; p + 32 <= end; p += 32) {
    a = _mm256_add_ps(a, _mm256_loadu_ps(p));
    b = _mm256_add_ps(b, _mm256_loadu_ps(p + 8));
    c = _mm256_add_ps(c, _mm256_loadu_ps(p + 16));
    d = _mm256_add_ps(d, _mm256_loadu_ps(p + 24));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
  float sum = 0;
  for (float v : lanes) sum += v;
  return sum;
}

}  // namespace

double MeasureMemoryReadBandwidth(int threads) {
  threads = std::max(threads, 1);
  constexpr size_t kFloats = size_t{64} << 20;  // 256 MiB: far beyond any cache
  std::vector<float> buffer(kFloats, 1.0f);     // written once, so pages are real
  std::vector<float> sums(threads);
  double best = 0;
  for (int pass = 0; pass < 3; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        const size_t begin = kFloats * t / threads, end = kFloats * (t + 1) / threads;
        sums[t] = SumFloats(buffer.data() + begin, buffer.data() + end);
      });
    }
    for (auto& w : workers) w.join();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, kFloats * sizeof(float) / seconds);
  }
  // The sums keep the reads from being optimised away.
  volatile float sink = 0;
  for (float s : sums) sink = sink + s;
  return best;
}

}  // namespace coalesce::engine
