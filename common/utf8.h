// UTF-8 as RFC 3629 defines it: no overlong forms, no surrogates, nothing
// above U+10FFFF.
#pragma once

#include <string_view>

namespace coalesce {

// The length (2 to 4) of the well-formed multi-byte sequence at the start of
// `text`, with its code point in `*code_point`; 0 when none begins there (an
// ASCII byte, a stray continuation byte, a truncated or ill-formed sequence).
int DecodeUtf8Sequence(std::string_view text, char32_t* code_point);

}  // namespace coalesce
