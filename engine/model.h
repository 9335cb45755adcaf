// A Llama-architecture decoder: its shape (ModelConfig) and its float32
// weights (ModelWeights). Loaders (llama2c.h, synthetic.h) produce a Model;
// backends read it. Every matrix is row-major [out][in], as llama2.c stores it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace coalesce::engine {

struct ModelConfig {
  std::string name;                    // "stories260K", "synthetic:15m", ...
  std::string architecture = "llama";  // what GetModelInfo reports
  std::string source;                  // path it was loaded from, or "embedded"
  bool synthetic = false;              // random weights: output is not language
  int dim = 0;                         // model width (hidden size)
  int hidden_dim = 0;                  // SwiGLU inner width
  int n_layers = 0;
  int n_heads = 0;     // query heads
  int n_kv_heads = 0;  // key/value heads (GQA when < n_heads)
  int vocab_size = 0;
  int max_seq_len = 0;  // context length in tokens
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;        // RMSNorm epsilon
  bool tied_classifier = false;  // the classifier is the token embedding

  int head_dim() const { return dim / n_heads; }
  int kv_dim() const { return n_kv_heads * head_dim(); }
  // Number of parameters, counting a tied classifier once.
  int64_t num_parameters() const;
};

// Views into one layer's weights. Rotary embeddings rotate interleaved pairs
// (x[2i], x[2i+1]) of each head, as llama2.c does; loaders of other layouts
// permute wq/wk rows into this one.
struct LayerWeights {
  std::span<const float> attn_norm;  // [dim]
  std::span<const float> wq;         // [n_heads * head_dim, dim]
  std::span<const float> wk;         // [kv_dim, dim]
  std::span<const float> wv;         // [kv_dim, dim]
  std::span<const float> wo;         // [dim, n_heads * head_dim]
  std::span<const float> ffn_norm;   // [dim]
  std::span<const float> w1;         // [hidden_dim, dim]  gate
  std::span<const float> w2;         // [dim, hidden_dim]  down
  std::span<const float> w3;         // [hidden_dim, dim]  up
};

struct ModelWeights {
  std::span<const float> token_embedding;  // [vocab_size, dim]
  std::vector<LayerWeights> layers;        // [n_layers]
  std::span<const float> final_norm;       // [dim]
  std::span<const float> classifier;       // [vocab_size, dim] (may alias token_embedding)
};

// A loaded model. The spans in `weights` point into `storage`, which the Model
// owns (a heap buffer or a memory mapping), so a Model is movable but the
// spans stay valid for its lifetime.
struct Model {
  ModelConfig config;
  ModelWeights weights;
  std::shared_ptr<const void> storage;
};

}  // namespace coalesce::engine
