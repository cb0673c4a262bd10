// --backend of `train` and `run`: a name from the backend registry (api/session.h), the one place that
// maps a name to an executor; an unknown name lists the known ones.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "api/session.h"

namespace shardstep::cli {

inline CLI::Validator BackendNameValidator() {
  std::string names;
  for (const std::string& n : BackendNames()) names += (names.empty() ? "" : "|") + n;
  return CLI::Validator(
      [](std::string& s) -> std::string {
        try {
          FindBackend(s);
        } catch (const Error& e) {
          return e.what();
        }
        return "";
      },
      "BACKEND (" + names + ")");
}

}  // namespace shardstep::cli
