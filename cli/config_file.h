// Config files (`--config FILE`): read by the strict TOML-subset reader (runtime/toml_subset.h) and
// applied to a command's flags. Every problem is a shardstep::Error "FILE:LINE: message".
#pragma once

#include <string>
#include <vector>

#include "runtime/toml_subset.h"

namespace CLI {
class App;
}

namespace shardstep::cli {

using runtime::ConfigEntry;
using runtime::ConfigFile;
using runtime::ConfigTable;
using runtime::ConfigValue;
using runtime::ParseConfig;
using runtime::ReadConfigFile;

// Checks every table of `file` against the subcommands of `app` (a table names a subcommand; its keys
// are that subcommand's long flags without "--") and every key against its table, with "did you
// mean" suggestions; then sets each flag of `command`'s table that the command line did not give
// (the command line wins), through the flag's own validators.
void ApplyConfig(const ConfigFile& file, CLI::App& app, CLI::App& command);

}  // namespace shardstep::cli
