// Small Status helpers that Debian's Abseil (20220623) does not ship.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define COALESCE_CONCAT_INNER_(a, b) a##b
#define COALESCE_CONCAT_(a, b) COALESCE_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` yields a non-OK absl::Status.
#define RETURN_IF_ERROR(expr)          \
  do {                                 \
    ::absl::Status _status = (expr);   \
    if (!_status.ok()) return _status; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, MakeX());` binds the value of an OK StatusOr, or
// returns its error from the enclosing function.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL_(COALESCE_CONCAT_(_statusor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                           \
  if (!tmp.ok()) return tmp.status();          \
  lhs = std::move(tmp).value()
