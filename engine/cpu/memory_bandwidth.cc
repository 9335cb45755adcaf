#include "engine/cpu/memory_bandwidth.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <memory>
#include <vector>

#include "engine/cpu/thread_pool.h"

namespace coalesce::engine {
namespace {

// The probe's loops run without sanitizer checks: under ThreadSanitizer every
// load of 256 MiB, five times over, would be checked, and each server start
// would take seconds; the probe shares no memory with anything else.
#define COALESCE_NO_SANITIZE __attribute__((no_sanitize("address", "thread", "undefined")))

// How far ahead each stream is prefetched (floats).
constexpr size_t kAhead = 512;  // 2 KiB

// Sums [begin, end) as `streams` interleaved streams (the first n floats of
// each of `streams` equal parts, 64 bytes of each in turn), each prefetched
// kAhead floats ahead, into four independent AVX accumulators. One
// sequential stream per core is bound by how many cache-line misses a core
// keeps in flight, and reads well below what the memory delivers
// (coalesce-engine-bench --limits prints both); a decode step reads many
// weight rows at once, with prefetches, as this does.
COALESCE_NO_SANITIZE float SumFloats(const float* begin, const float* end, int streams) {
  const size_t n = static_cast<size_t>(end - begin) / streams / 16 * 16;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  for (size_t i = 0; i < n; i += 16) {
    for (int s = 0; s < streams; ++s) {
      const float* p = begin + s * n + i;
      _mm_prefetch(reinterpret_cast<const char*>(p + kAhead), _MM_HINT_T0);
      acc[s % 4] = _mm256_add_ps(acc[s % 4], _mm256_loadu_ps(p));
      acc[(s + 1) % 4] = _mm256_add_ps(acc[(s + 1) % 4], _mm256_loadu_ps(p + 8));
    }
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes,
                  _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  float sum = 0;
  for (float v : lanes) sum += v;
  return sum;
}

// Writes ones over the buffer, so that its pages are real before the timing.
COALESCE_NO_SANITIZE void FillOnes(float* data, size_t n) {
  for (size_t i = 0; i < n; ++i) data[i] = 1.0f;
}

}  // namespace

MemoryReadProbe::MemoryReadProbe(int threads, int streams, size_t bytes)
    : threads_(std::max(threads, 1)),
      streams_(std::clamp(streams, 1, 64)),
      floats_(std::max<size_t>(bytes / sizeof(float), 1)),
      buffer_(cpu::HugePageMemory::Allocate(floats_ * sizeof(float)).value()),
      pool_(std::make_unique<cpu::ThreadPool>(threads_)) {
  FillOnes(buffer_.as<float>(), floats_);
}

MemoryReadProbe::~MemoryReadProbe() = default;

double MemoryReadProbe::Pass() {
  std::vector<float> sums(threads_);
  const auto start = std::chrono::steady_clock::now();
  pool_->ParallelFor(threads_, [&](int t, int) {
    const size_t begin = floats_ * t / threads_, end = floats_ * (t + 1) / threads_;
    sums[t] = SumFloats(buffer_.as<float>() + begin, buffer_.as<float>() + end, streams_);
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The bytes summed: each thread's streams, whole 64-byte steps.
  size_t bytes = 0;
  for (int t = 0; t < threads_; ++t) {
    const size_t floats = floats_ * (t + 1) / threads_ - floats_ * t / threads_;
    bytes += floats / streams_ / 16 * 16 * streams_ * sizeof(float);
  }
  // The sums keep the reads from being optimised away.
  volatile float sink = 0;
  for (float s : sums) sink = sink + s;
  return bytes / std::max(seconds, 1e-9);
}

double MeasureMemoryReadBandwidth(int threads, int streams) {
  MemoryReadProbe probe(threads, streams);
  double best = 0;
  for (int pass = 0; pass < 5; ++pass) best = std::max(best, probe.Pass());
  return best;
}

}  // namespace coalesce::engine
