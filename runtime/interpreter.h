// The reference interpreter: evaluates a module op by op on host tensors; the oracle for every backend.
//
// Slow and obvious on purpose: written on xtensor, single-threaded, with matmul and convolution as
// plain loops summing in double in index order, so it shares no kernel with any backend. Every
// result is bitwise deterministic (the conventions are listed at the top of interpreter.cc).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "ir/module.h"
#include "runtime/collectives.h"
#include "runtime/tensor.h"

namespace shardstep::runtime {

using TensorMap = std::map<std::string, Tensor>;

// Evaluates every instruction of `m` as replica `replica` and returns all values (index = ValueId).
// Variables and inputs are read by name; a missing one or a wrong type throws shardstep::Error
// ("input @image: expected f32[64,784], got f32[32,784]"), as does bad data (an out-of-range label
// or gather index, an s32 division by zero). Collective ops call `collectives`; without one, they
// act on a group of one replica (identity, or a gather of one) and throw for larger groups.
std::vector<Tensor> EvaluateAll(const ir::Module& m, const TensorMap& variables, const TensorMap& inputs,
                                int replica = 0, Collectives* collectives = nullptr);

// Runs one training step: evaluates `m`, returns the named outputs, then writes every assigned
// variable's new value into `variables` (all assignments see the values from before the step).
TensorMap RunStep(const ir::Module& m, TensorMap& variables, const TensorMap& inputs, int replica = 0,
                  Collectives* collectives = nullptr);

}  // namespace shardstep::runtime
