// NonfiniteGuard: a step whose loss or any all-reduced gradient element is NaN or +-inf changes no
// state. Runs after optimizer-lowering (it reads the gradient entries and wraps the assignments) and
// before weight-update-sharder, which shards its reductions and selects like any other update op.
#pragma once

#include <string>

#include "ir/module.h"
#include "ir/passes/pass.h"

namespace shardstep::ir {

// Output names the guard adds (the trainer reads them).
inline constexpr const char* kStepFiniteOutput = "step_finite";      // f32[]: 1 applied, 0 skipped
inline constexpr const char* kGradCheckOutputPrefix = "grad_check/"; // + weight name: f32[], sum of the gradient

// Algorithm:
//  1. For each gradient entry (weight w, gradient g — the all-reduced one after data-parallel
//     lowering): c_w = reduce_sum(g), output as "grad_check/<w>" (for the diagnostic after a skipped
//     step), and z_w = c_w - c_w. A sum holding a NaN or +-inf is NaN or +-inf, and x - x is +0
//     exactly for finite x and NaN otherwise, so z_w is 0 when every element of g is finite and NaN
//     when one is not (or, harmlessly, when the finite elements' sum overflows: |sum g| > 3.4e38, far
//     past where a squared norm would already overflow). One read of g, no temporary (the JIT fuses
//     no reduction with its operand, so reduce_sum(g - g) would write and read a g-sized temporary).
//     The sharder turns the sum into a partial sum on the shard (zero padding is neutral) plus an
//     all-reduce of the scalar; the collective combiner packs those scalars into one all-reduce.
//  2. l = loss - loss; with more than one replica all_reduce(sum) of it, so every replica agrees.
//  3. ok = eq(l + sum_w z_w, 0): 1 when the step is finite, else 0. Output "step_finite" = ok.
//  4. Every assignment (var, new) becomes (var, select(broadcast(ok), new, var)): elementwise, so it
//     shards; the weights, the optimizer state and the step counter are left unchanged on a skipped
//     step (as optax.apply_if_finite and torch.cuda.amp.GradScaler: the step counter does not advance,
//     so bias corrections and the learning-rate schedule count applied updates only).
// When nothing is non-finite every select picks `new`, so results are bitwise those without the guard.
// Needs module.gradients and module.assigns; the output "loss" is checked when the module has it (an
// f32 scalar). A module already guarded (it has the output "step_finite") is left as it is.
class NonfiniteGuard : public Pass {
 public:
  std::string name() const override { return "nonfinite-guard"; }
  bool Run(Module& m) override;
};

}  // namespace shardstep::ir
