// The parser of jinja2 templates (tokens from jinja_lexer.h), following
// jinja2 3.1's recursive-descent grammar (operator precedence, tuples, filters, tests).
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_join.h"
#include "chat/jinja.h"
#include "chat/jinja_builtins.h"
#include "chat/jinja_interp.h"
#include "chat/jinja_lexer.h"
#include "chat/jinja_unicode.h"

namespace coalesce::chat::jinja {
namespace {

// Expressions and statements nested deeper than this do not parse (the
// parser and the evaluator recurse once per level).
constexpr int kMaxParseNesting = 100;
constexpr int kMaxExprHeight = 256;

// ---------------------------------------------------------------------------
// Parser

std::string Describe(const Token& t) {
  switch (t.type) {
    case Tok::kName:
    case Tok::kOp:
      return t.value;
    case Tok::kString:
      return "string";
    case Tok::kInt:
      return "integer";
    case Tok::kFloat:
      return "float";
    case Tok::kData:
      return "template data / text";
    case Tok::kVarBegin:
      return "begin of print statement";
    case Tok::kVarEnd:
      return "end of print statement";
    case Tok::kBlockBegin:
      return "begin of statement block";
    case Tok::kBlockEnd:
      return "end of statement block";
    case Tok::kEof:
      return "end of template";
  }
  return "?";
}

std::string DescribeType(Tok type) {
  Token t;
  t.type = type;
  return Describe(t);
}

ExprPtr MakeExpr(ExprKind kind, int line) {
  auto e = std::make_unique<Expr>();
  e->kind = kind;
  e->line = line;
  return e;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  Template Parse() {
    Template t;
    t.body = Subparse(nullptr);
    return t;
  }

 private:
  using EndTokens = std::vector<std::string_view>;

  struct NestingGuard {
    explicit NestingGuard(Parser* p) : p(p) {
      if (++p->nesting_ > kMaxParseNesting) {
        p->Fail(Cat("the template nests expressions or statements deeper than ", kMaxParseNesting,
                    " levels"));
      }
    }
    ~NestingGuard() { --p->nesting_; }
    Parser* p;
  };

  const Token& cur() const { return toks_[i_]; }
  const Token& look() const { return toks_[std::min(i_ + 1, toks_.size() - 1)]; }
  void Next() {
    if (i_ + 1 < toks_.size()) ++i_;
  }
  bool IsName(std::string_view v) const { return cur().type == Tok::kName && cur().value == v; }
  bool IsOp(std::string_view v) const { return cur().type == Tok::kOp && cur().value == v; }
  bool SkipName(std::string_view v) {
    if (!IsName(v)) return false;
    Next();
    return true;
  }
  bool SkipOp(std::string_view v) {
    if (!IsOp(v)) return false;
    Next();
    return true;
  }

  [[noreturn]] void Fail(std::string message, int line = 0) {
    SyntaxError(line > 0 ? line : cur().line, std::move(message));
  }

  void FailExpected(const std::string& what) {
    if (cur().type == Tok::kEof) {
      Fail(Cat("unexpected end of template, expected '", what, "'."));
    }
    Fail(Cat("expected token '", what, "', got '", Describe(cur()), "'"));
  }

  void ExpectOp(std::string_view op) {
    if (!SkipOp(op)) FailExpected(std::string(op));
  }
  void ExpectName(std::string_view name) {
    if (!SkipName(name)) FailExpected(std::string(name));
  }
  void Expect(Tok type) {
    if (cur().type != type) FailExpected(DescribeType(type));
    Next();
  }
  std::string ExpectAnyName() {
    if (cur().type != Tok::kName) FailExpected("name");
    std::string v = cur().value;
    Next();
    return v;
  }

  static std::string Quoted(const EndTokens& tokens) {
    std::vector<std::string> q;
    for (auto t : tokens) q.push_back(Cat("'", t, "'"));
    return absl::StrJoin(q, " or ");
  }

  [[noreturn]] void FailUnknownTag(const std::string* name, const std::vector<EndTokens>& stack,
                                   int line) {
    std::string message = name == nullptr ? "Unexpected end of template."
                                          : Cat("Encountered unknown tag ", ReprString(*name), ".");
    if (!stack.empty()) {
      bool expected = false;
      for (const auto& tokens : stack) {
        for (auto t : tokens) expected |= name != nullptr && t == *name;
      }
      if (expected) {
        CatAppend(&message,
                  " You probably made a nesting mistake. Jinja is expecting this tag, but "
                  "currently looking for ",
                  Quoted(stack.back()), ".");
      } else {
        CatAppend(&message, " Jinja was looking for the following tags: ", Quoted(stack.back()),
                  ".");
      }
    }
    if (!tag_stack_.empty()) {
      CatAppend(&message, " The innermost block that needs to be closed is ",
                ReprString(tag_stack_.back()), ".");
    }
    Fail(std::move(message), line);
  }

  bool IsTupleEnd(const EndTokens* extra) const {
    if (cur().type == Tok::kVarEnd || cur().type == Tok::kBlockEnd || IsOp(")")) return true;
    if (extra != nullptr) {
      for (auto t : *extra) {
        if (IsName(t)) return true;
      }
    }
    return false;
  }

  void Finish(Expr* e) {
    int h = 0;
    auto visit = [&](const ExprPtr& c) {
      if (c) h = std::max(h, c->height);
    };
    for (const auto& c : e->operands) visit(c);
    for (const auto& c : e->call.args) visit(c);
    for (const auto& [k, c] : e->call.kwargs) visit(c);
    visit(e->call.dyn_args);
    visit(e->call.dyn_kwargs);
    e->height = h + 1;
    e->is_const = ComputeIsConst(*e);
    if (e->height > kMaxExprHeight) {
      Fail(Cat("an expression nests deeper than ", kMaxExprHeight, " levels"), e->line);
    }
  }

  ExprPtr Unary(ExprKind kind, int line, ExprPtr operand) {
    auto e = MakeExpr(kind, line);
    e->operands.push_back(std::move(operand));
    Finish(e.get());
    return e;
  }

  ExprPtr Binary(ExprKind kind, int line, ExprPtr a, ExprPtr b) {
    auto e = MakeExpr(kind, line);
    e->operands.push_back(std::move(a));
    e->operands.push_back(std::move(b));
    Finish(e.get());
    return e;
  }

  // --- statements --------------------------------------------------------

  Body Subparse(const EndTokens* end_tokens) {
    Body body;
    if (end_tokens != nullptr) end_stack_.push_back(*end_tokens);
    while (cur().type != Tok::kEof) {
      const Token& t = cur();
      if (t.type == Tok::kData) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kData;
        s->line = t.line;
        s->text = t.value;
        body.push_back(std::move(s));
        Next();
      } else if (t.type == Tok::kVarBegin) {
        Next();
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kPrint;
        s->line = cur().line;
        s->expr = ParseTuple(false, true, nullptr, false);
        Expect(Tok::kVarEnd);
        body.push_back(std::move(s));
      } else if (t.type == Tok::kBlockBegin) {
        Next();
        if (end_tokens != nullptr && cur().type == Tok::kName) {
          for (auto e : *end_tokens) {
            if (cur().value == e) {
              end_stack_.pop_back();
              return body;
            }
          }
        }
        body.push_back(ParseStatement());
        Expect(Tok::kBlockEnd);
      } else {
        Fail(Cat("unexpected '", Describe(t), "'"));
      }
    }
    if (end_tokens != nullptr) end_stack_.pop_back();
    return body;
  }

  Body ParseStatements(const EndTokens& end_tokens, bool drop_needle) {
    SkipOp(":");
    Expect(Tok::kBlockEnd);
    Body body = Subparse(&end_tokens);
    if (cur().type == Tok::kEof) {
      std::vector<EndTokens> stack = end_stack_;
      stack.push_back(end_tokens);
      FailUnknownTag(nullptr, stack, cur().line);
    }
    if (drop_needle) Next();
    return body;
  }

  StmtPtr NewStmt(StmtKind kind, int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->line = line;
    return s;
  }

  StmtPtr ParseStatement() {
    NestingGuard guard(this);
    if (cur().type != Tok::kName) Fail("tag name expected");
    const std::string tag = cur().value;
    const int line = cur().line;
    tag_stack_.push_back(tag);
    StmtPtr s;
    if (tag == "for") {
      s = ParseFor();
    } else if (tag == "if") {
      s = ParseIf();
    } else if (tag == "set") {
      s = ParseSet();
    } else if (tag == "macro") {
      s = ParseMacro();
    } else if (tag == "with") {
      s = ParseWith();
    } else if (tag == "filter") {
      Next();
      s = NewStmt(StmtKind::kFilterBlock, line);
      s->expr = ParseFilter(nullptr, /*start_inline=*/true);
      s->body = ParseStatements({"endfilter"}, true);
    } else if (tag == "print") {
      Next();
      s = NewStmt(StmtKind::kPrint, line);
      std::vector<ExprPtr> items;
      while (cur().type != Tok::kBlockEnd) {
        if (!items.empty()) ExpectOp(",");
        items.push_back(ParseExpression());
      }
      if (items.size() == 1) {
        s->expr = std::move(items[0]);
      } else {
        // Printed one after the other, as jinja2's Output node does.
        auto t = MakeExpr(ExprKind::kConcat, line);
        t->operands = std::move(items);
        Finish(t.get());
        s->expr = std::move(t);
      }
    } else if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) Fail(Cat("'", tag, "' outside loop"));
      Next();
      s = NewStmt(tag == "break" ? StmtKind::kBreak : StmtKind::kContinue, line);
    } else if (tag == "generation") {
      // transformers' AssistantTracker: the body renders as it is.
      Next();
      s = NewStmt(StmtKind::kScope, line);
      s->body = ParseStatements({"endgeneration"}, true);
    } else if (tag == "block" || tag == "extends" || tag == "include" || tag == "import" ||
               tag == "from" || tag == "autoescape" || tag == "call") {
      Fail(Cat("the '", tag, "' tag is not supported in chat templates"));
    } else {
      tag_stack_.pop_back();
      FailUnknownTag(&tag, end_stack_, line);
    }
    tag_stack_.pop_back();
    return s;
  }

  StmtPtr ParseFor() {
    auto s = NewStmt(StmtKind::kFor, cur().line);
    Next();
    const EndTokens in = {"in"};
    s->target = ParseTargetTuple(&in, /*with_namespace=*/false, /*explicit_parens=*/false);
    ExpectName("in");
    const EndTokens recursive = {"recursive"};
    s->expr = ParseTuple(false, false, &recursive, false);
    if (SkipName("if")) s->cond = ParseExpression();
    if (IsName("recursive")) Fail("recursive for loops are not supported in chat templates");
    ++loop_depth_;
    s->body = ParseStatements({"endfor", "else"}, false);
    --loop_depth_;
    const bool has_else = cur().value == "else";
    Next();
    if (has_else) s->else_body = ParseStatements({"endfor"}, true);
    return s;
  }

  StmtPtr ParseIf() {
    auto s = NewStmt(StmtKind::kIf, cur().line);
    Next();
    while (true) {
      ExprPtr test = ParseTuple(false, false, nullptr, false);
      Body body = ParseStatements({"elif", "else", "endif"}, false);
      s->branches.emplace_back(std::move(test), std::move(body));
      const std::string which = cur().value;
      Next();
      if (which == "elif") continue;
      if (which == "else") s->branches.emplace_back(nullptr, ParseStatements({"endif"}, true));
      break;
    }
    return s;
  }

  StmtPtr ParseSet() {
    const int line = cur().line;
    Next();
    Target target = ParseTargetTuple(nullptr, /*with_namespace=*/true, false);
    if (SkipOp("=")) {
      auto s = NewStmt(StmtKind::kSet, line);
      s->target = std::move(target);
      s->expr = ParseTuple(false, true, nullptr, false);
      return s;
    }
    auto s = NewStmt(StmtKind::kSetBlock, line);
    s->target = std::move(target);
    s->expr = ParseFilter(nullptr, false);
    s->body = ParseStatements({"endset"}, true);
    return s;
  }

  StmtPtr ParseMacro() {
    auto s = NewStmt(StmtKind::kMacro, cur().line);
    Next();
    auto macro = std::make_unique<MacroStmt>();
    macro->name = ExpectAnyName();
    ExpectOp("(");
    while (!IsOp(")")) {
      if (!macro->params.empty()) ExpectOp(",");
      std::string param = ExpectAnyName();
      if (SkipOp("=")) {
        macro->defaults.push_back(ParseExpression());
      } else if (!macro->defaults.empty()) {
        Fail("non-default argument follows default argument");
      }
      macro->params.push_back(std::move(param));
    }
    ExpectOp(")");
    const int saved_loops = loop_depth_;
    loop_depth_ = 0;
    macros_.push_back(macro.get());
    macro->body = ParseStatements({"endmacro"}, true);
    macros_.pop_back();
    loop_depth_ = saved_loops;
    s->macro = std::move(macro);
    return s;
  }

  StmtPtr ParseWith() {
    auto s = NewStmt(StmtKind::kWith, cur().line);
    Next();
    while (cur().type != Tok::kBlockEnd) {
      if (!s->with_targets.empty()) ExpectOp(",");
      s->with_targets.push_back(ParseTargetTuple(nullptr, false, false));
      ExpectOp("=");
      s->with_values.push_back(ParseExpression());
    }
    s->body = ParseStatements({"endwith"}, true);
    return s;
  }

  // An assignment target: names (namespace.attr with `with_namespace`), in
  // a tuple if there are commas.
  Target ParseTargetTuple(const EndTokens* extra, bool with_namespace, bool explicit_parens) {
    std::vector<Target> items;
    bool is_tuple = false;
    const int line = cur().line;
    while (true) {
      if (!items.empty()) ExpectOp(",");
      if (IsTupleEnd(extra)) break;
      items.push_back(ParseTargetPrimary(with_namespace));
      if (IsOp(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) Fail(Cat("Expected an expression, got '", Describe(cur()), "'"));
    }
    Target t;
    t.kind = Target::Kind::kTuple;
    t.items = std::move(items);
    t.line = line;
    return t;
  }

  Target ParseTargetPrimary(bool with_namespace) {
    const Token& t = cur();
    Target target;
    target.line = t.line;
    if (t.type == Tok::kName) {
      if (t.value == "true" || t.value == "false" || t.value == "True" || t.value == "False" ||
          t.value == "none" || t.value == "None") {
        Fail("can't assign to 'const'");
      }
      target.name = t.value;
      Next();
      if (with_namespace && IsOp(".")) {
        Next();
        target.kind = Target::Kind::kNsAttr;
        target.attr = ExpectAnyName();
      }
      return target;
    }
    if (IsOp("(")) {
      Next();
      NestingGuard guard(this);
      Target inner = ParseTargetTuple(nullptr, with_namespace, true);
      ExpectOp(")");
      return inner;
    }
    if (t.type == Tok::kEof || t.type == Tok::kBlockEnd || t.type == Tok::kVarEnd) {
      Fail(Cat("Expected an expression, got '", Describe(t), "'"));
    }
    Fail(Cat("can't assign to '", Describe(t), "'"));
  }

  // --- expressions -------------------------------------------------------

  ExprPtr ParseExpression(bool with_condexpr = true) {
    NestingGuard guard(this);
    return with_condexpr ? ParseCondExpr() : ParseOr();
  }

  ExprPtr ParseCondExpr() {
    int line = cur().line;
    ExprPtr expr1 = ParseOr();
    while (SkipName("if")) {
      ExprPtr expr2 = ParseOr();
      ExprPtr expr3 = SkipName("else") ? ParseCondExpr() : nullptr;
      auto e = MakeExpr(ExprKind::kCondExpr, line);
      e->operands.push_back(std::move(expr1));
      e->operands.push_back(std::move(expr2));
      e->operands.push_back(std::move(expr3));
      Finish(e.get());
      expr1 = std::move(e);
      line = cur().line;
    }
    return expr1;
  }

  ExprPtr ParseOr() {
    int line = cur().line;
    ExprPtr left = ParseAnd();
    while (SkipName("or")) {
      left = Binary(ExprKind::kOr, line, std::move(left), ParseAnd());
      line = cur().line;
    }
    return left;
  }

  ExprPtr ParseAnd() {
    int line = cur().line;
    ExprPtr left = ParseNot();
    while (SkipName("and")) {
      left = Binary(ExprKind::kAnd, line, std::move(left), ParseNot());
      line = cur().line;
    }
    return left;
  }

  ExprPtr ParseNot() {
    if (IsName("not")) {
      const int line = cur().line;
      Next();
      NestingGuard guard(this);
      return Unary(ExprKind::kNot, line, ParseNot());
    }
    return ParseCompare();
  }

  ExprPtr ParseCompare() {
    const int line = cur().line;
    ExprPtr expr = ParseMath1();
    std::vector<CmpOp> ops;
    std::vector<ExprPtr> operands;
    while (true) {
      CmpOp op;
      if (cur().type == Tok::kOp &&
          (cur().value == "==" || cur().value == "!=" || cur().value == "<" ||
           cur().value == "<=" || cur().value == ">" || cur().value == ">=")) {
        const std::string& v = cur().value;
        op = v == "=="   ? CmpOp::kEq
             : v == "!=" ? CmpOp::kNe
             : v == "<"  ? CmpOp::kLt
             : v == "<=" ? CmpOp::kLe
             : v == ">"  ? CmpOp::kGt
                         : CmpOp::kGe;
        Next();
      } else if (SkipName("in")) {
        op = CmpOp::kIn;
      } else if (IsName("not") && look().type == Tok::kName && look().value == "in") {
        Next();
        Next();
        op = CmpOp::kNotIn;
      } else {
        break;
      }
      ops.push_back(op);
      operands.push_back(ParseMath1());
    }
    if (ops.empty()) return expr;
    auto e = MakeExpr(ExprKind::kCompare, line);
    e->operands.push_back(std::move(expr));
    for (auto& o : operands) e->operands.push_back(std::move(o));
    e->cmp_ops = std::move(ops);
    Finish(e.get());
    return e;
  }

  ExprPtr BinaryOp(BinOp op, int line, ExprPtr a, ExprPtr b) {
    auto e = Binary(ExprKind::kBinary, line, std::move(a), std::move(b));
    e->bin_op = op;
    return e;
  }

  ExprPtr ParseMath1() {
    int line = cur().line;
    ExprPtr left = ParseConcat();
    while (IsOp("+") || IsOp("-")) {
      const BinOp op = IsOp("+") ? BinOp::kAdd : BinOp::kSub;
      Next();
      left = BinaryOp(op, line, std::move(left), ParseConcat());
      line = cur().line;
    }
    return left;
  }

  ExprPtr ParseConcat() {
    const int line = cur().line;
    ExprPtr first = ParseMath2();
    if (!IsOp("~")) return first;
    auto e = MakeExpr(ExprKind::kConcat, line);
    e->operands.push_back(std::move(first));
    while (SkipOp("~")) e->operands.push_back(ParseMath2());
    Finish(e.get());
    return e;
  }

  ExprPtr ParseMath2() {
    int line = cur().line;
    ExprPtr left = ParsePow();
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      const std::string& v = cur().value;
      const BinOp op = v == "*"    ? BinOp::kMul
                       : v == "/"  ? BinOp::kDiv
                       : v == "//" ? BinOp::kFloorDiv
                                   : BinOp::kMod;
      Next();
      left = BinaryOp(op, line, std::move(left), ParsePow());
      line = cur().line;
    }
    return left;
  }

  ExprPtr ParsePow() {
    int line = cur().line;
    ExprPtr left = ParseUnary(true);
    while (SkipOp("**")) {
      left = BinaryOp(BinOp::kPow, line, std::move(left), ParseUnary(true));
      line = cur().line;
    }
    return left;
  }

  ExprPtr ParseUnary(bool with_filter) {
    const int line = cur().line;
    ExprPtr node;
    if (IsOp("-") || IsOp("+")) {
      const ExprKind kind = IsOp("-") ? ExprKind::kNeg : ExprKind::kPos;
      Next();
      NestingGuard guard(this);
      node = Unary(kind, line, ParseUnary(false));
    } else {
      node = ParsePrimary();
    }
    node = ParsePostfix(std::move(node));
    if (with_filter) node = ParseFilterExpr(std::move(node));
    return node;
  }

  ExprPtr Const(Value v, int line) {
    auto e = MakeExpr(ExprKind::kConst, line);
    e->value = std::move(v);
    e->is_const = true;
    return e;
  }

  ExprPtr ParsePrimary() {
    const Token& t = cur();
    const int line = t.line;
    switch (t.type) {
      case Tok::kName: {
        const std::string name = t.value;
        Next();
        if (name == "true" || name == "True") return Const(Value::Bool(true), line);
        if (name == "false" || name == "False") return Const(Value::Bool(false), line);
        if (name == "none" || name == "None") return Const(Value::None(), line);
        if (!macros_.empty()) {
          if (name == "varargs") macros_.back()->catch_varargs = true;
          if (name == "kwargs") macros_.back()->catch_kwargs = true;
        }
        auto e = MakeExpr(ExprKind::kName, line);
        e->name = name;
        return e;
      }
      case Tok::kString: {
        std::string s = t.value;
        Next();
        while (cur().type == Tok::kString) {
          s += cur().value;
          Next();
        }
        return Const(Value::TemplateStr(std::move(s)), line);
      }
      case Tok::kInt: {
        const int64_t v = t.ival;
        Next();
        return Const(Value::Int(v), line);
      }
      case Tok::kFloat: {
        const double v = t.fval;
        Next();
        return Const(Value::Float(v), line);
      }
      case Tok::kOp:
        if (t.value == "(") {
          Next();
          NestingGuard guard(this);
          ExprPtr e = ParseTuple(false, true, nullptr, /*explicit_parens=*/true);
          ExpectOp(")");
          return e;
        }
        if (t.value == "[") return ParseList();
        if (t.value == "{") return ParseDict();
        break;
      default:
        break;
    }
    Fail(Cat("unexpected '", Describe(t), "'"));
  }

  ExprPtr ParseTuple(bool simplified, bool with_condexpr, const EndTokens* extra,
                     bool explicit_parens) {
    const int line = cur().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) ExpectOp(",");
      if (IsTupleEnd(extra)) break;
      items.push_back(simplified ? ParsePrimary() : ParseExpression(with_condexpr));
      if (IsOp(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) Fail(Cat("Expected an expression, got '", Describe(cur()), "'"));
    }
    auto e = MakeExpr(ExprKind::kTuple, line);
    e->operands = std::move(items);
    Finish(e.get());
    return e;
  }

  ExprPtr ParseList() {
    const int line = cur().line;
    ExpectOp("[");
    NestingGuard guard(this);
    auto e = MakeExpr(ExprKind::kList, line);
    while (!IsOp("]")) {
      if (!e->operands.empty()) ExpectOp(",");
      if (IsOp("]")) break;
      e->operands.push_back(ParseExpression());
    }
    ExpectOp("]");
    Finish(e.get());
    return e;
  }

  ExprPtr ParseDict() {
    const int line = cur().line;
    ExpectOp("{");
    NestingGuard guard(this);
    auto e = MakeExpr(ExprKind::kDict, line);
    while (!IsOp("}")) {
      if (!e->operands.empty()) ExpectOp(",");
      if (IsOp("}")) break;
      e->operands.push_back(ParseExpression());
      ExpectOp(":");
      e->operands.push_back(ParseExpression());
    }
    ExpectOp("}");
    Finish(e.get());
    return e;
  }

  ExprPtr ParsePostfix(ExprPtr node) {
    while (true) {
      if (IsOp(".") || IsOp("[")) {
        node = ParseSubscript(std::move(node));
      } else if (IsOp("(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr ParseFilterExpr(ExprPtr node) {
    while (true) {
      if (IsOp("|")) {
        node = ParseFilter(std::move(node), false);
      } else if (IsName("is")) {
        node = ParseTest(std::move(node));
      } else if (IsOp("(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr ParseSubscript(ExprPtr node) {
    const int line = cur().line;
    if (SkipOp(".")) {
      const Token& attr = cur();
      if (attr.type == Tok::kName) {
        auto e = MakeExpr(ExprKind::kGetattr, line);
        e->name = attr.value;
        Next();
        e->operands.push_back(std::move(node));
        Finish(e.get());
        return e;
      }
      if (attr.type != Tok::kInt) Fail("expected name or number", attr.line);
      ExprPtr index = Const(Value::Int(attr.ival), attr.line);
      Next();
      return Binary(ExprKind::kGetitem, line, std::move(node), std::move(index));
    }
    ExpectOp("[");
    NestingGuard guard(this);
    std::vector<ExprPtr> args;
    while (!IsOp("]")) {
      if (!args.empty()) ExpectOp(",");
      args.push_back(ParseSubscribed());
    }
    ExpectOp("]");
    ExprPtr arg;
    if (args.size() == 1) {
      arg = std::move(args[0]);
    } else {
      arg = MakeExpr(ExprKind::kTuple, line);
      arg->operands = std::move(args);
      Finish(arg.get());
    }
    return Binary(ExprKind::kGetitem, line, std::move(node), std::move(arg));
  }

  ExprPtr ParseSubscribed() {
    const int line = cur().line;
    std::vector<ExprPtr> args;
    if (IsOp(":")) {
      Next();
      args.push_back(nullptr);
    } else {
      ExprPtr node = ParseExpression();
      if (!IsOp(":")) return node;
      Next();
      args.push_back(std::move(node));
    }
    if (IsOp(":")) {
      args.push_back(nullptr);
    } else if (!IsOp("]") && !IsOp(",")) {
      args.push_back(ParseExpression());
    } else {
      args.push_back(nullptr);
    }
    if (SkipOp(":")) {
      if (!IsOp("]") && !IsOp(",")) {
        args.push_back(ParseExpression());
      } else {
        args.push_back(nullptr);
      }
    } else {
      args.push_back(nullptr);
    }
    auto e = MakeExpr(ExprKind::kSlice, line);
    e->operands = std::move(args);
    Finish(e.get());
    return e;
  }

  void ParseCallArgs(CallArgs* call) {
    const int line = cur().line;
    ExpectOp("(");
    NestingGuard guard(this);
    bool require_comma = false;
    auto ensure = [&](bool ok) {
      if (!ok) Fail("invalid syntax for function call expression", line);
    };
    while (!IsOp(")")) {
      if (require_comma) {
        ExpectOp(",");
        if (IsOp(")")) break;
      }
      if (IsOp("*")) {
        ensure(call->dyn_args == nullptr && call->dyn_kwargs == nullptr);
        Next();
        call->dyn_args = ParseExpression();
      } else if (IsOp("**")) {
        ensure(call->dyn_kwargs == nullptr);
        Next();
        call->dyn_kwargs = ParseExpression();
      } else if (cur().type == Tok::kName && look().type == Tok::kOp && look().value == "=") {
        ensure(call->dyn_kwargs == nullptr);
        std::string key = cur().value;
        Next();
        Next();
        call->kwargs.emplace_back(std::move(key), ParseExpression());
      } else {
        ensure(call->dyn_args == nullptr && call->dyn_kwargs == nullptr && call->kwargs.empty());
        call->args.push_back(ParseExpression());
      }
      require_comma = true;
    }
    ExpectOp(")");
  }

  ExprPtr ParseCall(ExprPtr node) {
    auto e = MakeExpr(ExprKind::kCall, cur().line);
    ParseCallArgs(&e->call);
    e->operands.push_back(std::move(node));
    Finish(e.get());
    return e;
  }

  ExprPtr ParseFilter(ExprPtr node, bool start_inline) {
    while (IsOp("|") || start_inline) {
      if (!start_inline) Next();
      const int line = cur().line;
      std::string name = ExpectAnyName();
      while (SkipOp(".")) {
        name += '.';
        name += ExpectAnyName();
      }
      auto e = MakeExpr(ExprKind::kFilter, line);
      e->name = std::move(name);
      if (IsOp("(")) ParseCallArgs(&e->call);
      e->operands.push_back(std::move(node));
      Finish(e.get());
      node = std::move(e);
      start_inline = false;
    }
    return node;
  }

  ExprPtr ParseTest(ExprPtr node) {
    const int line = cur().line;
    Next();  // is
    const bool negated = SkipName("not");
    std::string name = ExpectAnyName();
    while (SkipOp(".")) {
      name += '.';
      name += ExpectAnyName();
    }
    auto e = MakeExpr(ExprKind::kTest, line);
    e->name = std::move(name);
    const Token& t = cur();
    if (IsOp("(")) {
      ParseCallArgs(&e->call);
    } else if ((t.type == Tok::kName || t.type == Tok::kString || t.type == Tok::kInt ||
                t.type == Tok::kFloat || IsOp("[") || IsOp("{")) &&
               !(IsName("else") || IsName("or") || IsName("and"))) {
      if (IsName("is")) Fail("You cannot chain multiple tests with is");
      NestingGuard guard(this);
      e->call.args.push_back(ParsePostfix(ParsePrimary()));
    }
    e->operands.push_back(std::move(node));
    Finish(e.get());
    if (negated) return Unary(ExprKind::kNot, line, std::move(e));
    return e;
  }

  std::vector<Token> toks_;
  size_t i_ = 0;
  int nesting_ = 0;
  int loop_depth_ = 0;
  std::vector<MacroStmt*> macros_;
  std::vector<EndTokens> end_stack_;
  std::vector<std::string> tag_stack_;
};

// ---------------------------------------------------------------------------
// Unknown filters and tests fail at parse time, except where jinja2 compiles
// them in a "soft" frame (the test and bodies of an if, an inline if),
// where they fail only if evaluated.

void CheckExpr(const Expr* e, bool soft) {
  if (e == nullptr) return;
  if (e->kind == ExprKind::kCondExpr) soft = true;
  if (!soft && e->kind == ExprKind::kFilter && !IsKnownFilter(e->name)) {
    SyntaxError(e->line, Cat("No filter named ", ReprString(e->name), "."));
  }
  if (!soft && e->kind == ExprKind::kTest && !IsKnownTest(e->name)) {
    SyntaxError(e->line, Cat("No test named ", ReprString(e->name), "."));
  }
  for (const auto& c : e->operands) CheckExpr(c.get(), soft);
  for (const auto& c : e->call.args) CheckExpr(c.get(), soft);
  for (const auto& [k, c] : e->call.kwargs) CheckExpr(c.get(), soft);
  CheckExpr(e->call.dyn_args.get(), soft);
  CheckExpr(e->call.dyn_kwargs.get(), soft);
}

void CheckBody(const Body& body, bool soft) {
  for (const auto& s : body) {
    switch (s->kind) {
      case StmtKind::kIf:
        for (const auto& [test, b] : s->branches) {
          CheckExpr(test.get(), true);
          CheckBody(b, true);
        }
        break;
      case StmtKind::kFor:
        CheckExpr(s->expr.get(), soft);
        CheckExpr(s->cond.get(), false);
        CheckBody(s->body, false);
        CheckBody(s->else_body, false);
        break;
      case StmtKind::kMacro:
        for (const auto& d : s->macro->defaults) CheckExpr(d.get(), false);
        CheckBody(s->macro->body, false);
        break;
      case StmtKind::kWith:
        for (const auto& v : s->with_values) CheckExpr(v.get(), soft);
        CheckBody(s->body, false);
        break;
      case StmtKind::kSetBlock:
      case StmtKind::kFilterBlock:
        CheckExpr(s->expr.get(), soft);
        CheckBody(s->body, false);
        break;
      case StmtKind::kScope:
        CheckBody(s->body, false);
        break;
      default:
        CheckExpr(s->expr.get(), soft);
        break;
    }
  }
}

}  // namespace

bool ComputeIsConst(const Expr& e) {
  if (e.kind == ExprKind::kConst) return true;
  bool is_const = e.kind != ExprKind::kName && e.kind != ExprKind::kCall;
  auto child_const = [&](const ExprPtr& c) {
    is_const = is_const && (c == nullptr || c->is_const);
  };
  for (const auto& c : e.operands) child_const(c);
  for (const auto& c : e.call.args) child_const(c);
  for (const auto& [k, c] : e.call.kwargs) child_const(c);
  child_const(e.call.dyn_args);
  child_const(e.call.dyn_kwargs);
  if (e.kind == ExprKind::kFilter) {
    // Filters that take the context (and unknown ones) are not folded.
    is_const = is_const && e.operands[0] != nullptr && IsKnownFilter(e.name) && e.name != "map" &&
               e.name != "select" && e.name != "reject" && e.name != "selectattr" &&
               e.name != "rejectattr" && e.name != "random";
  }
  if (e.kind == ExprKind::kTest) is_const = is_const && IsKnownTest(e.name);
  return is_const;
}

absl::StatusOr<std::shared_ptr<const Template>> ParseTemplate(std::string_view source) {
  try {
    Parser parser(Lex(source));
    auto tmpl = std::make_shared<Template>(parser.Parse());
    CheckBody(tmpl->body, false);
    FoldConstants(tmpl.get());
    return std::shared_ptr<const Template>(std::move(tmpl));
  } catch (const Error& e) {
    return absl::InvalidArgumentError(
        Cat("chat template syntax error, line ", e.line, ": ", e.message));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("chat template: out of memory while parsing");
  }
}

}  // namespace coalesce::chat::jinja
