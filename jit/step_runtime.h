// The C entry points the JIT'd step driver calls (fused loops over cores, sgemm, collectives, the
// remaining instructions), and the context it passes to each of them.
//
// Every entry point returns 0, or 1 after storing the exception it caught in the context: an
// exception must never unwind through the JIT'd driver (it has no unwind tables), so the driver
// returns at the first non-zero status and CompiledStep::Run rethrows the stored one.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "runtime/collectives.h"
#include "runtime/interpreter.h"

namespace shardstep::jit {

class CompiledStep;
struct StepBinding;
struct Workspace;
class SharedWeightPacks;

// What one Run hands to the driver. `slots` must stay the first member: the driver loads it
// from offset 0 (the storage of value v is slots[v]).
struct StepContext {
  void** slots = nullptr;
  const CompiledStep* step = nullptr;
  const StepBinding* binding = nullptr;  // the variables, inputs and outputs by slot
  int replica = 0;
  runtime::Collectives* collectives = nullptr;
  Workspace* ws = nullptr;
  int batch_parts = 1;
  SharedWeightPacks* packs = nullptr;  // StepBinding::packs
  uint64_t run = 0;                    // this replica's step number (Workspace::runs)
  std::exception_ptr error;  // set when an entry point returns non-zero
};

// The driver's signature: `int32_t ss_step(StepContext*)`, 0 on success.
using StepDriverFn = int32_t (*)(StepContext*);
constexpr const char* kStepDriverName = "ss_step";

// The entry points' names and addresses, to define in the JIT.
std::vector<std::pair<std::string, void*>> StepRuntimeSymbols();

}  // namespace shardstep::jit

extern "C" {
// Runs the fused loop `kernel` (a KernelFn) on `bufs` over [0, n), split across cores when large.
int32_t ss_rt_kernel(shardstep::jit::StepContext* ctx, void* kernel, void* const* bufs, int64_t n);
// Instruction `value`: out = op(a) op(b), row-major, through ParallelSgemm.
int32_t ss_rt_sgemm(shardstep::jit::StepContext* ctx, int64_t value, int32_t ta, int32_t tb, int64_t m, int64_t n,
                    int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* out);
// Instruction `value`, a collective, through ctx->collectives.
int32_t ss_rt_collective(shardstep::jit::StepContext* ctx, int64_t value);
// Any other instruction `value` (leaves, native data movement, reductions, the interpreter's kernels).
int32_t ss_rt_instr(shardstep::jit::StepContext* ctx, int64_t value);
}
