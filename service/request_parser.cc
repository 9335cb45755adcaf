#include "service/request_parser.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/utf8.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/unknown_field_set.h"
#include "grpcpp/impl/codegen/proto_utils.h"

namespace coalesce::service {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::UnknownField;
using google::protobuf::UnknownFieldSet;

// Nested messages followed at most this deep (coalesce's are 2 deep).
constexpr int kMaxDepth = 16;

// Whether a varint `value` read for a field of 32-bit `type` holds a value
// of that type. protobuf keeps only the low 32 bits of a larger one (2^40
// becomes 0), so a token id beyond 32 bits would silently name another
// token; such a value is refused instead. A negative int32 (or enum) is sent
// sign-extended to 64 bits.
bool FitsIn32Bits(FieldDescriptor::Type type, uint64_t value) {
  switch (type) {
    case FieldDescriptor::TYPE_INT32:
    case FieldDescriptor::TYPE_ENUM: {
      const auto signed_value = static_cast<int64_t>(value);
      return signed_value >= INT32_MIN && signed_value <= INT32_MAX;
    }
    case FieldDescriptor::TYPE_UINT32:
    case FieldDescriptor::TYPE_SINT32:  // zigzag: 32 bits hold every sint32
      return value <= UINT32_MAX;
    default:
      return true;
  }
}

bool Is32BitVarint(FieldDescriptor::Type type) {
  return type == FieldDescriptor::TYPE_INT32 || type == FieldDescriptor::TYPE_ENUM ||
         type == FieldDescriptor::TYPE_UINT32 || type == FieldDescriptor::TYPE_SINT32;
}

absl::Status OutOfRange(const std::string& name, FieldDescriptor::Type type, uint64_t value) {
  const bool is_signed = type == FieldDescriptor::TYPE_INT32 || type == FieldDescriptor::TYPE_ENUM;
  return absl::InvalidArgumentError(
      absl::StrCat("field ", name, " is ",
                   is_signed ? absl::StrCat(static_cast<int64_t>(value)) : absl::StrCat(value),
                   ", which does not fit in its 32 bits"));
}

// One varint from the front of `bytes` (a packed repeated field), or false
// when it is truncated or longer than 10 bytes.
bool ReadVarint(std::string_view* bytes, uint64_t* value) {
  uint64_t v = 0;
  for (int i = 0; i < 10 && i < static_cast<int>(bytes->size()); ++i) {
    const auto byte = static_cast<unsigned char>((*bytes)[i]);
    v |= static_cast<uint64_t>(byte & 0x7F) << (7 * i);
    if ((byte & 0x80) == 0) {
      bytes->remove_prefix(i + 1);
      *value = v;
      return true;
    }
  }
  return false;
}

// Every string field of `fields` (read as `type`) is UTF-8, and every 32-bit
// integer field holds a 32-bit value (packed or not), recursively through
// message fields. `path` names the message ("" at the top).
absl::Status CheckFields(const UnknownFieldSet& fields, const Descriptor& type,
                         const std::string& path, int depth) {
  // Items of repeated fields are numbered in order, as clients index them,
  // across every occurrence of the field (a packed one holds several).
  std::vector<std::pair<int, int>> seen;  // (field number, items so far)
  for (int i = 0; i < fields.field_count(); ++i) {
    const UnknownField& field = fields.field(i);
    const FieldDescriptor* descriptor = type.FindFieldByNumber(field.number());
    if (descriptor == nullptr) continue;  // unknown: protobuf keeps it aside
    const bool varint_field = Is32BitVarint(descriptor->type());
    const bool packed = varint_field && descriptor->is_repeated() &&
                        field.type() == UnknownField::TYPE_LENGTH_DELIMITED;
    // A known field sent with another wire type is kept as an unknown field
    // by protobuf (proto3): nothing to check.
    if (varint_field ? !(packed || field.type() == UnknownField::TYPE_VARINT)
                     : field.type() != UnknownField::TYPE_LENGTH_DELIMITED) {
      continue;
    }
    int* items = nullptr;
    if (descriptor->is_repeated()) {
      auto it = std::find_if(seen.begin(), seen.end(),
                             [&](const auto& p) { return p.first == field.number(); });
      if (it == seen.end()) it = seen.insert(seen.end(), {field.number(), 0});
      items = &it->second;
    }
    // The name of the field's next item, counting it.
    const auto next_name = [&] {
      return absl::StrCat(path, descriptor->name(),
                          items != nullptr ? absl::StrCat("[", (*items)++, "]") : "");
    };
    if (packed) {
      std::string_view bytes = field.length_delimited();
      while (!bytes.empty()) {
        const std::string name = next_name();
        uint64_t value;
        if (!ReadVarint(&bytes, &value)) {
          return absl::InvalidArgumentError(
              absl::StrCat("field ", name, " is a truncated varint (of a packed list)"));
        }
        if (!FitsIn32Bits(descriptor->type(), value)) {
          return OutOfRange(name, descriptor->type(), value);
        }
      }
      continue;
    }
    const std::string name = next_name();
    if (varint_field) {
      if (!FitsIn32Bits(descriptor->type(), field.varint())) {
        return OutOfRange(name, descriptor->type(), field.varint());
      }
    } else if (descriptor->type() == FieldDescriptor::TYPE_STRING) {
      size_t bad = 0;
      if (!IsValidUtf8(field.length_delimited(), &bad)) {
        return absl::InvalidArgumentError(
            absl::StrCat("field ", name, " is not valid UTF-8 (at byte ", bad,
                         "); string fields must be UTF-8, token ids go in the id fields"));
      }
    } else if (descriptor->type() == FieldDescriptor::TYPE_MESSAGE) {
      if (depth >= kMaxDepth) {
        return absl::InvalidArgumentError(absl::StrCat("field ", name, " is nested too deeply"));
      }
      UnknownFieldSet nested;
      if (!nested.ParseFromString(field.length_delimited())) {
        return absl::InvalidArgumentError(absl::StrCat("field ", name, " does not parse as a ",
                                                       descriptor->message_type()->full_name(),
                                                       " message (truncated or malformed bytes)"));
      }
      if (absl::Status s =
              CheckFields(nested, *descriptor->message_type(), absl::StrCat(name, "."), depth + 1);
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

bool IsValidUtf8(std::string_view text, size_t* bad_offset) {
  size_t i = 0;
  while (i < text.size()) {
    if (static_cast<unsigned char>(text[i]) < 0x80) {
      ++i;
      continue;
    }
    char32_t code_point;
    const int length = DecodeUtf8Sequence(text.substr(i), &code_point);
    if (length == 0) {
      *bad_offset = i;
      return false;
    }
    i += length;
  }
  return true;
}

absl::Status ParseRequest(std::string_view bytes, google::protobuf::Message* message) {
  message->Clear();
  const Descriptor& type = *message->GetDescriptor();
  auto invalid = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("the request is not a valid ", type.full_name(), ": ", why));
  };
  if (bytes.size() > static_cast<size_t>(INT32_MAX)) return invalid("it is too large");
  // 1. Well-formed protobuf wire format, read without a schema (and so
  //    without protobuf's own UTF-8 check and its log line).
  UnknownFieldSet fields;
  if (!fields.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return invalid(absl::StrCat("its ", bytes.size(),
                                " bytes are not a protobuf message (truncated, or "
                                "not protobuf at all)"));
  }
  // 2. Every string it holds, at any depth, is UTF-8, and every 32-bit
  //    integer fits in 32 bits.
  if (absl::Status s = CheckFields(fields, type, "", 0); !s.ok()) return invalid(s.message());
  // 3. The real parse, which now has nothing left to complain about.
  if (!message->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return invalid(absl::StrCat("its ", bytes.size(), " bytes do not parse as one"));
  }
  return absl::OkStatus();
}

absl::Status ParseRequest(const grpc::ByteBuffer& bytes, google::protobuf::Message* message) {
  std::vector<grpc::Slice> slices;
  std::string flat;
  if (!bytes.Dump(&slices).ok()) {
    return absl::InvalidArgumentError("the request's bytes could not be read");
  }
  if (slices.size() == 1) {
    return ParseRequest(
        std::string_view(reinterpret_cast<const char*>(slices[0].begin()), slices[0].size()),
        message);
  }
  flat.reserve(bytes.Length());
  for (const grpc::Slice& slice : slices) {
    flat.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return ParseRequest(flat, message);
}

grpc::ByteBuffer SerializeMessage(const google::protobuf::Message& message) {
  grpc::ByteBuffer buffer;
  bool own_buffer = false;
  // Serializing a message built here fails only on a size over 2 GiB.
  (void)grpc::SerializationTraits<google::protobuf::Message>::Serialize(message, &buffer,
                                                                        &own_buffer);
  return buffer;
}

}  // namespace coalesce::service
