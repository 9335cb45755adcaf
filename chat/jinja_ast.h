// The parsed form of a chat template: jinja2's node types, as far as chat
// templates use them. Built by ParseTemplate (jinja_parser.cc), immutable
// afterwards, walked by the interpreter (jinja_interp.cc).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chat/jinja_value.h"

namespace coalesce::chat::jinja {

struct Expr;
struct Stmt;
using ExprPtr = std::unique_ptr<Expr>;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

enum class ExprKind : uint8_t {
  kConst,     // value
  kName,      // name
  kGetattr,   // operands[0].name
  kGetitem,   // operands[0][operands[1]]
  kSlice,     // operands: start, stop, step (each may be null); only inside kGetitem
  kList,      // operands
  kTuple,     // operands
  kDict,      // operands: key, value, key, value, ...
  kNeg,       // -operands[0]
  kPos,       // +operands[0]
  kNot,       // not operands[0]
  kBinary,    // operands[0] bin_op operands[1]
  kAnd,       // operands[0] and operands[1]
  kOr,        // operands[0] or operands[1]
  kCompare,   // operands[0] cmp_ops[0] operands[1] cmp_ops[1] operands[2] ...
  kConcat,    // operands joined with ~
  kCondExpr,  // operands: then, condition, else (may be null)
  kCall,      // operands[0](call)
  kFilter,    // operands[0] | name(call); operands[0] null in a filter block
  kTest,      // operands[0] is name(call)
};

enum class BinOp : uint8_t { kAdd, kSub, kMul, kDiv, kFloorDiv, kMod, kPow };
enum class CmpOp : uint8_t { kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn };

struct CallArgs {
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  ExprPtr dyn_args;    // *args
  ExprPtr dyn_kwargs;  // **kwargs
};

struct Expr {
  ExprKind kind;
  int line = 0;
  Value value;       // kConst
  std::string name;  // kName, kGetattr, kFilter, kTest
  BinOp bin_op = BinOp::kAdd;
  std::vector<CmpOp> cmp_ops;
  std::vector<ExprPtr> operands;
  CallArgs call;
  int height = 1;  // of the tree below (the evaluator recurses this deep)
  // Made of constants only: jinja2 folds such an expression at compile time
  // when it is printed (jinja2's as_const), which slices with the sandbox's
  // getitem (an error is an undefined value) instead of Python's [].
  bool is_const = false;
};

// An assignment target: a name, namespace.attribute, or a tuple of targets.
struct Target {
  enum class Kind : uint8_t { kName, kNsAttr, kTuple };
  Kind kind = Kind::kName;
  std::string name;
  std::string attr;  // kNsAttr
  std::vector<Target> items;
  int line = 0;
};

struct MacroStmt {
  std::string name;
  std::vector<std::string> params;
  // Defaults of the last defaults.size() params.
  std::vector<ExprPtr> defaults;
  Body body;
  bool catch_varargs = false;  // the body refers to `varargs`
  bool catch_kwargs = false;   // the body refers to `kwargs`
};

enum class StmtKind : uint8_t {
  kData,      // text
  kPrint,     // {{ expr }}
  kIf,        // branches (an else has a null test)
  kFor,       // for target in expr [if cond]: body [else else_body]
  kSet,       // set target = expr
  kSetBlock,  // set target [| expr filter]: body endset
  kMacro,     // macro
  kBreak,
  kContinue,
  kWith,         // with targets = values: body
  kFilterBlock,  // filter expr: body
  kScope,        // a body in its own scope (transformers' {% generation %})
};

struct Stmt {
  StmtKind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr cond;
  Target target;
  Body body;
  Body else_body;
  std::vector<std::pair<ExprPtr, Body>> branches;
  std::vector<Target> with_targets;
  std::vector<ExprPtr> with_values;
  std::unique_ptr<MacroStmt> macro;
};

struct Template {
  Body body;
};

}  // namespace coalesce::chat::jinja
