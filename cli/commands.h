// The `shardstep` subcommands. Each Add*Command adds its subcommand and flags to `app`.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>

namespace shardstep::cli {

// A subcommand and what runs it once the command line (and any --config file) has been parsed.
struct Command {
  CLI::App* app;
  std::function<int()> run;
};

Command AddTrainCommand(CLI::App& app);    // train a built-in model (cli/train_command.cc)
Command AddCompileCommand(CLI::App& app);  // build or read a step module, run passes, print (cli/compile_command.cc)
Command AddRunCommand(CLI::App& app);      // run an IR module on safetensors inputs (cli/run_command.cc)
// TPU pod step-time simulator (issue 10, part 6)
Command AddSimulateCommand(CLI::App& app);  // simulate a step on a TPU mesh (cli/simulate_command.cc)
Command AddCheckMllogCommand(CLI::App& app);  // check MLPerf training logs (cli/check_mllog_command.cc)

}  // namespace shardstep::cli
