// DriverEmitter: lowers a step's schedule to one LLVM IR function, the step driver, which calls the
// fused loops, sgemm, collectives and the remaining instructions in order (jit/step_runtime.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ir/module.h"
#include "jit/kernel_emitter.h"

namespace llvm {
class Module;
}  // namespace llvm

namespace shardstep::jit {

// What the driver does at one position of the schedule.
struct DriverStep {
  enum class Kind { kKernel, kSgemm, kAlias, kCollective, kInstr };
  Kind kind = Kind::kInstr;
  int kernel = -1;          // kKernel: index into the kernels
  ir::ValueId value = -1;   // the instruction (all kinds but kKernel)
  // kSgemm: value = op(a)[m,k] op(b)[k,n], row-major.
  bool ta = false, tb = false;
  int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0;
  ir::ValueId a = -1, b = -1;
  // kAlias: value's storage is source's.
  ir::ValueId source = -1;
};

// Adds `i32 name(i8* ctx)` to `mod`, which must already hold the kernels' functions. ctx is a
// StepContext whose first member is the slot table (storage per value); the driver reads the slots
// when it needs them (leaves and aliases are set while it runs) and returns the first non-zero status.
void EmitStepDriver(llvm::Module& mod, const std::vector<FusedKernel>& kernels, const std::vector<DriverStep>& steps,
                    const std::string& name);

}  // namespace shardstep::jit
