// Random quantized blocks for the CPU kernels' tests: a rows x cols matrix
// of `type`, random bytes with every f16 scale set to a finite value (d of
// either sign, at byte 208 for Q6_K; Q4_1's m and Q4_K's dmin too). The
// integers and the K types' packed sub-block scales stay random.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/cpu/kv_quant.h"
#include "engine/model.h"
#include "engine/sampler.h"

namespace coalesce::engine::cpu {

inline std::vector<uint8_t> RandomBlocks(QuantType type, int64_t rows, int64_t cols,
                                         uint64_t seed) {
  Rng rng(seed);
  const int64_t blocks = rows * cols / QuantBlockSize(type);
  const int bytes = QuantBlockBytes(type);
  std::vector<uint8_t> data(static_cast<size_t>(blocks * bytes));
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng.NextU64());
  auto half = [&](uint8_t* p) {
    const uint16_t h = ToFp16((rng.NextFloat() - 0.5f) * 0.05f).bits;
    p[0] = static_cast<uint8_t>(h);
    p[1] = static_cast<uint8_t>(h >> 8);
  };
  for (int64_t i = 0; i < blocks; ++i) {
    uint8_t* b = data.data() + i * bytes;
    half(type == QuantType::kQ6_K ? b + 208 : b);
    if (type == QuantType::kQ4_1 || type == QuantType::kQ4_K) half(b + 2);
  }
  return data;
}

}  // namespace coalesce::engine::cpu
