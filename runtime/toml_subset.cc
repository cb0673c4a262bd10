// The strict TOML-subset reader (runtime/toml_subset.h).
#include "runtime/toml_subset.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include "ir/error.h"

namespace shardstep::runtime {
namespace {

bool IsBareKeyChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}

std::string Shown(char c) {
  if (c == '\n') return "end of line";
  if (c == '\0') return "end of file";
  if (static_cast<unsigned char>(c) < 0x20) return Str("character 0x", std::hex, int(c));
  return Str("'", c, "'");
}

class Parser {
 public:
  Parser(const std::string& text, const std::string& path) : s_(text), path_(path) {
    if (s_.compare(0, 3, "\xEF\xBB\xBF") == 0) i_ = 3;  // UTF-8 byte-order mark
    out_.path = path;
  }

  ConfigFile Parse() {
    std::string table;
    std::map<std::string, int> table_lines;
    std::map<std::pair<std::string, std::string>, int> key_lines;
    for (;;) {
      SkipBlank();
      if (Peek() == '\0') break;
      if (Peek() == '\n') { Advance(); continue; }
      if (Peek() == '#') { SkipComment(); continue; }
      if (Peek() == '[') {
        const int line = line_;
        Advance();
        if (Peek() == '[') Fail("arrays of tables ([[...]]) are not supported");
        SkipBlank();
        std::string name = ParseKey("a table name after '['");
        SkipBlank();
        if (Peek() == '.') Fail(Str("dotted table names ([", name, ".…]) are not supported"));
        if (Peek() != ']') Fail(Str("expected ']' to close the table header, found ", Shown(Peek())));
        Advance();
        EndOfLine("after the table header");
        auto [it, fresh] = table_lines.emplace(name, line);
        if (!fresh) FailAt(line, Str("table [", name, "] is defined twice (first at line ", it->second, ")"));
        out_.tables.push_back({name, line});
        table = name;
        continue;
      }
      ConfigEntry e;
      e.line = line_;
      e.table = table;
      e.key = ParseKey("a key (name = value) or a table header ([name])");
      SkipBlank();
      if (Peek() == '.') Fail(Str("dotted keys (", e.key, ".…) are not supported"));
      if (Peek() != '=') Fail(Str("expected '=' after key '", e.key, "', found ", Shown(Peek())));
      Advance();
      SkipBlank();
      e.value = ParseValue(e.key, /*in_array=*/false);
      EndOfLine(Str("after the value of '", e.key, "'"));
      auto [it, fresh] = key_lines.emplace(std::pair{table, e.key}, e.line);
      if (!fresh)
        FailAt(e.line, Str("key '", e.key, "' is set twice", table.empty() ? "" : Str(" in [", table, "]"),
                           " (first at line ", it->second, ")"));
      out_.entries.push_back(std::move(e));
    }
    return std::move(out_);
  }

 private:
  char Peek(size_t ahead = 0) const { return i_ + ahead < s_.size() ? s_[i_ + ahead] : '\0'; }
  void Advance() {
    if (Peek() == '\n') ++line_;
    ++i_;
  }
  [[noreturn]] void Fail(const std::string& msg) const { FailAt(line_, msg); }
  [[noreturn]] void FailAt(int line, const std::string& msg) const { throw Error(Str(path_, ":", line, ": ", msg)); }

  void SkipBlank() {
    while (Peek() == ' ' || Peek() == '\t' || (Peek() == '\r' && Peek(1) == '\n')) ++i_;
  }
  void SkipComment() {
    while (Peek() != '\n' && Peek() != '\0') ++i_;
  }
  // Blanks, newlines and comments (inside arrays).
  void SkipSpace() {
    for (;;) {
      SkipBlank();
      if (Peek() == '#') SkipComment();
      if (Peek() != '\n') return;
      Advance();
    }
  }
  void EndOfLine(const std::string& where) {
    SkipBlank();
    if (Peek() == '#') SkipComment();
    if (Peek() == '\0') return;
    if (Peek() != '\n') Fail(Str("unexpected ", Shown(Peek()), " ", where, " (one key = value per line)"));
    Advance();
  }

  std::string ParseKey(const std::string& what) {
    if (Peek() == '"' || Peek() == '\'') {
      std::string k = ParseString();
      if (k.empty()) Fail("empty key");
      return k;
    }
    const size_t start = i_;
    while (IsBareKeyChar(Peek())) ++i_;
    if (i_ == start) Fail(Str("expected ", what, ", found ", Shown(Peek())));
    return s_.substr(start, i_ - start);
  }

  static void AppendUtf8(std::string* out, uint32_t cp) {
    if (cp < 0x80) {
      *out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      *out += static_cast<char>(0xC0 | (cp >> 6));
      *out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      *out += static_cast<char>(0xE0 | (cp >> 12));
      *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      *out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      *out += static_cast<char>(0xF0 | (cp >> 18));
      *out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      *out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  // A basic ("...", with escapes) or literal ('...') string on one line.
  std::string ParseString() {
    const char quote = Peek();
    if (Peek(1) == quote && Peek(2) == quote) Fail("multi-line strings are not supported");
    Advance();
    std::string out;
    for (;;) {
      const char c = Peek();
      if (c == '\0' || c == '\n' || (c == '\r' && Peek(1) == '\n'))
        Fail(Str("unterminated string: expected ", quote, " before the end of the line"));
      ++i_;
      if (c == quote) return out;
      if (c != '\\' || quote == '\'') {
        out += c;
        continue;
      }
      const char e = Peek();
      ++i_;
      switch (e) {
        case 'b': out += '\b'; break;
        case 't': out += '\t'; break;
        case 'n': out += '\n'; break;
        case 'f': out += '\f'; break;
        case 'r': out += '\r'; break;
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case 'u':
        case 'U': {
          const int digits = e == 'u' ? 4 : 8;
          uint32_t cp = 0;
          for (int k = 0; k < digits; ++k) {
            const char h = Peek();
            int v = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
            if (v < 0) Fail(Str("\\", e, " needs ", digits, " hexadecimal digits"));
            cp = cp * 16 + v;
            ++i_;
          }
          if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) Fail(Str("\\", e, " escape is not a Unicode scalar value"));
          AppendUtf8(&out, cp);
          break;
        }
        default:
          Fail(Str("unknown escape \\", e == '\0' || e == '\n' ? std::string() : std::string(1, e), " in a string"));
      }
    }
  }

  static bool Digits(const std::string& s, size_t b, size_t e) {  // digits with single '_' between them
    if (b >= e) return false;
    for (size_t k = b; k < e; ++k) {
      if (s[k] >= '0' && s[k] <= '9') continue;
      if (s[k] == '_' && k > b && k + 1 < e && s[k - 1] != '_' && s[k + 1] >= '0' && s[k + 1] <= '9') continue;
      return false;
    }
    return true;
  }

  // Integers and floats as TOML writes them (decimal only); returns the kind, or false.
  static bool ParseNumber(const std::string& t, ConfigValue* v) {
    size_t b = (t[0] == '+' || t[0] == '-') ? 1 : 0;
    const std::string body = t.substr(b);
    if (body == "inf" || body == "nan") {
      v->kind = ConfigValue::Kind::kFloat;
      v->text = t;
      return true;
    }
    size_t dot = t.find('.', b), exp = t.find_first_of("eE", b);
    size_t int_end = std::min(dot, exp);
    if (int_end == std::string::npos) int_end = t.size();
    if (!Digits(t, b, int_end)) return false;
    if (int_end - b > 1 && t[b] == '0') return false;  // leading zeros
    if (dot != std::string::npos) {
      const size_t frac_end = exp == std::string::npos ? t.size() : exp;
      if (dot > exp || !Digits(t, dot + 1, frac_end)) return false;
    }
    if (exp != std::string::npos) {
      size_t eb = exp + 1;
      if (eb < t.size() && (t[eb] == '+' || t[eb] == '-')) ++eb;
      if (!Digits(t, eb, t.size())) return false;
    }
    v->kind = dot == std::string::npos && exp == std::string::npos ? ConfigValue::Kind::kInteger : ConfigValue::Kind::kFloat;
    v->text.clear();
    for (char c : t)
      if (c != '_') v->text += c;
    return true;
  }

  ConfigValue ParseValue(const std::string& key, bool in_array) {
    ConfigValue v;
    const char c = Peek();
    if (c == '"' || c == '\'') {
      v.kind = ConfigValue::Kind::kString;
      v.text = ParseString();
      return v;
    }
    if (c == '[') {
      if (in_array) Fail(Str("nested arrays are not supported (value of '", key, "')"));
      const int open_line = line_;
      Advance();
      v.kind = ConfigValue::Kind::kArray;
      for (;;) {
        SkipSpace();
        if (Peek() == ']') break;
        if (Peek() == '\0') FailAt(open_line, Str("unterminated array: '[' of '", key, "' is never closed"));
        v.items.push_back(ParseValue(key, true));
        SkipSpace();
        if (Peek() == ',') {
          Advance();
          continue;
        }
        if (Peek() == ']') break;
        if (Peek() == '\0') FailAt(open_line, Str("unterminated array: '[' of '", key, "' is never closed"));
        Fail(Str("expected ',' or ']' in the array of '", key, "', found ", Shown(Peek())));
      }
      Advance();
      return v;
    }
    if (c == '{') Fail(Str("inline tables ({...}) are not supported (value of '", key, "')"));
    const size_t start = i_;
    while (Peek() != '\0' && Peek() != '\n' && Peek() != ' ' && Peek() != '\t' && Peek() != '\r' && Peek() != '#' &&
           Peek() != ',' && Peek() != ']')
      ++i_;
    const std::string t = s_.substr(start, i_ - start);
    if (t.empty()) Fail(Str("expected a value for '", key, "', found ", Shown(Peek())));
    if (t == "true" || t == "false") {
      v.kind = ConfigValue::Kind::kBool;
      v.text = t;
      return v;
    }
    if (ParseNumber(t, &v)) return v;
    i_ = start;
    Fail(Str("invalid value ", t, " for '", key, "' (strings need quotes: \"", t, "\"; numbers are decimal; booleans are true or false)"));
  }

  const std::string& s_;
  std::string path_;
  size_t i_ = 0;
  int line_ = 1;
  ConfigFile out_;
};

}  // namespace

ConfigFile ParseConfig(const std::string& text, const std::string& path) { return Parser(text, path).Parse(); }

ConfigFile ReadConfigFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(Str("cannot read config file ", path, ": ", std::strerror(errno)));
  std::ostringstream os;
  os << in.rdbuf();
  if (in.bad()) throw Error(Str("cannot read config file ", path, ": ", std::strerror(errno)));
  return ParseConfig(os.str(), path);
}

}  // namespace shardstep::runtime
