// Pass: the interface every IR-to-IR transformation implements (a pipeline runs them in order).
#pragma once

#include <string>

#include "ir/module.h"

namespace shardstep::ir {

class Pass {
 public:
  virtual ~Pass() = default;
  // Kebab-case name used to dump after / disable the pass ("autodiff", "weight-update-sharder").
  virtual std::string name() const = 0;
  // Transforms `module` in place; returns whether anything changed.
  virtual bool Run(Module& module) = 0;
};

}  // namespace shardstep::ir
