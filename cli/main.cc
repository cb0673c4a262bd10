// The `shardstep` command: train a built-in model; compile one and print any pipeline stage, or run
// passes on IR text; run an IR module on safetensors inputs. Every failure is one line on stderr and
// exit status 1 (2 for a bad command line), never a crash.
#include <CLI/CLI.hpp>
#include <cxxabi.h>

#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <new>
#include <regex>
#include <typeinfo>

#include "cli/commands.h"
#include "cli/config_file.h"
#include "ir/error.h"
#include "runtime/stop_signal.h"

using namespace shardstep;

namespace {

// One line: located messages ("FILE:LINE[:COL]: ...") as compilers print them, the rest after the
// program's name.
void PrintError(std::string msg) {
  for (char& c : msg)
    if (c == '\n') c = ' ';
  while (!msg.empty() && msg.back() == ' ') msg.pop_back();
  std::smatch m;
  static const std::regex located(R"(^([^\s:]+:\d+(:\d+)?): (error: )?)");
  if (std::regex_search(msg, m, located))
    std::cerr << m[1].str() << ": error: " << m.suffix().str() << "\n";
  else
    std::cerr << "shardstep: error: " << msg << "\n";
}

std::string TypeName(const std::type_info& t) {
  int status = 0;
  char* name = abi::__cxa_demangle(t.name(), nullptr, nullptr, &status);
  std::string s = status == 0 && name ? name : t.name();
  std::free(name);
  return s;
}

int Main(int argc, char** argv) {
  CLI::App app{"shardstep: a C++ training framework with automatic cross-replica sharding of the weight update"};
  app.require_subcommand(1);
  std::map<CLI::App*, cli::Command> commands;
  std::map<CLI::App*, std::string> config_paths;
  for (auto add : {cli::AddTrainCommand, cli::AddCompileCommand, cli::AddRunCommand,
                   cli::AddSimulateCommand /* TPU pod step-time simulator */, cli::AddCheckMllogCommand}) {
    cli::Command command = add(app);
    // Scripted runs: `shardstep train --config run.toml` reads the file's [train] table; flags given
    // on the command line win over the file.
    command.app->add_option("--config", config_paths[command.app],
                            "read flags from this TOML file: its [" + command.app->get_name() +
                                "] table, key = value per flag (the command line wins)");
    commands.emplace(command.app, std::move(command));
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }
  for (CLI::App* sub : app.get_subcommands()) {
    const std::string& path = config_paths.at(sub);
    if (!path.empty()) cli::ApplyConfig(cli::ReadConfigFile(path), app, *sub);
    return commands.at(sub).run();
  }
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    runtime::StartStopSignalWatcher();  // before any thread: no compute thread takes SIGTERM / SIGINT
    return Main(argc, argv);
  } catch (const Error& e) {
    PrintError(e.what());
  } catch (const std::bad_alloc&) {
    PrintError("out of memory (an allocation failed; --replicas, --batch or the model are too large for this machine)");
  } catch (const std::exception& e) {
    PrintError(Str(e.what(), " (", TypeName(typeid(e)), ")"));
  } catch (...) {
    PrintError("unknown exception");
  }
  return 1;
}
