#include "service/request_parser.h"

#include <string>
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

// Every string field of `fields` (read as `type`) is UTF-8, recursively
// through message fields. `path` names the message ("" at the top).
absl::Status CheckStrings(const UnknownFieldSet& fields, const Descriptor& type,
                          const std::string& path, int depth) {
  // Repeated fields are numbered by occurrence, as clients index them.
  std::vector<std::pair<int, int>> seen;  // (field number, occurrences)
  for (int i = 0; i < fields.field_count(); ++i) {
    const UnknownField& field = fields.field(i);
    const FieldDescriptor* descriptor = type.FindFieldByNumber(field.number());
    // Unknown fields, and known ones sent with another wire type, are kept
    // as unknown fields by protobuf (proto3): nothing to check.
    if (descriptor == nullptr || field.type() != UnknownField::TYPE_LENGTH_DELIMITED) continue;
    int index = 0;
    if (descriptor->is_repeated()) {
      auto it = std::find_if(seen.begin(), seen.end(),
                             [&](const auto& p) { return p.first == field.number(); });
      if (it == seen.end()) {
        seen.emplace_back(field.number(), 1);
      } else {
        index = it->second++;
      }
    }
    const std::string name = absl::StrCat(
        path, descriptor->name(), descriptor->is_repeated() ? absl::StrCat("[", index, "]") : "");
    if (descriptor->type() == FieldDescriptor::TYPE_STRING) {
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
              CheckStrings(nested, *descriptor->message_type(), absl::StrCat(name, "."), depth + 1);
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
  // 2. Every string it holds, at any depth, is UTF-8.
  if (absl::Status s = CheckStrings(fields, type, "", 0); !s.ok()) return invalid(s.message());
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
