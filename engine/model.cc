#include "engine/model.h"

#include <cstdint>

#include "engine/backend.h"

namespace coalesce::engine {

int64_t ModelConfig::num_parameters() const {
  const int64_t d = dim, h = hidden_dim, kv = kv_dim(), v = vocab_size;
  const int64_t per_layer = 2 * d         // attention and FFN norms
                            + d * d       // wq
                            + 2 * kv * d  // wk, wv
                            + d * d       // wo
                            + 3 * h * d;  // w1, w2, w3
  return v * d + n_layers * per_layer + d + (tied_classifier ? 0 : v * d);
}

// Declared in backend.h; lives here because it depends only on the shape, and
// every backend (CPU, CUDA) uses the same per-block layout: K and V for every
// layer, block_size positions of kv_dim floats each.
int64_t KvBlockBytes(const ModelConfig& config, int block_size) {
  return int64_t{2} * config.n_layers * block_size * config.kv_dim() *
         static_cast<int64_t>(sizeof(float));
}

}  // namespace coalesce::engine
