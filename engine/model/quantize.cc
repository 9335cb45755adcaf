#include "engine/model/quantize.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/model/gguf_quant.h"

namespace coalesce::engine {
namespace {

// The quantized bytes, with the model they were made from (whose spans the
// result still uses for its norms and biases).
struct QuantizedStorage {
  std::shared_ptr<const void> base;
  std::unique_ptr<uint8_t[]> bytes;
};

struct Job {
  std::span<const float> from;
  int64_t rows = 0, cols = 0;
  QuantizedMatrix* to = nullptr;  // its data set once the buffer exists
  std::span<const float>* span = nullptr;
  int64_t offset = 0;  // into the byte buffer
  std::string name;
};

}  // namespace

absl::StatusOr<std::optional<QuantType>> ParseQuantizeFlag(const std::string& text) {
  if (text == "none") return std::nullopt;
  if (text == "q8_0") return QuantType::kQ8_0;
  if (text == "q4_0") return QuantType::kQ4_0;
  return absl::InvalidArgumentError(
      absl::StrCat("--quantize=", text, ": expected none, q8_0 or q4_0"));
}

absl::StatusOr<std::shared_ptr<const Model>> QuantizeModel(std::shared_ptr<const Model> model,
                                                           QuantType type, QuantizeReport* report) {
  GgmlType ggml;
  switch (type) {
    case QuantType::kQ8_0:
      ggml = GgmlType::kQ8_0;
      break;
    case QuantType::kQ4_0:
      ggml = GgmlType::kQ4_0;
      break;
    case QuantType::kQ4_1:
      ggml = GgmlType::kQ4_1;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("quantizing to ", QuantTypeName(type), " is not supported"));
  }
  auto out = std::make_shared<Model>(*model);
  ModelWeights& w = out->weights;
  const ModelConfig& c = out->config;
  const bool tied = w.classifier.data() == w.token_embedding.data();
  QuantizeReport stats;
  std::vector<Job> jobs;
  int64_t total = 0;
  auto plan = [&](std::span<const float>& span, QuantizedMatrix& q, int64_t rows, int64_t cols,
                  std::string name) {
    if (span.empty() || !q.empty()) return;  // already quantized
    if (cols % QuantBlockSize(type) != 0) {
      ++stats.kept_float;
      return;
    }
    q = {.type = type, .rows = rows, .cols = cols};
    jobs.push_back({span, rows, cols, &q, &span, total, std::move(name)});
    total += q.row_bytes() * rows;
  };
  const int64_t d = c.dim, h = c.hidden_dim, kv = c.kv_dim(), v = c.vocab_size;
  plan(w.token_embedding, w.quantized_token_embedding, v, d, "token embedding");
  if (!tied) plan(w.classifier, w.quantized_classifier, v, d, "classifier");
  for (size_t l = 0; l < w.layers.size(); ++l) {
    LayerWeights& lw = w.layers[l];
    LayerWeights::Quantized& q = lw.quantized;
    const std::string b = absl::StrCat("layer ", l, " ");
    plan(lw.wq, q.wq, d, d, b + "wq");
    plan(lw.wk, q.wk, kv, d, b + "wk");
    plan(lw.wv, q.wv, kv, d, b + "wv");
    plan(lw.wo, q.wo, d, d, b + "wo");
    plan(lw.w1, q.w1, h, d, b + "w1");
    plan(lw.w2, q.w2, d, h, b + "w2");
    plan(lw.w3, q.w3, h, d, b + "w3");
  }
  auto storage = std::make_shared<QuantizedStorage>();
  storage->base = model->storage;
  storage->bytes.reset(new (std::nothrow) uint8_t[std::max<int64_t>(total, 1)]);
  if (storage->bytes == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", total, " bytes for the quantized weights"));
  }
  // Jobs of about a million weights, whole rows, over the cores.
  struct Part {
    const Job* job;
    int64_t row_begin, row_end;
  };
  std::vector<Part> parts;
  for (const Job& job : jobs) {
    const int64_t step = std::max<int64_t>(1, (int64_t{1} << 20) / job.cols);
    for (int64_t r = 0; r < job.rows; r += step) {
      parts.push_back({&job, r, std::min(job.rows, r + step)});
    }
  }
  std::atomic<size_t> next{0};
  std::mutex mu;
  absl::Status status;
  auto work = [&] {
    for (size_t i = next++; i < parts.size(); i = next++) {
      const Part& p = parts[i];
      const int64_t row_bytes = p.job->to->row_bytes();
      absl::Status st =
          QuantizeFromFloat(ggml, p.job->from.data() + p.row_begin * p.job->cols,
                            (p.row_end - p.row_begin) * p.job->cols,
                            storage->bytes.get() + p.job->offset + p.row_begin * row_bytes);
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (status.ok()) {
          status = absl::InvalidArgumentError(
              absl::StrCat("cannot quantize the ", p.job->name, " of ", c.name, " to ",
                           QuantTypeName(type), ": ", st.message()));
        }
      }
    }
  };
  const int threads = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 32u));
  std::vector<std::thread> pool;
  for (int i = 1; i < std::min<int>(threads, static_cast<int>(parts.size())); ++i) {
    pool.emplace_back(work);
  }
  work();
  for (std::thread& t : pool) t.join();
  if (!status.ok()) return status;
  for (Job& job : jobs) {
    job.to->data = storage->bytes.get() + job.offset;
    *job.span = {};
    ++stats.matrices;
    stats.float_bytes += job.rows * job.cols * static_cast<int64_t>(sizeof(float));
  }
  stats.quantized_bytes = total;
  if (tied) {
    w.classifier = w.token_embedding;
    w.quantized_classifier = w.quantized_token_embedding;
  }
  out->storage = storage;
  if (report != nullptr) *report = stats;
  return std::shared_ptr<const Model>(std::move(out));
}

}  // namespace coalesce::engine
