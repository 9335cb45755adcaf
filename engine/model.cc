#include "engine/model.h"

#include <cmath>
#include <cstdint>
#include <numbers>
#include <vector>

namespace coalesce::engine {

int64_t ModelConfig::num_parameters() const {
  const int64_t d = dim, h = hidden_dim, kv = kv_dim(), v = vocab_size;
  const int64_t per_layer = 2 * d         // attention and FFN norms
                            + d * d       // wq
                            + 2 * kv * d  // wk, wv
                            + d * d       // wo
                            + 3 * h * d   // w1, w2, w3
                            + (qkv_bias ? d + 2 * kv : 0) + (o_bias ? d : 0);
  return v * d + n_layers * per_layer + d + (tied_classifier ? 0 : v * d);
}

const char* QuantTypeName(QuantType type) {
  switch (type) {
    case QuantType::kQ8_0:
      return "Q8_0";
    case QuantType::kQ4_0:
      return "Q4_0";
    case QuantType::kQ4_1:
      return "Q4_1";
    case QuantType::kQ4_K:
      return "Q4_K";
    case QuantType::kQ6_K:
      return "Q6_K";
  }
  return "unknown";
}

int QuantBlockSize(QuantType type) {
  return type == QuantType::kQ4_K || type == QuantType::kQ6_K ? 256 : 32;
}

int QuantBlockBytes(QuantType type) {
  switch (type) {
    case QuantType::kQ8_0:
      return 34;
    case QuantType::kQ4_0:
      return 18;
    case QuantType::kQ4_1:
      return 20;
    case QuantType::kQ4_K:
      return 144;
    case QuantType::kQ6_K:
      return 210;
  }
  return 1;
}

bool HasQuantizedWeights(const ModelWeights& weights) {
  if (!weights.quantized_token_embedding.empty() || !weights.quantized_classifier.empty()) {
    return true;
  }
  for (const LayerWeights& l : weights.layers) {
    const LayerWeights::Quantized& q = l.quantized;
    for (const QuantizedMatrix* m : {&q.wq, &q.wk, &q.wv, &q.wo, &q.w1, &q.w2, &q.w3}) {
      if (!m->empty()) return true;
    }
  }
  return false;
}

std::vector<float> RopeInverseFrequencies(const ModelConfig& config) {
  const int head_dim = config.head_dim();
  std::vector<float> inv_freq(head_dim / 2);
  // run.c's float formula; golden_test pins its bits.
  for (int i = 0; i < head_dim / 2; ++i) {
    inv_freq[i] = 1.0f / std::pow(config.rope_theta, static_cast<float>(2 * i) / head_dim);
  }
  const RopeScaling& s = config.rope_scaling;
  if (s.type == RopeScaling::Type::kLlama3) {
    // transformers' _compute_llama3_parameters, step for step in float32 as
    // its tensors are.
    const float old_context = static_cast<float>(s.original_max_position_embeddings);
    const float low_freq_wavelen = old_context / s.low_freq_factor;
    const float high_freq_wavelen = old_context / s.high_freq_factor;
    for (float& f : inv_freq) {
      const float wavelen = static_cast<float>(2 * std::numbers::pi) / f;
      if (wavelen > low_freq_wavelen) {
        f = f / s.factor;  // low frequencies: interpolate positions by `factor`
      } else if (!(wavelen < high_freq_wavelen)) {
        const float smooth =
            (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }  // high frequencies stay as they are
    }
  }
  // Per-pair factors (llama.cpp's rope_freqs.weight): ggml divides each
  // pair's angle by its factor, which is dividing its inverse frequency.
  // Loaders guarantee head_dim / 2 of them; the bound only keeps a config
  // built by hand from reading past the end.
  for (size_t i = 0; i < inv_freq.size() && i < s.freq_factors.size(); ++i) {
    inv_freq[i] /= s.freq_factors[i];
  }
  return inv_freq;
}

}  // namespace coalesce::engine
