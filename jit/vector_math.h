// VectorMath: f32 exp, log and tanh as straight-line LLVM IR (no calls, no branches), so that fused
// loops using them vectorise; libm's special values, within 1 ulp of the exact result (vector_math.cc
// has the algorithms and their bounds).
#pragma once

#include <array>

#include <llvm/IR/IRBuilder.h>

namespace shardstep::jit {

// SHARDSTEP_SCALAR_LIBM=1 in the environment: kernels call libm's scalar expf, logf, tanhf instead
// (for comparisons and bisection). Read at each EmitKernels and part of the JIT's target key, so the
// disk cache never mixes the two; CompiledStep's in-process memory cache does not look at it (compare
// in one process with JitOptions::memory_cache = false, as bench/transcendental does).
bool ScalarLibm();

// The coefficients of exp's polynomial on [-ln2/2, ln2/2], highest degree first (exp(r) ~ 1 + r +
// r^2 (c0 r^5 + ... + c5)). Tests pass a perturbed copy to check that their ulp bound can fail.
using ExpCoefficients = std::array<float, 6>;
extern const ExpCoefficients kExpCoefficients;

// Each takes and returns an f32 value (scalar or vector); the IR computes element-wise. With
// avx512_variants (a scalar x, in a loop the vectoriser runs 16 lanes wide, on a host with AVX-512F),
// exp's u 2^k is a call mapped to vscalefps (jit/avx512_variants.h): the same bits.
llvm::Value* EmitExp(llvm::IRBuilder<>& b, llvm::Value* x, const ExpCoefficients& c = kExpCoefficients,
                     bool avx512_variants = false);
llvm::Value* EmitLog(llvm::IRBuilder<>& b, llvm::Value* x);
llvm::Value* EmitTanh(llvm::IRBuilder<>& b, llvm::Value* x, bool avx512_variants = false);

}  // namespace shardstep::jit
