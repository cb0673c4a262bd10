// MixedPrecision (`--precision bf16`): the inputs of every matmul and convolution (forward and the
// backward ones autodiff made) are rounded to bf16 and the products accumulate in f32 — what a TPU's
// matrix unit does. Everything else stays f32: weights, optimizer state, gradient sums, collectives.
#pragma once

#include <string>

#include "ir/module.h"
#include "ir/passes/pass.h"

namespace shardstep::ir {

// Precision of the matrix-unit operands: "f32" (no pass) or "bf16". Throws shardstep::Error naming
// `flag` for any other value.
bool ParsePrecision(const std::string& value, const std::string& flag = "--precision");

// Algorithm (runs after autodiff, so the backward matmuls and convolution gradients are there):
//  1. For each matmul, conv2d, conv2d_input_grad and conv2d_filter_grad with f32 operands, each
//     operand x becomes convert(convert(x, bf16), f32): x rounded to nearest even, widened back
//     exactly. One rounding per distinct operand value (a value read by several contractions is
//     rounded once).
//  2. The contraction itself is unchanged (f32 operands holding bf16 values, f32 result), so the
//     CPU backend keeps its sgemm / oneDNN kernels and the f32 accumulation; the elementwise fuser
//     puts each convert pair in a loop of its own or with its neighbours.
//  3. Canonicalize (the converts were appended).
// Why round instead of typing the contraction bf16: the result must stay f32 (f32 accumulation), and
// the weights the optimizer updates must stay f32; only the operands the multiplier sees are bf16.
// An operand already rounded (the output of convert to bf16 and back) is left alone, so the pass is
// idempotent.
class MixedPrecision : public Pass {
 public:
  std::string name() const override { return "mixed-precision"; }
  bool Run(Module& m) override;
};

}  // namespace shardstep::ir
