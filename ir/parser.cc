// Parser: recursive descent over a small line/column-tracking lexer; the grammar is in printer.cc.
#include "ir/parser.h"

#include <cctype>
#include <charconv>
#include <cstdio>
#include <limits>

#include "ir/error.h"
#include "ir/shape_inference.h"

namespace shardstep::ir {
namespace {

enum class Tok {
  kEnd,
  kIdent,   // module, op and dtype names, keywords, attribute keys, inf, nan
  kValue,   // %12
  kName,    // @fc1.w or @"any text"; `text` holds the name
  kInt,     // -12
  kFloat,   // 0.5, 1e-3, -inf
  kString,  // "..."; `text` holds the unescaped contents
  kPunct,   // ( ) { } [ ] , = :
};

struct Token {
  Tok kind = Tok::kEnd;
  std::string text;      // decoded text (see Tok)
  std::string spelling;  // as written, for error messages
  int line = 1, col = 1;
};

class Parser {
 public:
  Parser(const std::string& text, const std::string& filename) : src_(text), file_(filename) { tok_ = Lex(); }

  Module ParseModule() {
    if (!IsIdent("module")) Fail(tok_, "expected 'module' at start of input, found " + Found(tok_));
    Take();
    m_.name = ExpectName("module name");
    if (IsIdent("replicas")) {
      Take();
      Expect("=", "after 'replicas'");
      Token t = tok_;
      int64_t n = ExpectInt("number of replicas");
      if (n < std::numeric_limits<int>::min() || n > std::numeric_limits<int>::max())
        Fail(t, "number of replicas out of range");
      m_.num_replicas = static_cast<int>(n);
    }
    Expect("{", "to open the module body");
    while (!IsPunct("}")) ParseStatement();
    Take();
    if (tok_.kind != Tok::kEnd) Fail(tok_, "unexpected " + Found(tok_) + " after the end of the module");
    return std::move(m_);
  }

 private:
  // ---- Statements ----

  void ParseStatement() {
    if (tok_.kind == Tok::kValue) return ParseInstr();
    if (IsIdent("gradient") || IsIdent("assign")) {
      bool gradient = tok_.text == "gradient";
      std::string what = tok_.text;
      Take();
      ValueId var = ParseTarget(what);
      Expect("=", "after the " + what + " target");
      ValueId v = ExpectDefinedValue(what + " value");
      (gradient ? m_.gradients : m_.assigns).emplace_back(var, v);
      return;
    }
    if (IsIdent("output")) {
      Take();
      std::string name = ExpectName("output name");
      Expect("=", "after the output name");
      m_.outputs.emplace_back(name, ExpectDefinedValue("output value"));
      return;
    }
    if (tok_.kind == Tok::kEnd) Fail(tok_, "expected '}' at end of module, found end of input");
    Fail(tok_, "expected an instruction (%N = ...), 'gradient', 'assign', 'output' or '}', found " + Found(tok_));
  }

  // %N = op [@name] [(operands)] [{attrs}] : type
  void ParseInstr() {
    Token start = Take();
    ValueId id = ValueNumber(start);
    if (id < m_.size()) Fail(start, Str("value %", id, " defined twice"));
    if (id > m_.size()) Fail(start, Str("expected %", m_.size(), " (values must be numbered in order)"));
    Expect("=", "after " + start.spelling);

    Instr in;
    Token op = tok_;
    if (op.kind != Tok::kIdent) Fail(op, "expected an op name, found " + Found(op));
    if (!ParseOpCode(op.text, &in.op)) Fail(op, "unknown op '" + op.text + "'");
    Take();
    if (tok_.kind == Tok::kName) in.name = Take().text;
    if (IsPunct("(")) {
      Take();
      while (!IsPunct(")")) {
        in.operands.push_back(ExpectDefinedValue("operand"));
        if (IsPunct(",")) Take();
        else if (!IsPunct(")")) Fail(tok_, "expected ',' or ')' after operand, found " + Found(tok_));
      }
      Take();
    }
    if (IsPunct("{")) ParseAttrs(&in.attrs);
    Expect(":", "and the result type of " + op.text);
    Token type_tok = tok_;
    in.type = ParseType();

    int arity = OpArity(in.op), n = static_cast<int>(in.operands.size());
    if (arity >= 0 && n != arity)
      Fail(op, Str(op.text, " takes ", arity, " operand", arity == 1 ? "" : "s", ", got ", n));
    if (arity < 0 && n < 1) Fail(op, Str(op.text, " takes at least 1 operand, got 0"));
    std::vector<TensorType> operand_types;
    for (ValueId o : in.operands) operand_types.push_back(m_.type(o));
    TensorType inferred;
    try {
      inferred = InferType(in.op, operand_types, in.attrs, &in.type);
    } catch (const Error& e) {
      Fail(start, e.what());
    }
    if (inferred != in.type) {
      std::string args;
      for (size_t i = 0; i < operand_types.size(); ++i) args += (i ? ", " : "") + operand_types[i].ToString();
      Fail(type_tok, Str("type mismatch: ", op.text, "(", args, ") has type ", inferred.ToString(), ", written ",
                         in.type.ToString()));
    }
    m_.Append(std::move(in));
  }

  // gradient/assign target: @variable or %N.
  ValueId ParseTarget(const std::string& what) {
    if (tok_.kind == Tok::kValue) return ExpectDefinedValue(what + " target");
    if (tok_.kind != Tok::kName) Fail(tok_, "expected a variable (@name) after '" + what + "', found " + Found(tok_));
    Token t = Take();
    ValueId var = m_.FindVariable(t.text);
    if (var == kNoValue) Fail(t, "unknown variable " + t.spelling + " in " + what);
    return var;
  }

  void ParseAttrs(Attrs* attrs) {
    Take();  // {
    while (!IsPunct("}")) {
      Token key = tok_;
      if (key.kind != Tok::kIdent && key.kind != Tok::kString)
        Fail(key, "expected an attribute name, found " + Found(key));
      Take();
      if (attrs->count(key.text)) Fail(key, "duplicate attribute '" + key.text + "'");
      Expect("=", "after attribute name '" + key.text + "'");
      (*attrs)[key.text] = ParseAttrValue();
      if (IsPunct(",")) Take();
      else if (!IsPunct("}")) Fail(tok_, "expected ',' or '}' after attribute, found " + Found(tok_));
    }
    Take();
  }

  AttrValue ParseAttrValue() {
    Token t = tok_;
    if (t.kind == Tok::kInt) return ExpectInt("integer");
    if (t.kind == Tok::kString) return Take().text;
    if (t.kind == Tok::kFloat || (t.kind == Tok::kIdent && (t.text == "inf" || t.text == "nan"))) {
      Take();
      return ParseFloat(t);
    }
    if (!IsPunct("[")) Fail(t, "expected an attribute value (integer, float, string or list), found " + Found(t));
    Take();
    if (!IsPunct("[")) return ParseIntListRest();
    IntLists lists;
    while (true) {
      Expect("[", "to open an inner list");
      lists.push_back(ParseIntListRest());
      if (IsPunct("]")) break;
      if (!IsPunct(",")) Fail(tok_, "expected ',' or ']' after inner list, found " + Found(tok_));
      Take();
    }
    Take();
    return lists;
  }

  // After '[': INT (',' INT)* ']' or just ']'.
  IntList ParseIntListRest() {
    IntList list;
    while (!IsPunct("]")) {
      list.push_back(ExpectInt("integer or ']' in list"));
      if (IsPunct(",")) Take();
      else if (!IsPunct("]")) Fail(tok_, "expected ',' or ']' in list, found " + Found(tok_));
    }
    Take();
    return list;
  }

  TensorType ParseType() {
    TensorType type;
    Token t = tok_;
    if (t.kind != Tok::kIdent) Fail(t, "expected a type such as f32[2,3], found " + Found(t));
    if (!ParseDType(t.text, &type.dtype)) Fail(t, "unknown dtype '" + t.text + "'");
    Take();
    Expect("[", "after dtype " + t.text);
    while (!IsPunct("]")) {
      Token d = tok_;
      type.shape.push_back(ExpectInt("dimension size"));
      if (type.shape.back() < 0) Fail(d, "negative dimension " + d.text);
      if (IsPunct(",")) Take();
      else if (!IsPunct("]")) Fail(tok_, "expected ',' or ']' in shape, found " + Found(tok_));
    }
    Take();
    return type;
  }

  // ---- Token helpers ----

  bool IsPunct(const char* p) const { return tok_.kind == Tok::kPunct && tok_.text == p; }
  bool IsIdent(const char* s) const { return tok_.kind == Tok::kIdent && tok_.text == s; }

  Token Take() {
    Token t = std::move(tok_);
    tok_ = Lex();
    return t;
  }

  static std::string Found(const Token& t) { return t.kind == Tok::kEnd ? "end of input" : "'" + t.spelling + "'"; }

  void Expect(const char* punct, const std::string& context) {
    if (!IsPunct(punct)) Fail(tok_, Str("expected '", punct, "' ", context, ", found ", Found(tok_)));
    Take();
  }

  std::string ExpectName(const std::string& what) {
    if (tok_.kind != Tok::kName) Fail(tok_, "expected " + what + " (@name), found " + Found(tok_));
    return Take().text;
  }

  int64_t ExpectInt(const std::string& what) {
    if (tok_.kind != Tok::kInt) Fail(tok_, "expected " + what + ", found " + Found(tok_));
    Token t = Take();
    int64_t v = 0;
    auto [end, ec] = std::from_chars(t.text.data(), t.text.data() + t.text.size(), v);
    if (ec != std::errc() || end != t.text.data() + t.text.size()) Fail(t, "integer " + t.text + " out of range");
    return v;
  }

  double ParseFloat(const Token& t) {
    if (t.text == "inf") return std::numeric_limits<double>::infinity();
    if (t.text == "-inf") return -std::numeric_limits<double>::infinity();
    if (t.text == "nan") return std::numeric_limits<double>::quiet_NaN();
    double v = 0;
    auto [end, ec] = std::from_chars(t.text.data(), t.text.data() + t.text.size(), v);
    if (ec != std::errc() || end != t.text.data() + t.text.size()) Fail(t, "float " + t.text + " out of range");
    return v;
  }

  ValueId ValueNumber(const Token& t) {
    int64_t v = -1;
    auto [end, ec] = std::from_chars(t.text.data() + 1, t.text.data() + t.text.size(), v);
    if (ec != std::errc() || v > std::numeric_limits<ValueId>::max())
      Fail(t, "value number " + t.text + " out of range");
    return static_cast<ValueId>(v);
  }

  ValueId ExpectDefinedValue(const std::string& what) {
    if (tok_.kind != Tok::kValue) Fail(tok_, "expected " + what + " (%N), found " + Found(tok_));
    Token t = Take();
    ValueId v = ValueNumber(t);
    if (v >= m_.size()) Fail(t, "use of undefined value " + t.text);
    return v;
  }

  [[noreturn]] void Fail(int line, int col, const std::string& msg) const {
    throw Error(Str(file_, ":", line, ":", col, ": error: ", msg));
  }
  [[noreturn]] void Fail(const Token& t, const std::string& msg) const { Fail(t.line, t.col, msg); }

  // ---- Lexer ----

  char At(size_t i) const { return i < src_.size() ? src_[i] : '\0'; }
  bool AtEnd() const { return pos_ >= src_.size(); }
  void Advance() {
    if (src_[pos_++] == '\n') {
      ++line_;
      col_ = 1;
    } else {
      ++col_;
    }
  }
  static bool IsIdentStart(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
  static bool IsIdentChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }
  static bool IsDigit(char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; }
  static bool IsNameChar(char c) { return IsIdentChar(c) || c == '.' || c == '/' || c == '-'; }

  // Consumes characters while `pred` holds; returns them.
  template <typename Pred>
  std::string TakeWhile(Pred pred) {
    size_t begin = pos_;
    while (!AtEnd() && pred(src_[pos_])) Advance();
    return src_.substr(begin, pos_ - begin);
  }

  Token Lex() {
    while (!AtEnd()) {  // skip blanks and // comments
      if (std::isspace(static_cast<unsigned char>(src_[pos_]))) Advance();
      else if (src_[pos_] == '/' && At(pos_ + 1) == '/') TakeWhile([](char c) { return c != '\n'; });
      else break;
    }
    Token t;
    t.line = line_;
    t.col = col_;
    size_t begin = pos_;
    auto finish = [&](Tok kind, std::string text) {
      t.kind = kind;
      t.text = std::move(text);
      t.spelling = src_.substr(begin, pos_ - begin);
      return t;
    };
    if (AtEnd()) return t;
    char c = src_[pos_];
    if (c == '%') {
      Advance();
      if (!IsDigit(At(pos_))) Fail(t, "expected a value number after '%'");
      TakeWhile(IsDigit);
      return finish(Tok::kValue, src_.substr(begin, pos_ - begin));
    }
    if (c == '@') {
      Advance();
      if (At(pos_) == '"') return finish(Tok::kName, LexString());
      std::string name = TakeWhile(IsNameChar);
      if (name.empty()) Fail(t, "expected a name after '@'");
      return finish(Tok::kName, name);
    }
    if (c == '"') return finish(Tok::kString, LexString());
    if (IsIdentStart(c)) return finish(Tok::kIdent, TakeWhile(IsIdentChar));
    if (c == '-' && IsIdentStart(At(pos_ + 1))) {  // -inf
      Advance();
      std::string word = TakeWhile(IsIdentChar);
      if (word != "inf") Fail(t, "unexpected '-" + word + "'");
      return finish(Tok::kFloat, "-inf");
    }
    if (IsDigit(c) || (c == '-' && IsDigit(At(pos_ + 1)))) {
      bool is_float = false;
      Advance();
      TakeWhile(IsDigit);
      if (At(pos_) == '.') {
        is_float = true;
        Advance();
        TakeWhile(IsDigit);
      }
      if ((At(pos_) == 'e' || At(pos_) == 'E') &&
          (IsDigit(At(pos_ + 1)) || ((At(pos_ + 1) == '-' || At(pos_ + 1) == '+') && IsDigit(At(pos_ + 2))))) {
        is_float = true;
        Advance();
        if (src_[pos_] == '+') {  // from_chars takes no '+'
          std::string text = src_.substr(begin, pos_ - begin);
          Advance();
          text += TakeWhile(IsDigit);
          return finish(Tok::kFloat, text);
        }
        Advance();
        TakeWhile(IsDigit);
      }
      return finish(is_float ? Tok::kFloat : Tok::kInt, src_.substr(begin, pos_ - begin));
    }
    if (std::string("(){}[],=:").find(c) != std::string::npos) {
      Advance();
      return finish(Tok::kPunct, std::string(1, c));
    }
    char shown[8];
    if (std::isprint(static_cast<unsigned char>(c))) std::snprintf(shown, sizeof(shown), "%c", c);
    else std::snprintf(shown, sizeof(shown), "\\x%02x", static_cast<unsigned char>(c));
    Fail(t, Str("unexpected character '", shown, "'"));
  }

  // At an opening '"': returns the unescaped contents and consumes the closing '"'.
  std::string LexString() {
    int line = line_, col = col_;
    Advance();
    std::string out;
    while (true) {
      if (AtEnd() || src_[pos_] == '\n') Fail(line, col, "unterminated string");
      char c = src_[pos_];
      if (c == '"') {
        Advance();
        return out;
      }
      if (c != '\\') {
        out += c;
        Advance();
        continue;
      }
      int esc_col = col_;
      Advance();
      char e = At(pos_);
      if (e == '"' || e == '\\') out += e;
      else if (e == 'n') out += '\n';
      else if (e == 't') out += '\t';
      else if (e == 'x' && std::isxdigit(static_cast<unsigned char>(At(pos_ + 1))) &&
               std::isxdigit(static_cast<unsigned char>(At(pos_ + 2)))) {
        out += static_cast<char>(std::stoi(src_.substr(pos_ + 1, 2), nullptr, 16));
        Advance();
        Advance();
      } else {
        Fail(line_, esc_col, "unknown escape sequence in string");
      }
      Advance();
    }
  }

  const std::string& src_;
  std::string file_;
  size_t pos_ = 0;
  int line_ = 1, col_ = 1;
  Token tok_;
  Module m_;
};

}  // namespace

Module Parse(const std::string& text, const std::string& filename) {
  return Parser(text, filename).ParseModule();
}

}  // namespace shardstep::ir
