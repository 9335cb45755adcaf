// coalesce-quant-bench: the CPU engine's matrix products of one decode step,
// by weight type, against the floor of their weight bytes over the memory
// read bandwidth measured in the same run, a probe pass right before each
// timed pass.
//
//   build/bin/coalesce-quant-bench --model=synthetic:110m --rows=1,16
//
// For the model's shape it builds every weight matrix a step multiplies
// (each layer's q, k, v, o, gate, up and down projections, and the
// classifier) in each --types type, float32 (the engine's own product,
// cpu/kernels.h) or a quantized block type (cpu/quant_matmul.h, random
// blocks with small finite scales: the kernels' speed does not depend on the
// values), and times all of them against --rows rows of activations, the
// median of --repeat passes (each after a probe pass), run as the engine runs them: q, k and v in
// one parallel loop, and gate and up in another (cpu/products.h). Attention, norms and sampling are
// left out: at batch 1 and short contexts they are a small part of a step (coalesce-engine-bench
// measures whole steps). Beside them, each type's arithmetic rate: one row against a matrix in
// cache, on one thread (CacheRate), in bytes a second and as a share of the thread's fma peak
// measured beside it (FmaPeakOnce), which moves less from run to run on a shared machine.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/flags.h"
#include "engine/cpu/float_panels.h"
#include "engine/cpu/huge_page_memory.h"
#include "engine/cpu/kernels.h"
#include "engine/cpu/kv_quant.h"
#include "engine/cpu/memory_bandwidth.h"
#include "engine/cpu/products.h"
#include "engine/cpu/quant_int8.h"
#include "engine/cpu/quant_matmul.h"
#include "engine/cpu/thread_pool.h"
#include "engine/model/load.h"
#include "engine/sampler.h"
#include "tools/bench/probe_pairs.h"

ABSL_FLAG(std::string, model, "synthetic:110m",
          "Whose shape: synthetic:NAME, a Hugging Face folder, a GGUF file or a llama2.c "
          "checkpoint (only its shape is used).");
ABSL_FLAG(std::string, types, "fp32,q8_0,q4_0,q4_1,q4_k,q6_k", "Comma-separated weight types.");
ABSL_FLAG(std::string, rows, "1,16", "Comma-separated rows of activations (sequences).");
ABSL_FLAG(int, repeat, 15, "Passes over every matrix per measurement; the median is printed.");
ABSL_FLAG(int, threads, 0, "Threads; 0: one per core.");
ABSL_FLAG(
    bool, int8, true,
    "Also time Q8_0, Q4_0, Q4_1, Q4_K and Q6_K with int8 activations (--int8_activations; rows "
    "TYPE/i8), with AVX512-VNNI where the processor has it, else AVX2.");
ABSL_FLAG(std::string, code_floats, "measured",
          "How the one- and two-row kernels make floats of 4- and 6-bit codes: measured (the "
          "engine's choice, cpu/quant_matmul.h's QuantCodeFloats), converted or subnormal.");

ABSL_FLAG(bool, huge_pages, true,
          "Weights (and the bandwidth probe's buffer) in memory that asks for transparent huge "
          "pages (the engine's way, cpu/huge_page_memory.h); false refuses them.");
ABSL_FLAG(int, quant_tasks_per_thread, 0,
          "Tasks a thread takes of a quantized product of one row (0: the engine's, one).");

namespace coalesce {
namespace {

struct Shape {
  int rows, cols;
  bool with_next = false;  // runs in one loop with the next matrix (same input)
};

// Every matrix one decode step multiplies, [out][in].
std::vector<Shape> StepMatrices(const engine::ModelConfig& c) {
  std::vector<Shape> out;
  for (int l = 0; l < c.n_layers; ++l) {
    for (const Shape s :
         {Shape{c.dim, c.dim, true}, Shape{c.kv_dim(), c.dim, true}, Shape{c.kv_dim(), c.dim},
          Shape{c.dim, c.dim}, Shape{c.hidden_dim, c.dim, true}, Shape{c.hidden_dim, c.dim},
          Shape{c.dim, c.hidden_dim}}) {
      out.push_back(s);
    }
  }
  out.push_back({c.vocab_size, c.dim});
  return out;
}

void PutHalf(uint8_t* p, float value) {
  const uint16_t bits = engine::cpu::ToFp16(value).bits;
  p[0] = static_cast<uint8_t>(bits);
  p[1] = static_cast<uint8_t>(bits >> 8);
}

// rows x cols of random blocks of `type` with small finite scales.
std::vector<uint8_t> RandomBlocks(engine::QuantType type, int rows, int cols, engine::Rng& rng) {
  const int64_t blocks = int64_t{rows} * cols / engine::QuantBlockSize(type);
  const int bytes = engine::QuantBlockBytes(type);
  std::vector<uint8_t> data(static_cast<size_t>(blocks * bytes));
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng.NextU64());
  for (int64_t i = 0; i < blocks; ++i) {
    uint8_t* b = data.data() + i * bytes;
    const float d = (rng.NextFloat() + 0.5f) * 1e-3f;
    switch (type) {
      case engine::QuantType::kQ8_0:
      case engine::QuantType::kQ4_0:
        PutHalf(b, d);
        break;
      case engine::QuantType::kQ4_1:
      case engine::QuantType::kQ4_K:
        PutHalf(b, d);
        PutHalf(b + 2, -d);
        break;
      case engine::QuantType::kQ6_K:
        PutHalf(b + 208, d);
        break;
    }
  }
  return data;
}

// "q4_k" -> kQ4_K.
std::optional<engine::QuantType> TypeNamed(absl::string_view name) {
  for (const engine::QuantType t :
       {engine::QuantType::kQ8_0, engine::QuantType::kQ4_0, engine::QuantType::kQ4_1,
        engine::QuantType::kQ4_K, engine::QuantType::kQ6_K}) {
    if (absl::AsciiStrToLower(engine::QuantTypeName(t)) == name) return t;
  }
  return std::nullopt;
}

struct Result {
  double bytes = 0;
  std::vector<bench::ProbePairs> timings;  // per --rows entry
  double cache_rate = 0;                   // bytes/s: CacheRate
  double peak_share = 0;                   // CacheRate's weights/s over FmaPeakOnce's
};

// Seconds for `rounds` rounds of 12 independent fmas on 8 floats each: more
// chains than an fma's latency times the fmas a cycle (4 x 2 on the AMD
// and Intel cores of these machines), so the loop runs at the thread's fma
// peak. The result goes to `sink`, so that none of it can be left out.
// AVX2 and FMA, as the engine's kernels (the engine is built for
// x86-64-v3; this file is not).
[[gnu::noinline, gnu::target("avx2,fma")]] double FmaLoopSeconds(int rounds, float* sink) {
  constexpr int kChains = 12;
  __m256 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(static_cast<float>(c));
  const __m256 a = _mm256_set1_ps(sink[0]), b = _mm256_set1_ps(sink[1]);
  const absl::Time start = absl::Now();
  for (int r = 0; r < rounds; ++r) {
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  __m256 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, acc[c]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  sink[2] = lanes[0];
  return seconds;
}

// One fma peak run: weights a second, 8 a fma (one fma a weight, as the
// exact numerics' kernels do).
double FmaPeakOnce() {
  constexpr int kRounds = 20000;
  float sink[3] = {0.999f, 0.001f, 0.0f};
  return 12.0 * 8.0 * kRounds / FmaLoopSeconds(kRounds, sink);
}

// Rows of the matrix CacheRate times: with the model's columns, small
// enough for a core's own cache (256 x 768 floats: 768 KiB).
constexpr int kCacheRows = 256;

// The kernel's arithmetic rate: one row of activations against one matrix
// of `bytes` that stays in cache, on one thread (a pool of one runs the
// product on the caller), the fastest of many runs, in weight bytes a
// second (into r.cache_rate). The memory-bound rows above reach their floor
// only where this is well above the memory's bandwidth a thread. And the
// same as a share of the thread's fma peak (r.peak_share), each run of the
// kernel followed by one of FmaPeakOnce, the best of each: on a shared
// machine whose clock moves between runs, the share moves less than the
// rate. The exact numerics' one-row kernels, one fma a weight, reach 100%
// at most; the int8 ones multiply-add bytes, several weights an
// instruction, and can pass it.
template <typename Weights>
void CacheRate(double bytes, int cols, Weights weights, Result& r) {
  engine::cpu::ThreadPool one(1);
  std::vector<float> x(static_cast<size_t>(cols), 0.25f), y(kCacheRows);
  engine::cpu::Int8Rows scratch;
  const engine::cpu::MatmulProduct product{
      .w = weights, .n = kCacheRows, .y = y.data(), .ldy = kCacheRows};
  double best = 1e30, peak = 0;
  for (int run = 0; run < 200; ++run) {
    const absl::Time start = absl::Now();
    for (int i = 0; i < 10; ++i) {
      engine::cpu::MatmulTogether(one, {&product, 1}, x.data(), cols, 1, cols, scratch);
    }
    best = std::min(best, absl::ToDoubleSeconds(absl::Now() - start) / 10);
    peak = std::max(peak, FmaPeakOnce());
  }
  r.cache_rate = bytes / best;
  r.peak_share = double{kCacheRows} * cols / best / peak;
}

// Every matrix of the step against m rows of x, as the engine runs them:
// weights(i) is matrix i's; the products of one loop write one output each
// (y is sized for the three widest).
template <typename Weights>
void Step(engine::cpu::ThreadPool& pool, const std::vector<Shape>& shapes, Weights&& weights,
          const float* x, int m, float* y, int64_t y_stride, engine::cpu::Int8Rows& scratch) {
  std::vector<engine::cpu::MatmulProduct> loop;
  for (size_t i = 0; i < shapes.size(); ++i) {
    loop.push_back({.w = weights(i),
                    .n = shapes[i].rows,
                    .y = y + loop.size() * y_stride,
                    .ldy = shapes[i].rows});
    if (shapes[i].with_next) continue;
    engine::cpu::MatmulTogether(pool, loop, x, shapes[i].cols, m, shapes[i].cols, scratch);
    loop.clear();
  }
}

// --repeat passes after a warm-up, each right after a probe pass
// (probe_pairs.h).
template <typename Fn>
bench::ProbePairs Paired(int repeat, engine::MemoryReadProbe& probe, Fn&& pass) {
  pass();  // warm-up
  return bench::TimeAfterProbePasses(probe, repeat, [&](int) {
    pass();
    return absl::OkStatus();
  });
}

int Run() {
  absl::StatusOr<engine::LoadedModel> loaded =
      engine::LoadModel({.model = absl::GetFlag(FLAGS_model)});
  if (!loaded.ok()) {
    std::fprintf(stderr, "%s\n", std::string(loaded.status().message()).c_str());
    return 1;
  }
  const engine::ModelConfig config = loaded->model->config;
  loaded->model.reset();  // only the shape is needed
  std::vector<int> row_counts;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_rows), ',')) {
    int n;
    if (!absl::SimpleAtoi(s, &n) || n < 1) {
      std::fprintf(stderr, "bad --rows\n");
      return 1;
    }
    row_counts.push_back(n);
  }
  int threads = absl::GetFlag(FLAGS_threads);
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int repeat = std::max(1, absl::GetFlag(FLAGS_repeat));
  const std::string codes = absl::GetFlag(FLAGS_code_floats);
  if (codes == "converted") {
    engine::cpu::SetQuantCodeFloats(engine::cpu::CodeFloats::kConverted);
  } else if (codes == "subnormal") {
    engine::cpu::SetQuantCodeFloats(engine::cpu::CodeFloats::kSubnormal);
  } else if (codes != "measured") {
    std::fprintf(stderr, "bad --code_floats: measured, converted or subnormal\n");
    return 1;
  }
  if (const int tasks = absl::GetFlag(FLAGS_quant_tasks_per_thread); tasks > 0) {
    engine::cpu::SetQuantTasksPerThread(tasks);
  }
  engine::cpu::SetHugePages(absl::GetFlag(FLAGS_huge_pages));
  engine::cpu::ThreadPool pool(threads);
  const std::vector<Shape> shapes = StepMatrices(config);
  int max_cols = 0, max_rows = 0;
  for (const Shape& s : shapes) {
    max_cols = std::max(max_cols, s.cols);
    max_rows = std::max(max_rows, s.rows);
  }
  const int max_m = *std::max_element(row_counts.begin(), row_counts.end());
  engine::Rng rng(7);
  const int64_t y_stride = int64_t{max_m} * max_rows;
  std::vector<float> x(static_cast<size_t>(max_m) * max_cols), y(static_cast<size_t>(3 * y_stride));
  engine::cpu::Int8Rows scratch;
  for (float& v : x) v = rng.NextFloat() - 0.5f;

  std::printf(
      "model %s shape: %zu matrices of a decode step, %.1fM weights; %d threads; codes as %s "
      "floats; a quantized one-row product in %d task(s) a thread\n",
      config.name.c_str(), shapes.size(),
      [&] {
        double n = 0;
        for (const Shape& s : shapes) n += double{1} * s.rows * s.cols;
        return n / 1e6;
      }(),
      threads,
      engine::cpu::QuantCodeFloats() == engine::cpu::CodeFloats::kSubnormal ? "subnormal"
                                                                            : "converted",
      engine::cpu::QuantTasksPerThread(1));
  engine::MemoryReadProbe probe(threads);
  // The probe's buffer is weight memory too: whether the kernel grants its
  // huge pages says what the weights get.
  if (const std::optional<engine::cpu::HugePageUse> use = engine::cpu::ReadHugePageUse();
      use.has_value()) {
    std::printf("huge pages (--huge_pages=%s): %.1f of the probe's %.1f MB in memory\n",
                absl::GetFlag(FLAGS_huge_pages) ? "true" : "false", use->huge_bytes / 1e6,
                use->resident_bytes / 1e6);
  }
  std::vector<std::pair<std::string, Result>> results;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_types), ',')) {
    Result r;
    if (name == "fp32") {
      std::vector<std::vector<float>> w;
      for (const Shape& s : shapes) {
        w.emplace_back(static_cast<size_t>(s.rows) * s.cols);
        for (float& v : w.back()) v = (rng.NextFloat() - 0.5f) * 0.05f;
        r.bytes += 4.0 * s.rows * s.cols;
      }
      for (const int m : row_counts) {
        r.timings.push_back(Paired(repeat, probe, [&] {
          Step(
              pool, shapes, [&](size_t i) { return engine::cpu::MatmulWeights{.f = w[i].data()}; },
              x.data(), m, y.data(), y_stride, scratch);
        }));
      }
      const std::vector<float> cached(static_cast<size_t>(kCacheRows) * shapes[0].cols, 0.01f);
      CacheRate(4.0 * static_cast<double>(cached.size()), shapes[0].cols,
                engine::cpu::MatmulWeights{.f = cached.data()}, r);
      // The same matrices laid out as panels at load (cpu/float_panels.h).
      Result rp;
      rp.bytes = r.bytes;
      {
        std::vector<engine::cpu::FloatPanels> panels;
        for (size_t i = 0; i < shapes.size(); ++i) {
          absl::StatusOr<engine::cpu::FloatPanels> laid =
              engine::cpu::FloatPanels::Pack(w[i].data(), shapes[i].rows, shapes[i].cols);
          if (!laid.ok()) return 1;
          panels.push_back(*std::move(laid));
        }
        w.clear();
        for (const int m : row_counts) {
          rp.timings.push_back(Paired(repeat, probe, [&] {
            Step(
                pool, shapes,
                [&](size_t i) { return engine::cpu::MatmulWeights{.float_panels = &panels[i]}; },
                x.data(), m, y.data(), y_stride, scratch);
          }));
        }
        absl::StatusOr<engine::cpu::FloatPanels> laid =
            engine::cpu::FloatPanels::Pack(cached.data(), kCacheRows, shapes[0].cols);
        if (!laid.ok()) return 1;
        CacheRate(4.0 * static_cast<double>(cached.size()), shapes[0].cols,
                  engine::cpu::MatmulWeights{.float_panels = &*laid}, rp);
      }
      results.emplace_back(std::string(name), std::move(r));
      results.emplace_back("fp32/panels", std::move(rp));
      continue;
    } else {
      const std::optional<engine::QuantType> type = TypeNamed(name);
      if (!type.has_value()) {
        std::fprintf(stderr, "--types: unknown type %s\n", std::string(name).c_str());
        return 1;
      }
      std::vector<engine::cpu::PackedMatrix> w;
      std::vector<engine::cpu::Int8Matrix> w8;  // with --int8, for the types that have it
      const bool int8 = absl::GetFlag(FLAGS_int8) && engine::cpu::Int8DotSupported() &&
                        engine::cpu::Int8DotType(*type);
      Result r8;
      for (const Shape& s : shapes) {
        if (s.cols % engine::QuantBlockSize(*type) != 0) {
          std::fprintf(stderr, "%s: a row of %d is not whole blocks of %d\n",
                       std::string(name).c_str(), s.cols, engine::QuantBlockSize(*type));
          return 1;
        }
        const std::vector<uint8_t> blocks = RandomBlocks(*type, s.rows, s.cols, rng);
        absl::StatusOr<engine::cpu::PackedMatrix> packed = engine::cpu::PackedMatrix::Pack(
            {.type = *type, .rows = s.rows, .cols = s.cols, .data = blocks.data()});
        if (!packed.ok()) {
          std::fprintf(stderr, "%s\n", std::string(packed.status().message()).c_str());
          return 1;
        }
        r.bytes += static_cast<double>(packed->bytes());
        w.push_back(*std::move(packed));
        if (int8) {
          absl::StatusOr<engine::cpu::Int8Matrix> i8 = engine::cpu::Int8Matrix::Pack(
              {.type = *type, .rows = s.rows, .cols = s.cols, .data = blocks.data()});
          if (!i8.ok()) {
            std::fprintf(stderr, "%s\n", std::string(i8.status().message()).c_str());
            return 1;
          }
          r8.bytes += static_cast<double>(i8->bytes());
          w8.push_back(*std::move(i8));
        }
      }
      for (const int m : row_counts) {
        r.timings.push_back(Paired(repeat, probe, [&] {
          Step(
              pool, shapes, [&](size_t i) { return engine::cpu::MatmulWeights{.panels = &w[i]}; },
              x.data(), m, y.data(), y_stride, scratch);
        }));
        if (!int8) continue;
        r8.timings.push_back(Paired(repeat, probe, [&] {
          Step(
              pool, shapes, [&](size_t i) { return engine::cpu::MatmulWeights{.int8 = &w8[i]}; },
              x.data(), m, y.data(), y_stride, scratch);
        }));
      }
      {
        const std::vector<uint8_t> blocks = RandomBlocks(*type, kCacheRows, shapes[0].cols, rng);
        const engine::QuantizedMatrix m{
            .type = *type, .rows = kCacheRows, .cols = shapes[0].cols, .data = blocks.data()};
        absl::StatusOr<engine::cpu::PackedMatrix> packed = engine::cpu::PackedMatrix::Pack(m);
        if (!packed.ok()) return 1;  // the shapes above packed
        CacheRate(static_cast<double>(packed->bytes()), shapes[0].cols,
                  engine::cpu::MatmulWeights{.panels = &*packed}, r);
        if (int8) {
          absl::StatusOr<engine::cpu::Int8Matrix> i8 = engine::cpu::Int8Matrix::Pack(m);
          if (!i8.ok()) return 1;
          CacheRate(static_cast<double>(i8->bytes()), shapes[0].cols,
                    engine::cpu::MatmulWeights{.int8 = &*i8}, r8);
        }
      }
      if (int8) {
        results.emplace_back(std::string(name), std::move(r));
        results.emplace_back(std::string(name) + "/i8", std::move(r8));
        continue;
      }
    }
    results.emplace_back(std::string(name), std::move(r));
  }
  std::vector<double> bandwidths;  // every probe pass
  for (const auto& [name, r] : results) {
    for (const bench::ProbePairs& t : r.timings) {
      bandwidths.insert(bandwidths.end(), t.probe_passes.begin(), t.probe_passes.end());
    }
  }
  std::sort(bandwidths.begin(), bandwidths.end());
  const double bandwidth = bandwidths[bandwidths.size() / 2];
  std::printf(
      "memory read bandwidth, one probe pass before each timed pass: median %.1f GB/s (%.1f to "
      "%.1f), %.1f GB/s a thread; cache GB/s: one row against a %d-row matrix in cache, on one "
      "thread; of fma peak: its weights a second over the thread's, at 8 weights an fma\n",
      bandwidth / 1e9, bandwidths.front() / 1e9, bandwidths.back() / 1e9, bandwidth / threads / 1e9,
      kCacheRows);
  std::printf("%9s %10s %10s", "type", "MB", "floor ms");
  for (const int m : row_counts) std::printf(" %9s%-3d", "ms rows=", m);
  std::printf(" %11s%-3d %8s %10s %11s", "floor/rows=", row_counts[0], "best", "cache GB/s",
              "of fma peak");
  if (!results.empty() && results[0].first == "fp32") std::printf(" %s", "speed vs fp32 by rows");
  std::printf("\n");
  for (const auto& [name, r] : results) {
    // The floor over the first --rows entry's own probe passes (median), and
    // that entry's medians and bests against it.
    const bench::ProbePairs& first = r.timings[0];
    std::printf("%9s %10.1f %10.2f", name.c_str(), r.bytes / 1e6, r.bytes / first.bandwidth * 1e3);
    for (const bench::ProbePairs& t : r.timings) std::printf(" %12.2f", t.seconds * 1e3);
    std::printf(" %13.1f%% %7.1f%% %10.1f %10.1f%%", 100.0 * first.MedianShare(r.bytes),
                100.0 * first.BestShare(r.bytes), r.cache_rate / 1e9, 100.0 * r.peak_share);
    if (results[0].first == "fp32") {
      for (size_t i = 0; i < r.timings.size(); ++i) {
        std::printf(" %.2fx", results[0].second.timings[i].seconds / r.timings[i].seconds);
      }
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace
}  // namespace coalesce

int main(int argc, char** argv) {
  coalesce::ParseFlags(argc, argv,
                       "Times a decode step's matrix products by weight type against the floor of "
                       "their bytes over the measured memory bandwidth.");
  return coalesce::Run();
}
