// Printer: writes a module in the textual IR form that the parser reads back.
//
// Grammar (the parser in parser.cc follows it rule by rule):
//   module := 'module' name ['replicas' '=' INT] '{' stmt* '}'
//   stmt   := VALUE '=' OP [name] ['(' [VALUE (',' VALUE)*] ')'] ['{' attr (',' attr)* '}'] ':' type
//           | ('gradient' | 'assign') (name | VALUE) '=' VALUE
//           | 'output' name '=' VALUE
//   attr   := key '=' (INT | FLOAT | STRING | '[' INT,* ']' | '[' '[' INT,* ']',* ']')
//   type   := DTYPE '[' [INT (',' INT)*] ']'             e.g. f32[64,784], f32[] for a scalar
//   name   := '@' [A-Za-z0-9_./-]+ | '@' STRING          VALUE := '%' INT
// Operand parentheses are omitted for leaves, attribute braces when there are none. Floats always
// contain '.', 'e', "inf" or "nan", so 1.0 and 1 stay distinct; `//` starts a comment.
#include "ir/printer.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace shardstep::ir {
namespace {

bool IsBareNameChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '/' || c == '-';
}

bool IsIdentifier(const std::string& s) {
  if (s.empty() || !(std::isalpha(static_cast<unsigned char>(s[0])) || s[0] == '_')) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
  return true;
}

std::string PrintIntList(const IntList& l) {
  std::string out = "[";
  for (size_t i = 0; i < l.size(); ++i) out += (i ? "," : "") + std::to_string(l[i]);
  return out + "]";
}

std::string PrintValue(ValueId v) { return "%" + std::to_string(v); }

// A gradient/assign target: @name when that name finds this variable again, else its value id.
std::string PrintTarget(const Module& m, ValueId var) {
  if (var >= 0 && var < m.size() && !m.instrs[var].name.empty() && m.FindVariable(m.instrs[var].name) == var)
    return PrintName(m.instrs[var].name);
  return PrintValue(var);
}

}  // namespace

std::string PrintDouble(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), d);  // shortest text that round-trips
  std::string s(buf, end);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

std::string QuoteString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned char>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string PrintName(const std::string& name) {
  bool bare = !name.empty();
  for (char c : name) bare = bare && IsBareNameChar(c);
  return "@" + (bare ? name : QuoteString(name));
}

std::string PrintAttrValue(const AttrValue& v) {
  struct Visitor {
    std::string operator()(int64_t i) const { return std::to_string(i); }
    std::string operator()(double d) const { return PrintDouble(d); }
    std::string operator()(const std::string& s) const { return QuoteString(s); }
    std::string operator()(const IntList& l) const { return PrintIntList(l); }
    std::string operator()(const IntLists& ls) const {
      std::string out = "[";
      for (size_t i = 0; i < ls.size(); ++i) out += (i ? "," : "") + PrintIntList(ls[i]);
      return out + "]";
    }
  };
  return std::visit(Visitor{}, v);
}

std::string Print(const Module& m) {
  std::string out = "module " + PrintName(m.name) + " replicas=" + std::to_string(m.num_replicas) + " {\n";
  for (ValueId id = 0; id < m.size(); ++id) {
    const Instr& in = m.instrs[id];
    out += "  " + PrintValue(id) + " = " + OpName(in.op);
    if (!in.name.empty()) out += " " + PrintName(in.name);
    if (!in.operands.empty() || !HasProperty(in.op, kLeaf)) {
      out += "(";
      for (size_t i = 0; i < in.operands.size(); ++i) out += (i ? ", " : "") + PrintValue(in.operands[i]);
      out += ")";
    }
    if (!in.attrs.empty()) {
      out += " {";
      bool first = true;
      for (const auto& [key, value] : in.attrs) {
        out += (first ? "" : ", ") + (IsIdentifier(key) ? key : QuoteString(key)) + "=" + PrintAttrValue(value);
        first = false;
      }
      out += "}";
    }
    out += " : " + in.type.ToString() + "\n";
  }
  for (const auto& [var, g] : m.gradients) out += "  gradient " + PrintTarget(m, var) + " = " + PrintValue(g) + "\n";
  for (const auto& [var, v] : m.assigns) out += "  assign " + PrintTarget(m, var) + " = " + PrintValue(v) + "\n";
  for (const auto& [name, v] : m.outputs) out += "  output " + PrintName(name) + " = " + PrintValue(v) + "\n";
  return out + "}\n";
}

}  // namespace shardstep::ir
