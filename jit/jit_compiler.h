// JitCompiler: a small wrapper around LLVM 14 ORC LLJIT: Create(options), AddModule, Lookup, with an
// on-disk object cache (llvm::ObjectCache) keyed by the caller's hash of module and target.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace llvm {
class LLVMContext;
class Module;
}  // namespace llvm

namespace shardstep::jit {

struct JitOptions {
  // Directory of cached objects; empty: $XDG_CACHE_HOME/shardstep, else ~/.cache/shardstep.
  std::string cache_dir;
  bool disk_cache = true;  // SHARDSTEP_JIT_CACHE=0 in the environment also turns it off
  bool memory_cache = true;  // reuse a step compiled earlier in this process
  // Reductions run inside the fused loops that produce their operands, and broadcasts are read by
  // every loop that uses them (jit/compiled_step.cc); attention_grad rounds and sums its parts itself
  // (PlanAttentionGradParts); off: each reduction reads a materialised operand (the same bits: tests
  // compare the two). SHARDSTEP_JIT_FUSE_REDUCTIONS=0 turns it off too.
  bool fuse_reductions = true;
  // Fused loops store an output over a temporary they read last (PlanReusedInputs); off: never, to
  // compare. SHARDSTEP_JIT_REUSE=0 turns it off too. Both flags are in the cache keys (they change the
  // kernels and the driver); other planning is fixed by the module and the JIT's sources.
  bool reuse_inputs = true;
  // Convolutions with >= 8 channels and the loops between them run on NHWC activations
  // (jit/channels_last.h); off: every convolution on NCHW, as the IR has them.
  bool channels_last = true;
  // The collectives take an all-gather whose input is the member's own chunk of its output
  // (runtime::InProcessCollectives): the sharded update's loop then stores a replica's new slice of a
  // weight straight into the weight (CompiledStep::PlanInPlaceUpdates), not into a buffer the all-gather
  // copies from. In the cache keys. jit::CpuExecutor sets it for in-process replicas.
  bool in_place_all_gathers = false;
  // The weights' bf16 roundings are written by the optimizer's loop into bf16 copies kept from step to
  // step (jit/step_rewrites.h Bf16WeightCopies), which the caller makes from the weights and binds as
  // variables (CompiledStep::bf16_weight_copies). The module text, and so the cache keys, show it.
  // jit::CpuExecutor sets it.
  bool bf16_weight_copies = false;
};

// Where cached objects live for `options` (resolves the default).
std::string CacheDirectory(const JitOptions& options);

class JitCompiler {
 public:
  static std::unique_ptr<JitCompiler> Create(const JitOptions& options = {});
  ~JitCompiler();

  // "triple/cpu/features": part of every cache key, so an object never runs on another CPU.
  const std::string& target_key() const;

  // Loads the object cached under `key` into the JIT. False when there is none, or when it is
  // corrupt (bad magic, size or checksum): the entry is then deleted and the caller compiles.
  bool AddCachedObject(const std::string& key);
  // Optimises `module` at O3 for the host (no FP contraction, no fast-math) and adds it; its object
  // is stored in the disk cache under `key` when it is compiled (at the first Lookup).
  void AddModule(std::unique_ptr<llvm::Module> module, std::unique_ptr<llvm::LLVMContext> context,
                 const std::string& key);
  // Makes C++ functions callable from JIT'd code under `name` (absolute symbols in the main
  // JITDylib: they resolve whether or not the executable exports them dynamically).
  void DefineSymbols(const std::vector<std::pair<std::string, void*>>& symbols);
  // The address of a function defined by an added module (compiles on first use).
  void* Lookup(const std::string& name);

  // The O3 pipeline alone (used by AddModule and by `--emit=llvm`). With `vectorize_remarks`, the
  // loop vectoriser's optimisation remarks are collected as "<function>: <message>" (passed and
  // missed), so callers can check that the fused loops were vectorised.
  void Optimize(llvm::Module& module, std::vector<std::string>* vectorize_remarks = nullptr);

  // Number of objects loaded from / written to the disk cache, and corrupt entries rejected.
  int cache_hits() const;
  int cache_writes() const;
  int cache_rejects() const;

 private:
  struct Impl;
  explicit JitCompiler(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// FNV-1a 64 of `data`, printed as 16 hex digits.
std::string HashHex(const std::string& data);

}  // namespace shardstep::jit
