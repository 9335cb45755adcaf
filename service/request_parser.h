// Request messages from their wire bytes, with errors a client can act on.
//
// gRPC's generated handlers parse requests themselves and answer any parse
// failure with UNIMPLEMENTED and no message, while protobuf writes an
// unthrottled log line for every string field that is not UTF-8. The
// service takes its requests as raw bytes instead and parses them here:
// every failure is INVALID_ARGUMENT naming the problem, and the field when
// one is to blame. A 32-bit integer field (a token id, max_new_tokens) whose
// varint holds more than 32 bits is refused too: protobuf would keep its low
// 32 bits, so that 2^40 became token 0.
#pragma once

#include <cstddef>
#include <string_view>

#include "absl/status/status.h"
#include "google/protobuf/message.h"
#include "grpcpp/support/byte_buffer.h"

namespace coalesce::service {

// Parses `bytes` into `message` (cleared first).
absl::Status ParseRequest(const grpc::ByteBuffer& bytes, google::protobuf::Message* message);
absl::Status ParseRequest(std::string_view bytes, google::protobuf::Message* message);

// `message` in its wire form, for a raw method's response.
grpc::ByteBuffer SerializeMessage(const google::protobuf::Message& message);

// Whether `text` is well-formed UTF-8 (no overlong forms, surrogates or code
// points above U+10FFFF); if not, `*bad_offset` is where the first bad
// sequence begins.
bool IsValidUtf8(std::string_view text, size_t* bad_offset);

}  // namespace coalesce::service
