// AVX-512 forms of two steps of generated loops (jit/kernel_emitter.cc, jit/vector_math.cc) that the
// scalar IR can only spell out in several integer operations: f32 -> bf16 rounding (vcvtneps2bf16) and
// exp's u 2^k (vscalefps). Each is emitted as a call of a scalar function that computes it the generic
// way; the call names a 16-lane variant (its vector-function-abi-variant), which the loop vectoriser
// calls instead in a loop it runs 16 lanes wide. Both stay out of line through O3 and are inlined
// after it (kLateInlineAttr, JitCompiler::Optimize). Every variant gives the generic form's bits.
// Used in the loops with vector math (exp, log, tanh, sigmoid), which are compute-bound and forced 16
// lanes wide: transformer_lm's GELU loops spent 15-20% of their instructions on these two steps.
#pragma once

#include <llvm/IR/IRBuilder.h>

namespace shardstep::jit {

// The bf16 bits (i16, or a vector of i16) of f (f32, or a vector of f32), rounded to nearest even, a
// NaN made quiet with its sign and top payload kept, overflow to inf (runtime/tensor.h F32ToBf16):
// integer operations, any width.
llvm::Value* EmitBf16Bits(llvm::IRBuilder<>& b, llvm::Value* f);
// The same for a scalar f, as a call whose 16-lane variant converts with vcvtneps2bf16 (AVX512-BF16),
// subnormals included (avx512_variants.cc). Needs HostHasAvx512Bf16.
llvm::Value* EmitBf16BitsVectorised(llvm::IRBuilder<>& b, llvm::Value* f);

// u 2^k for u in [0.5, 2) and an integral kf = k with |k| <= 252 (EmitExp's last step), rounded once:
// (u 2^h) 2^(k - h), h = k >> 1, both factors normal, the first product exact; any width.
llvm::Value* EmitScaleByPow2(llvm::IRBuilder<>& b, llvm::Value* u, llvm::Value* kf);
// The same for scalars, as a call whose 16-lane variant is vscalefps (one rounding of u 2^k: the same
// bits). Needs HostHasAvx512F.
llvm::Value* EmitScaleByPow2Vectorised(llvm::IRBuilder<>& b, llvm::Value* u, llvm::Value* kf);

// What the host (the JIT's target) has: AVX-512F; AVX512-BF16 with AVX-512F and DQ (vfpclassps).
bool HostHasAvx512F();
bool HostHasAvx512Bf16();

// A function with this attribute is noinline until the O3 pipeline has run, then inlined everywhere
// and removed (JitCompiler::Optimize).
inline constexpr const char* kLateInlineAttr = "shardstep-late-inline";

}  // namespace shardstep::jit
