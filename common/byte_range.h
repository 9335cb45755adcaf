// A range of bytes of a text. The chat templates (chat/) say which
// bytes of a rendered conversation the template wrote itself, and the
// tokenizers (engine/tokenizer/) take those ranges back: neither knows the
// other, both know this.
#pragma once

#include <cstddef>

namespace coalesce {

// Bytes [begin, end).
struct ByteRange {
  size_t begin = 0;
  size_t end = 0;
  bool operator==(const ByteRange&) const = default;
};

}  // namespace coalesce
