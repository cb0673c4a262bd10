// Autodiff: reverse-mode differentiation of the scalar loss with respect to every weight variable.
#pragma once

#include <string>

#include "ir/passes/pass.h"

namespace shardstep::ir {

// Appends d loss / d w for every variable w with role "weight" and records it in module.gradients
// (a zero constant when the loss does not depend on w), then canonicalizes the module.
// Throws shardstep::Error when the loss output is missing or not a scalar f32, when gradients were
// already recorded, or when a collective lies between a weight and the loss.
class Autodiff : public Pass {
 public:
  explicit Autodiff(std::string loss_output = "loss") : loss_(std::move(loss_output)) {}
  std::string name() const override { return "autodiff"; }
  bool Run(Module& module) override;

 private:
  std::string loss_;
};

}  // namespace shardstep::ir
