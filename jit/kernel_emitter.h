// KernelEmitter: lowers each fusion group of a module to one LLVM IR function with one loop.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ir/module.h"

namespace llvm {
class LLVMContext;
class Module;
}  // namespace llvm

namespace shardstep::jit {

// One fused loop: element i of every output is computed from element i of every input (inputs whose
// shape is not the group's are rank-0 scalars, read once). Splat constants are inlined.
struct FusedKernel {
  std::string name;
  ir::Shape shape;
  std::vector<ir::ValueId> members;  // in module order
  std::vector<ir::ValueId> inputs;   // bufs[0, inputs.size())
  std::vector<ir::ValueId> outputs;  // bufs[inputs.size(), ...)
  // Per output: the input whose buffer it overwrites, element by element after reading it (an update
  // of a variable in place, CompiledStep::PlanInPlaceUpdates), or -1: its own buffer. Empty: all -1.
  std::vector<int> store_into;
};

// The compiled form: computes elements [begin, end) (callers split large ranges across threads).
using KernelFn = void (*)(void* const* bufs, int64_t begin, int64_t end);

// One LLVM module holding a function `void name(i8** bufs, i64 begin, i64 end)` per kernel.
std::unique_ptr<llvm::Module> EmitKernels(const ir::Module& m, const std::vector<FusedKernel>& kernels,
                                          llvm::LLVMContext& ctx, const std::string& module_name);

}  // namespace shardstep::jit
