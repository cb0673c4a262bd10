// Counting a module's cost: parameters, floating-point operations per op (from the IR's shapes), and the
// activation memory a training step keeps from its forward pass for its backward pass.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "ir/module.h"

namespace shardstep::ir {

// FLOPs of one instruction of `m`:
//   matmul               2 * M * N * K per batch element (2 * output elements * K)
//   conv2d               2 * (Cin * kh * kw) per output element; its input and filter gradients the same
//                        as the convolution they differentiate (2 * dy elements * Cin * kh * kw)
//   max/avg pool (grad)  kh * kw per output (dy) element
//   elementwise          1 per output element (compares, select and convert included)
//   reductions           1 per input element
//   scatter_add          1 per update element
//   everything else      0: data movement (broadcast, reshape, transpose, slice, pad, concat, gather,
//                        one_hot), leaves, random numbers and collectives (communication, not arithmetic)
int64_t InstrFlops(const Module& m, ValueId v);

struct FlopCount {
  int64_t total = 0;
  std::map<std::string, int64_t> by_op;  // op mnemonic -> FLOPs
};
// Every instruction of `m`, or only those with `mask[v]` set when `mask` is given.
FlopCount CountFlops(const Module& m, const std::vector<char>* mask = nullptr);

// The values output `name` depends on (itself included): the forward pass of `loss` in a module
// with gradients.
std::vector<char> AncestorsOf(const Module& m, ValueId v);

// Elements of the variables with role weight.
int64_t CountParameters(const Module& m);

// The cost report of a training step. `grad` is the module right after autodiff (one replica's batch,
// before data-parallel lowering); `step` the whole step after every pass (one replica's module);
// `examples` the examples one replica processes per step.
struct CostReport {
  int64_t parameters = 0;
  int64_t examples = 0;
  FlopCount forward;        // the loss's ancestors in `grad`
  FlopCount step;           // every op of `step` (forward, backward, collectives, optimizer)
  int64_t activation_bytes = 0;   // forward values kept for the backward: non-leaf values the loss depends
                                  // on that a backward (non-forward) instruction of `grad` reads
  int64_t activation_values = 0;
  std::string ToString() const;
};
CostReport ComputeCost(const Module& grad, const Module& step, int64_t examples);

}  // namespace shardstep::ir
