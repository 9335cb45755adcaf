// One row's block of a quantized file (model.h, QuantType), decoded into its
// integers and scale fields whatever the type's bit layout: what the CPU
// engine's two layouts of quantized weights (quant_matmul.h, quant_int8.h)
// are packed from.
#pragma once

#include <cstdint>

#include "engine/model.h"

namespace coalesce::engine::cpu {

struct QuantBlock {
  uint16_t d = 0, m = 0;  // f16: Q*_0's and Q6_K's d; Q4_1's d and m; Q4_K's d and dmin
  uint8_t sc[16] = {};    // Q4_K: 8 six-bit scales; Q6_K: 16 int8 scales (as bytes)
  uint8_t mn[8] = {};     // Q4_K: 8 six-bit mins
  uint8_t q[256] = {};    // the elements' integers (Q8_0's as int8 bits; Q6_K's 0..63)
};

// Decodes the block at `b` (QuantBlockBytes(type) bytes of the file).
QuantBlock DecodeQuantBlock(QuantType type, const uint8_t* b);

}  // namespace coalesce::engine::cpu
