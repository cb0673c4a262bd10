// --config files applied to CLI11 flags (the reader is runtime/toml_subset.cc).
#include "cli/config_file.h"

#include <CLI/CLI.hpp>

#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include "ir/error.h"

namespace shardstep::cli {

// From cli/flags.h, declared here instead of including it: flags.h pulls in the DSL, and this file
// must also compile on its own (the config-file fuzz target, built with clang 14, which lacks
// std::source_location).
std::string ClosestMatch(const std::string& word, const std::vector<std::string>& candidates);

namespace {

std::string KindName(const ConfigValue& v) {
  switch (v.kind) {
    case ConfigValue::Kind::kString: return "a string";
    case ConfigValue::Kind::kInteger: return "an integer";
    case ConfigValue::Kind::kFloat: return "a float";
    case ConfigValue::Kind::kBool: return "a boolean";
    case ConfigValue::Kind::kArray: return "an array";
  }
  return "a value";
}

// The long names (without "--") of a command's configurable flags.
std::vector<std::string> KeysOf(CLI::App& command) {
  std::vector<std::string> keys;
  for (const CLI::Option* op : command.get_options())
    for (const std::string& n : op->get_lnames())
      if (n != "help" && n != "config") keys.push_back(n);
  return keys;
}

}  // namespace


void ApplyConfig(const ConfigFile& file, CLI::App& app, CLI::App& command) {
  auto fail = [&](int line, const std::string& msg) { throw Error(Str(file.path, ":", line, ": ", msg)); };
  std::map<std::string, CLI::App*> commands;
  std::vector<std::string> names;
  std::string listing;
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    commands[sub->get_name()] = sub;
    names.push_back(sub->get_name());
    listing += Str(listing.empty() ? "" : ", ", "[", sub->get_name(), "]");
  }
  for (const ConfigTable& t : file.tables) {
    if (commands.count(t.name)) continue;
    const std::string near = ClosestMatch(t.name, names);
    fail(t.line, Str("unknown table [", t.name, "]", near.empty() ? "" : Str(" (did you mean [", near, "]?)"),
                     "; a table names a command: ", listing));
  }
  for (const ConfigEntry& e : file.entries) {
    if (e.table.empty())
      fail(e.line, Str("key '", e.key, "' is outside a table; put it under the table of its command (", listing, ")"));
    CLI::App* sub = commands.at(e.table);
    CLI::Option* op = e.key == "help" || e.key == "config" || e.key.rfind("-", 0) == 0
                          ? nullptr
                          : sub->get_option_no_throw("--" + e.key);
    if (op == nullptr || op->get_lnames().empty()) {
      const std::string near = ClosestMatch(e.key, KeysOf(*sub));
      fail(e.line, Str("unknown key '", e.key, "' in [", e.table, "]",
                       near.empty() ? Str(" (the keys are the long flags of `shardstep ", e.table, " --help`, without --)")
                                    : Str(" (did you mean '", near, "'?)")));
    }
    const bool is_switch = op->get_expected_min() == 0;
    if (is_switch && e.value.kind != ConfigValue::Kind::kBool)
      fail(e.line, Str("'", e.key, "' is a switch: use true or false, got ", KindName(e.value)));
    if (e.value.kind == ConfigValue::Kind::kArray && op->get_items_expected_max() <= 1)
      fail(e.line, Str("'", e.key, "' takes one value, got an array"));
    if (sub != &command || op->count() > 0) continue;  // another command's table; or the command line wins
    std::vector<std::string> inputs;
    if (e.value.kind == ConfigValue::Kind::kArray) {
      for (const ConfigValue& item : e.value.items) inputs.push_back(item.text);
      if (inputs.empty()) continue;  // an empty list keeps the default
    } else {
      inputs.push_back(e.value.text);
    }
    try {
      op->add_result(inputs);
      op->run_callback();
    } catch (const CLI::Error& err) {
      fail(e.line, err.what());
    }
  }
}

}  // namespace shardstep::cli
