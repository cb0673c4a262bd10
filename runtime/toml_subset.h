// A strict reader for the subset of TOML that shardstep's own files use (`--config` files, the TPU
// hardware tables). Every problem is a shardstep::Error "FILE:LINE: message".
//
// The subset: `[table]` headers (bare names), `key = value` lines with a bare or quoted key, values
// that are strings ("basic" with escapes, or 'literal'), integers, floats, booleans, or arrays of
// those (on one or several lines, trailing comma allowed); `#` comments; blank lines. Everything else
// TOML has (dotted keys, inline tables, multi-line strings, dates, arrays of tables) is an error that
// says it is not supported, never silently skipped.
#pragma once

#include <string>
#include <vector>

namespace shardstep::runtime {

struct ConfigValue {
  enum class Kind { kString, kInteger, kFloat, kBool, kArray };
  Kind kind = Kind::kString;
  std::string text;                // the value as a flag would spell it (strings unquoted and unescaped)
  std::vector<ConfigValue> items;  // kArray only (scalars; nested arrays are rejected)
};

struct ConfigEntry {
  std::string table;  // "" for keys before the first table header
  std::string key;
  ConfigValue value;
  int line = 0;
};

struct ConfigTable {
  std::string name;
  int line = 0;
};

struct ConfigFile {
  std::string path;
  std::vector<ConfigTable> tables;
  std::vector<ConfigEntry> entries;  // in file order
};

// Parses `text` (the contents of `path`, used in messages). Rejects bad syntax, duplicate tables and
// duplicate keys within a table.
ConfigFile ParseConfig(const std::string& text, const std::string& path);
// Reads and parses the file at `path` ("cannot read FILE: reason" when it cannot be read).
ConfigFile ReadConfigFile(const std::string& path);

}  // namespace shardstep::runtime
