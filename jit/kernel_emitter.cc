// KernelEmitter: fused elementwise groups -> LLVM IR loops that O3 vectorises.
//
// A broadcast member reads its operand through an index map (out index -> operand index); a rank-0
// or single-element operand is read once before the loop; along rows where every broadcast is
// constant or contiguous (EmitBody), the index is computed once per row.
// Each kernel is a thin entry `kN(i8** bufs, i64 begin, i64 end)` that loads its buffer pointers and
// calls an always-inline body whose pointer parameters are `noalias` (every value has its own
// buffer), so the loop vectoriser needs no runtime alias checks. No instruction carries fast-math
// flags: the scalar semantics below reproduce the interpreter's (runtime/interpreter.cc) exactly:
//  - max/min: (a > b) | (a != a) ? a : b (NaN wins); relu(x) = (x > 0) | (x != x) ? x : 0;
//  - exp, log, tanh are inline IR (jit/vector_math.h: within 1 ulp of the exact value, so within 2 of
//    the interpreter's libm; SHARDSTEP_SCALAR_LIBM=1 calls libm instead); sin, cos, pow call libm's
//    sinf, cosf, powf (the functions the interpreter calls);
//  - rsqrt = 1 / sqrt(x); sigmoid = 1 / (1 + exp(-x));
//  - comparisons give 1 or 0 in the result dtype; select tests cond != 0 (NaN counts as true);
//  - s32 add/sub/mul/neg/abs wrap; convert f32 -> s32 truncates and saturates (NaN -> 0).
//  - bf16 (i16 in memory) is computed in f32: a load widens exactly (bits << 16), every bf16-typed
//    member's f32 result is rounded to nearest even in integer ops (runtime/tensor.h F32ToBf16: NaN
//    made quiet, overflow to inf), and a store keeps the upper half. No LLVM bfloat arithmetic.
#include "jit/kernel_emitter.h"

#include <llvm/IR/IRBuilder.h>
#include <llvm/IR/Intrinsics.h>
#include <llvm/IR/LLVMContext.h>
#include <llvm/IR/Metadata.h>
#include <llvm/IR/Module.h>

#include <cmath>
#include <limits>
#include <map>
#include <unordered_map>

#include "ir/error.h"
#include "jit/avx512_variants.h"
#include "jit/vector_math.h"
#include "runtime/tensor.h"

namespace shardstep::jit {
namespace {

using ir::DType;
using ir::OpCode;
using ir::ValueId;

int32_t ToS32(double v) {  // as the interpreter's Splat
  if (std::isnan(v)) return 0;
  if (v >= 2147483647.0) return std::numeric_limits<int32_t>::max();
  if (v <= -2147483648.0) return std::numeric_limits<int32_t>::min();
  return static_cast<int32_t>(v);
}

class Emitter {
 public:
  Emitter(const ir::Module& m, llvm::LLVMContext& ctx, llvm::Module& mod) : m_(m), ctx_(ctx), mod_(mod) {}

  void Emit(const FusedKernel& k) {
    llvm::Type* i64 = llvm::Type::getInt64Ty(ctx_);
    llvm::Type* i8pp = llvm::Type::getInt8PtrTy(ctx_)->getPointerTo();
    const size_t nbuf = k.inputs.size() + k.outputs.size();

    // The body: (ptr noalias x nbuf, begin, end).
    std::vector<llvm::Type*> params;
    for (ValueId v : k.inputs) params.push_back(ElemTy(m_.type(v).dtype)->getPointerTo());
    for (ValueId v : k.outputs) params.push_back(ElemTy(m_.type(v).dtype)->getPointerTo());
    params.push_back(i64);
    params.push_back(i64);
    auto* body_ty = llvm::FunctionType::get(llvm::Type::getVoidTy(ctx_), params, false);
    auto* body = llvm::Function::Create(body_ty, llvm::Function::InternalLinkage, k.name + ".body", mod_);
    body->addFnAttr(llvm::Attribute::AlwaysInline);
    body->addFnAttr(llvm::Attribute::NoUnwind);
    for (size_t i = 0; i < nbuf; ++i) body->addParamAttr(static_cast<unsigned>(i), llvm::Attribute::NoAlias);
    // A loop with vector math is compute-bound and runs 16 lanes wide (WideAndInterleaved): its bf16
    // rounding and exp's scaling take AVX-512 instructions of their own where the host has them.
    const bool wide = !libm_ && HasVectorMath(k);
    bf16_variant_ = wide && HostHasAvx512Bf16();
    scale_variant_ = wide && HostHasAvx512F();
    EmitBody(k, body);

    // The entry: unpacks bufs.
    auto* entry_ty = llvm::FunctionType::get(llvm::Type::getVoidTy(ctx_), {i8pp, i64, i64}, false);
    auto* entry = llvm::Function::Create(entry_ty, llvm::Function::ExternalLinkage, k.name, mod_);
    entry->addFnAttr(llvm::Attribute::NoUnwind);
    // LLVM vectorises 256 bits wide on AVX-512 CPUs by default. A kernel with vectorised exp, log or
    // tanh is compute-bound and goes 512 wide: softmax's exp-and-sum kernels in transformer_lm's step,
    // 2.35 -> 1.53 thread-seconds over 40 steps. Memory-bound kernels stay 256 wide (512 was 5% slower
    // on them). Elementwise results are the same bits at any width.
    if (!libm_ && HasVectorMath(k)) entry->addFnAttr("prefer-vector-width", "512");
    llvm::IRBuilder<> b(llvm::BasicBlock::Create(ctx_, "entry", entry));
    std::vector<llvm::Value*> args;
    auto* bufs = entry->getArg(0);
    for (size_t i = 0; i < nbuf; ++i) {
      llvm::Value* p = b.CreateLoad(b.getInt8PtrTy(), b.CreateConstGEP1_64(b.getInt8PtrTy(), bufs, i));
      args.push_back(b.CreateBitCast(p, params[i]));
    }
    args.push_back(entry->getArg(1));
    args.push_back(entry->getArg(2));
    b.CreateCall(body, args);
    b.CreateRetVoid();
  }

 private:
  llvm::Type* ElemTy(DType t) {
    if (t == DType::kBF16) return llvm::Type::getInt16Ty(ctx_);
    return t == DType::kF32 ? llvm::Type::getFloatTy(ctx_) : static_cast<llvm::Type*>(llvm::Type::getInt32Ty(ctx_));
  }

  // A loaded element as a register value: bf16 bits widen (exactly) to f32.
  llvm::Value* Widen(llvm::IRBuilder<>& b, llvm::Value* v, DType t) {
    if (t != DType::kBF16) return v;
    return b.CreateBitCast(b.CreateShl(b.CreateZExt(v, b.getInt32Ty()), 16), b.getFloatTy());
  }

  // f32 -> bf16 bits, round to nearest even; a NaN keeps its sign and top payload and is made quiet
  // (jit/avx512_variants.h: vcvtneps2bf16 in the 16-lane loops of a kernel with vector math).
  llvm::Value* Bf16Bits(llvm::IRBuilder<>& b, llvm::Value* f) {
    return bf16_variant_ ? EmitBf16BitsVectorised(b, f) : EmitBf16Bits(b, f);
  }

  // f rounded to the nearest bf16, kept as f32 (the value every bf16-typed member holds).
  llvm::Value* RoundBf16(llvm::IRBuilder<>& b, llvm::Value* f) { return Widen(b, Bf16Bits(b, f), DType::kBF16); }
  // The bf16 bits of an f32 that already holds a bf16 value (RoundBf16's result, a widened load or a
  // rounded constant: low 16 bits zero, a NaN already quiet): its top half, no second rounding.
  llvm::Value* HeldBf16Bits(llvm::IRBuilder<>& b, llvm::Value* f) {
    return b.CreateTrunc(b.CreateLShr(b.CreateBitCast(f, b.getInt32Ty()), 16), b.getInt16Ty());
  }

  // A broadcast member read through an index map (not a scalar, a constant or a group value).
  bool Gathers(const ir::Instr& in, const std::unordered_map<ValueId, llvm::Value*>& scalar) const {
    if (in.op != OpCode::kBroadcast) return false;
    const ValueId src = in.operands[0];
    return !scalar.count(src) && m_.at(src).op != OpCode::kConstant && m_.type(src).shape != in.type.shape;
  }

  // How a gathering broadcast reads along the kernel's last `suffix` dimensions: constant (kInvariant:
  // none of them comes from an operand dimension of size > 1), or one contiguous run of the operand
  // (kContiguous: they are the operand's own last dimensions, in order); else kOther.
  enum class Run { kInvariant, kContiguous, kOther };
  Run RunOf(const ir::Instr& in, size_t suffix) const {
    const ir::IntList& dims = in.GetInts("dims");
    const ir::Shape& os = in.type.shape;
    const ir::Shape& is = m_.type(in.operands[0]).shape;
    const int64_t first = static_cast<int64_t>(os.size() - suffix);
    bool invariant = true;
    for (size_t d = 0; d < dims.size(); ++d) invariant &= dims[d] < first || is[d] == 1;
    if (invariant) return Run::kInvariant;
    if (dims.size() < suffix) return Run::kOther;
    for (size_t j = 0; j < suffix; ++j) {
      const size_t d = dims.size() - suffix + j;
      if (dims[d] != first + static_cast<int64_t>(j) || is[d] != os[dims[d]]) return Run::kOther;
    }
    return Run::kContiguous;
  }

  // The operand index a broadcast member reads for output index iv (i64):
  // sum_d ((iv / out_stride[dims[d]]) % out_shape[dims[d]]) * in_stride[d]; the divisors are constants,
  // so LLVM turns them into multiplies (in 32 bits when the tensor allows: x86 vectorises i32 division
  // by a constant, not i64).
  llvm::Value* GatherIndex(llvm::IRBuilder<>& b, const ir::Instr& in, llvm::Value* i) {
    const ir::IntList& dims = in.GetInts("dims");
    const ir::Shape& os = in.type.shape;
    const ir::Shape& is = m_.type(in.operands[0]).shape;
    std::vector<int64_t> ostride(os.size(), 1), istride(is.size(), 1);
    for (int64_t d = static_cast<int64_t>(os.size()) - 2; d >= 0; --d) ostride[d] = ostride[d + 1] * os[d + 1];
    for (int64_t d = static_cast<int64_t>(is.size()) - 2; d >= 0; --d) istride[d] = istride[d + 1] * is[d + 1];
    const bool narrow = in.type.elements() < (int64_t{1} << 31);
    llvm::Type* it = narrow ? b.getInt32Ty() : b.getInt64Ty();
    auto C = [&](int64_t c) { return llvm::ConstantInt::get(it, static_cast<uint64_t>(c)); };
    llvm::Value* iv = narrow ? b.CreateTrunc(i, it) : i;
    llvm::Value* idx = C(0);
    for (size_t d = 0; d < dims.size(); ++d) {
      if (is[d] == 1) continue;
      llvm::Value* q = ostride[dims[d]] == 1 ? iv : b.CreateUDiv(iv, C(ostride[dims[d]]));
      if (dims[d] != 0) q = b.CreateURem(q, C(os[dims[d]]));
      idx = b.CreateAdd(idx, istride[d] == 1 ? q : b.CreateMul(q, C(istride[d])));
    }
    return narrow ? b.CreateZExt(idx, b.getInt64Ty()) : idx;
  }

  // The loop. Without gathering broadcasts: one flat loop over [begin, end). With them, when the
  // kernel's last dimensions form rows along which every such broadcast is constant or contiguous
  // (batch norm's per-channel scale over H*W, a bias along the last dimension), [begin, end) is cut
  // at row boundaries: per row the broadcasts' indices are computed once (a constant value loaded
  // before the row's loop, or an offset added to i), so the inner loop vectorises with no gathers.
  // Each element's arithmetic is the same either way.
  // Rows this short get a loop of constant trip count for each whole row (EmitBody).
  static constexpr int64_t kShortRow = 256;

  void EmitBody(const FusedKernel& k, llvm::Function* f) {
    llvm::BasicBlock* entry = llvm::BasicBlock::Create(ctx_, "entry", f);
    llvm::BasicBlock* exit = llvm::BasicBlock::Create(ctx_, "exit", f);
    llvm::IRBuilder<> b(entry);
    const size_t nin = k.inputs.size();
    llvm::Value* begin = f->getArg(static_cast<unsigned>(nin + k.outputs.size()));
    llvm::Value* end = f->getArg(static_cast<unsigned>(nin + k.outputs.size() + 1));

    // Scalars (inputs not of the group's shape) are read once, before the loop.
    std::unordered_map<ValueId, llvm::Value*> scalar;
    std::unordered_map<ValueId, unsigned> input_arg;
    for (size_t j = 0; j < nin; ++j) {
      const ValueId v = k.inputs[j];
      input_arg[v] = static_cast<unsigned>(j);
      const DType dt = m_.type(v).dtype;
      if (m_.type(v).shape != k.shape && m_.type(v).elements() == 1)
        scalar[v] = Widen(b, b.CreateLoad(ElemTy(dt), f->getArg(static_cast<unsigned>(j))), dt);
    }

    // Rows: the longest suffix of the shape along which every gathering broadcast runs (kOther for none).
    std::vector<ValueId> gathers;
    for (ValueId v : k.members)
      if (Gathers(m_.at(v), scalar)) gathers.push_back(v);
    size_t suffix = 0;
    int64_t row = 1;
    for (size_t s = 1; !gathers.empty() && s <= k.shape.size(); ++s) {
      bool ok = true;
      for (ValueId v : gathers) ok &= RunOf(m_.at(v), s) != Run::kOther;
      if (!ok) break;
      suffix = s;
      row *= k.shape[k.shape.size() - s];
    }
    const bool rows = suffix > 0 && row >= 8;  // shorter rows: the flat loop's gathers are faster

    // Per row (or nothing): the broadcasts' constant values and contiguous offsets.
    std::unordered_map<ValueId, llvm::Value*> val_outer, offset;
    llvm::PHINode* seg_begin = nullptr;
    llvm::Value* seg_end = end;
    llvm::Value *row_start = nullptr, *row_end = nullptr;
    llvm::BasicBlock* outer = nullptr;
    if (rows) {
      outer = llvm::BasicBlock::Create(ctx_, "row", f, exit);
      b.CreateCondBr(b.CreateICmpSLT(begin, end), outer, exit);
      b.SetInsertPoint(outer);
      seg_begin = b.CreatePHI(b.getInt64Ty(), 2, "seg");
      seg_begin->addIncoming(begin, entry);
      row_start = b.CreateMul(b.CreateUDiv(seg_begin, b.getInt64(row)), b.getInt64(row));
      row_end = b.CreateAdd(row_start, b.getInt64(row));
      seg_end = b.CreateSelect(b.CreateICmpSLT(row_end, end), row_end, end);
      for (ValueId v : gathers) {
        const ir::Instr& in = m_.at(v);
        const ValueId src = in.operands[0];
        llvm::Value* base = GatherIndex(b, in, row_start);
        llvm::Type* t = ElemTy(m_.type(src).dtype);
        if (RunOf(in, suffix) == Run::kInvariant)
          val_outer[v] = Widen(b, b.CreateLoad(t, b.CreateInBoundsGEP(t, f->getArg(input_arg.at(src)), base)), m_.type(src).dtype);
        else
          offset[v] = b.CreateSub(base, row_start);  // operand index = i + offset
      }
    }
    // One element's work at index i (i64): loads, the members' arithmetic, stores.
    auto element = [&](llvm::Value* i) {
      std::unordered_map<ValueId, llvm::Value*> val = val_outer;
      auto operand = [&](ValueId o) -> llvm::Value* {
        if (auto it = val.find(o); it != val.end()) return it->second;
        if (auto it = scalar.find(o); it != scalar.end()) return it->second;
        const ir::Instr& in = m_.at(o);
        if (in.op == OpCode::kConstant) {
          const double c = in.GetFloat("value");
          if (in.type.dtype == DType::kBF16)
            return llvm::ConstantFP::get(b.getFloatTy(), runtime::RoundToBf16(static_cast<float>(c)));
          return in.type.dtype == DType::kF32 ? static_cast<llvm::Value*>(llvm::ConstantFP::get(b.getFloatTy(), static_cast<float>(c)))
                                              : b.getInt32(static_cast<uint32_t>(ToS32(c)));
        }
        auto it = input_arg.find(o);
        SS_CHECK(it != input_arg.end(), "kernel ", k.name, " has no input %", o);
        llvm::Type* t = ElemTy(in.type.dtype);
        llvm::Value* v = Widen(b, b.CreateLoad(t, b.CreateInBoundsGEP(t, f->getArg(it->second), i)), in.type.dtype);
        val[o] = v;
        return v;
      };
      for (ValueId v : k.members) {
        const ir::Instr& in = m_.at(v);
        if (val.count(v)) continue;  // a broadcast constant along the row
        if (Gathers(in, scalar)) {
          const ValueId src = in.operands[0];
          llvm::Value* idx = rows ? b.CreateAdd(i, offset.at(v)) : GatherIndex(b, in, i);
          llvm::Type* t = ElemTy(m_.type(src).dtype);
          llvm::Value* loaded = b.CreateLoad(t, b.CreateInBoundsGEP(t, f->getArg(input_arg.at(src)), idx));
          val[v] = Widen(b, loaded, m_.type(src).dtype);
          continue;
        }
        std::vector<llvm::Value*> x;
        for (ValueId o : in.operands) x.push_back(operand(o));
        val[v] = Lower(b, in, x);
        if (in.type.dtype == DType::kBF16) val[v] = RoundBf16(b, val[v]);
      }
      for (size_t j = 0; j < k.outputs.size(); ++j) {
        const ValueId v = k.outputs[j];
        llvm::Type* t = ElemTy(m_.type(v).dtype);
        llvm::Value* x = m_.type(v).dtype == DType::kBF16 ? HeldBf16Bits(b, val.at(v)) : val.at(v);  // rounded above
        // In place: through the input's own pointer, so the vectoriser sees one array read then written
        // at the same index (no runtime alias check), and the noalias parameters stay true.
        const int into = j < k.store_into.size() ? k.store_into[j] : -1;
        const unsigned arg = static_cast<unsigned>(into >= 0 ? into : static_cast<int>(nin + j));
        b.CreateStore(x, b.CreateInBoundsGEP(t, f->getArg(arg), i));
      }
    };

    llvm::BasicBlock* loop = llvm::BasicBlock::Create(ctx_, "loop", f, exit);
    llvm::BasicBlock* latch = rows ? llvm::BasicBlock::Create(ctx_, "row.next", f, exit) : nullptr;
    llvm::BasicBlock* pre = b.GetInsertBlock();
    if (rows && row <= kShortRow) {
      // A whole short row (channels-last batch norm's rows of C = 16-64 elements) runs a loop of
      // constant trip count, which LLVM vectorises with no remainder; a partial row (a chunk's ends),
      // the general loop.
      llvm::BasicBlock* whole = llvm::BasicBlock::Create(ctx_, "row.whole", f, loop);
      llvm::Value* full = b.CreateAnd(b.CreateICmpEQ(seg_begin, row_start), b.CreateICmpEQ(seg_end, row_end));
      b.CreateCondBr(full, whole, loop);
      b.SetInsertPoint(whole);
      llvm::PHINode* j = b.CreatePHI(b.getInt64Ty(), 2, "j");
      j->addIncoming(b.getInt64(0), pre);
      element(b.CreateAdd(row_start, j));
      llvm::Value* jn = b.CreateAdd(j, b.getInt64(1), "jn", /*HasNUW=*/true, /*HasNSW=*/true);
      j->addIncoming(jn, b.GetInsertBlock());
      b.CreateCondBr(b.CreateICmpSLT(jn, b.getInt64(row)), whole, latch);
    } else if (rows) {
      b.CreateBr(loop);
    } else {
      b.CreateCondBr(b.CreateICmpSLT(begin, end), loop, exit);
    }

    b.SetInsertPoint(loop);
    llvm::PHINode* i = b.CreatePHI(b.getInt64Ty(), 2, "i");
    i->addIncoming(rows ? static_cast<llvm::Value*>(seg_begin) : begin, pre);
    element(i);
    llvm::Value* next = b.CreateAdd(i, b.getInt64(1), "next", /*HasNUW=*/true, /*HasNSW=*/true);
    i->addIncoming(next, b.GetInsertBlock());
    llvm::BranchInst* back = nullptr;
    if (!rows) {
      back = b.CreateCondBr(b.CreateICmpSLT(next, end), loop, exit);
    } else {
      back = b.CreateCondBr(b.CreateICmpSLT(next, seg_end), loop, latch);
      b.SetInsertPoint(latch);
      seg_begin->addIncoming(seg_end, latch);
      b.CreateCondBr(b.CreateICmpSLT(seg_end, end), outer, exit);
    }
    if (!libm_ && HasVectorMath(k)) WideAndInterleaved(back);
    b.SetInsertPoint(exit);
    b.CreateRetVoid();
  }

  // A loop with vectorised exp, log or tanh is compute-bound on long dependency chains (their
  // polynomials; log's in f64): 16 lanes and 4 vectors in flight per iteration, where LLVM's cost model
  // picked 8 lanes and one vector for tanh (then computed in f64). transformer_lm's GELU loops, profiled over 30 steps: fused
  // loops of 2M elements 0.223 -> 0.151 s, the GELU-backward-and-bias-sum loop 1.55 -> 1.08 ms.
  // Elementwise results are the same bits at any width and interleave.
  void WideAndInterleaved(llvm::BranchInst* back) {
    auto hint = [&](const char* name, int value) {
      return llvm::MDNode::get(ctx_, {llvm::MDString::get(ctx_, name),
                                      llvm::ConstantAsMetadata::get(llvm::ConstantInt::get(llvm::Type::getInt32Ty(ctx_), value))});
    };
    llvm::TempMDTuple self = llvm::MDNode::getTemporary(ctx_, {});
    llvm::MDNode* md = llvm::MDNode::get(ctx_, {self.get(), hint("llvm.loop.vectorize.width", 16),
                                                hint("llvm.loop.interleave.count", 4)});
    md->replaceOperandWith(0, md);
    back->setMetadata(llvm::LLVMContext::MD_loop, md);
  }

  llvm::Value* LibmCall(llvm::IRBuilder<>& b, const char* name, std::vector<llvm::Value*> args) {
    std::vector<llvm::Type*> tys(args.size(), b.getFloatTy());
    llvm::FunctionCallee fn = mod_.getOrInsertFunction(name, llvm::FunctionType::get(b.getFloatTy(), tys, false));
    llvm::CallInst* call = b.CreateCall(fn, args);
    call->setDoesNotThrow();
    return call;
  }

  // A loop that WideAndInterleaved pays for: vectorised exp, log or tanh and no libm call (sin, cos,
  // pow stay scalar calls: forcing a width on them fails, and LLVM prints that failure on stderr; the
  // cosine schedule's one-element loop did, at every bf16 transformer_lm compile).
  bool HasVectorMath(const FusedKernel& k) const {
    bool vector_math = false;
    for (ValueId v : k.members) {
      const OpCode op = m_.at(v).op;
      if (op == OpCode::kSin || op == OpCode::kCos || op == OpCode::kPow) return false;
      vector_math |= op == OpCode::kExp || op == OpCode::kLog || op == OpCode::kTanh || op == OpCode::kSigmoid;
    }
    return vector_math;
  }

  llvm::Value* Exp(llvm::IRBuilder<>& b, llvm::Value* a) {
    return libm_ ? LibmCall(b, "expf", {a}) : EmitExp(b, a, kExpCoefficients, scale_variant_);
  }

  llvm::Value* Intrinsic(llvm::IRBuilder<>& b, llvm::Intrinsic::ID id, llvm::Value* a) {
    return b.CreateUnaryIntrinsic(id, a);
  }

  // Converts a boolean to the result dtype (1 or 0).
  llvm::Value* FromBool(llvm::IRBuilder<>& b, llvm::Value* c, DType t) {
    return ir::IsFloat(t) ? b.CreateUIToFP(c, b.getFloatTy()) : b.CreateZExt(c, b.getInt32Ty());
  }

  llvm::Value* Lower(llvm::IRBuilder<>& b, const ir::Instr& in, const std::vector<llvm::Value*>& x) {
    const bool f = !x.empty() && x[0]->getType()->isFloatTy();
    llvm::Value* zero = f ? static_cast<llvm::Value*>(llvm::ConstantFP::get(b.getFloatTy(), 0.0)) : b.getInt32(0);
    llvm::Value* one = llvm::ConstantFP::get(b.getFloatTy(), 1.0);
    switch (in.op) {
      case OpCode::kBroadcast: return x[0];  // of a scalar (others are loads through an index map)
      case OpCode::kNeg: return f ? b.CreateFNeg(x[0]) : b.CreateSub(zero, x[0]);
      case OpCode::kExp: return Exp(b, x[0]);
      case OpCode::kLog: return libm_ ? LibmCall(b, "logf", {x[0]}) : EmitLog(b, x[0]);
      case OpCode::kSqrt: return Intrinsic(b, llvm::Intrinsic::sqrt, x[0]);
      case OpCode::kRsqrt: return b.CreateFDiv(one, Intrinsic(b, llvm::Intrinsic::sqrt, x[0]));
      case OpCode::kTanh: return libm_ ? LibmCall(b, "tanhf", {x[0]}) : EmitTanh(b, x[0], scale_variant_);
      case OpCode::kSin: return LibmCall(b, "sinf", {x[0]});
      case OpCode::kCos: return LibmCall(b, "cosf", {x[0]});
      case OpCode::kSigmoid: return b.CreateFDiv(one, b.CreateFAdd(one, Exp(b, b.CreateFNeg(x[0]))));
      case OpCode::kRelu: {
        llvm::Value* keep = b.CreateOr(b.CreateFCmpOGT(x[0], zero), b.CreateFCmpUNO(x[0], x[0]));
        return b.CreateSelect(keep, x[0], zero);
      }
      case OpCode::kAbs:
        if (f) return Intrinsic(b, llvm::Intrinsic::fabs, x[0]);
        return b.CreateSelect(b.CreateICmpSLT(x[0], zero), b.CreateSub(zero, x[0]), x[0]);
      case OpCode::kStopGradient: return x[0];
      case OpCode::kConvert: {
        const DType to = in.type.dtype;
        if (f && to == DType::kS32)
          return b.CreateIntrinsic(llvm::Intrinsic::fptosi_sat, {b.getInt32Ty(), b.getFloatTy()}, {x[0]});
        if (!f && ir::IsFloat(to)) return b.CreateSIToFP(x[0], b.getFloatTy());  // bf16: rounded by the caller
        return x[0];
      }
      case OpCode::kAdd: return f ? b.CreateFAdd(x[0], x[1]) : b.CreateAdd(x[0], x[1]);
      case OpCode::kSub: return f ? b.CreateFSub(x[0], x[1]) : b.CreateSub(x[0], x[1]);
      case OpCode::kMul: return f ? b.CreateFMul(x[0], x[1]) : b.CreateMul(x[0], x[1]);
      case OpCode::kDiv:
        SS_CHECK(f, "s32 division is not fusible");
        return b.CreateFDiv(x[0], x[1]);
      case OpCode::kPow: return LibmCall(b, "powf", {x[0], x[1]});
      case OpCode::kMax:
      case OpCode::kMin: {
        const bool mx = in.op == OpCode::kMax;
        llvm::Value* c = f ? (mx ? b.CreateFCmpOGT(x[0], x[1]) : b.CreateFCmpOLT(x[0], x[1]))
                           : (mx ? b.CreateICmpSGT(x[0], x[1]) : b.CreateICmpSLT(x[0], x[1]));
        if (f) c = b.CreateOr(c, b.CreateFCmpUNO(x[0], x[0]));
        return b.CreateSelect(c, x[0], x[1]);
      }
      case OpCode::kEq: return FromBool(b, f ? b.CreateFCmpOEQ(x[0], x[1]) : b.CreateICmpEQ(x[0], x[1]), in.type.dtype);
      case OpCode::kNe: return FromBool(b, f ? b.CreateFCmpUNE(x[0], x[1]) : b.CreateICmpNE(x[0], x[1]), in.type.dtype);
      case OpCode::kLt: return FromBool(b, f ? b.CreateFCmpOLT(x[0], x[1]) : b.CreateICmpSLT(x[0], x[1]), in.type.dtype);
      case OpCode::kLe: return FromBool(b, f ? b.CreateFCmpOLE(x[0], x[1]) : b.CreateICmpSLE(x[0], x[1]), in.type.dtype);
      case OpCode::kGt: return FromBool(b, f ? b.CreateFCmpOGT(x[0], x[1]) : b.CreateICmpSGT(x[0], x[1]), in.type.dtype);
      case OpCode::kGe: return FromBool(b, f ? b.CreateFCmpOGE(x[0], x[1]) : b.CreateICmpSGE(x[0], x[1]), in.type.dtype);
      case OpCode::kSelect: {
        llvm::Value* c = x[0]->getType()->isFloatTy()
                             ? b.CreateFCmpUNE(x[0], llvm::ConstantFP::get(b.getFloatTy(), 0.0))
                             : b.CreateICmpNE(x[0], b.getInt32(0));
        return b.CreateSelect(c, x[1], x[2]);
      }
      default: break;
    }
    SS_CHECK(false, "op ", ir::OpName(in.op), " is not fusible");
    return nullptr;
  }

  const ir::Module& m_;
  llvm::LLVMContext& ctx_;
  llvm::Module& mod_;
  const bool libm_ = ScalarLibm();
  bool bf16_variant_ = false, scale_variant_ = false;  // the kernel being emitted uses jit/avx512_variants.h
};

}  // namespace

std::unique_ptr<llvm::Module> EmitKernels(const ir::Module& m, const std::vector<FusedKernel>& kernels,
                                          llvm::LLVMContext& ctx, const std::string& module_name) {
  auto mod = std::make_unique<llvm::Module>(module_name, ctx);
  Emitter e(m, ctx, *mod);
  for (const FusedKernel& k : kernels) e.Emit(k);
  return mod;
}

}  // namespace shardstep::jit
