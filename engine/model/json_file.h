// Reading the JSON files of a Hugging Face model folder (config.json,
// generation_config.json, model.safetensors.index.json): the whole file, its
// nesting bounded (engine/json_depth.h), parsed without exceptions.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace coalesce::engine {

// Errors name the file: NotFound when it cannot be opened, InvalidArgument
// when it nests too deep or is not JSON. Any JSON value is returned; callers
// check its type.
absl::StatusOr<nlohmann::json> ReadJsonFile(const std::string& path);

}  // namespace coalesce::engine
