// DriverEmitter: one straight-line function; after each call a status test branches to a shared
// `fail` block that returns it. Everything a step does at run time is a constant here (kernel
// addresses, slots, sgemm shapes), so the driver is the schedule, with no interpretation left.
#include "jit/driver_emitter.h"

#include <llvm/IR/IRBuilder.h>
#include <llvm/IR/LLVMContext.h>
#include <llvm/IR/Module.h>

#include <algorithm>

#include "ir/error.h"

namespace shardstep::jit {

void EmitStepDriver(llvm::Module& mod, const std::vector<FusedKernel>& kernels, const std::vector<DriverStep>& steps,
                    const std::string& name) {
  llvm::LLVMContext& ctx = mod.getContext();
  llvm::IRBuilder<> b(ctx);
  llvm::Type* i8p = b.getInt8PtrTy();
  llvm::Type* i8pp = i8p->getPointerTo();
  llvm::Type* i32 = b.getInt32Ty();
  llvm::Type* i64 = b.getInt64Ty();
  auto declare = [&](const char* fn, std::vector<llvm::Type*> params) {
    auto* f = llvm::cast<llvm::Function>(
        mod.getOrInsertFunction(fn, llvm::FunctionType::get(i32, params, false)).getCallee());
    f->addFnAttr(llvm::Attribute::NoUnwind);  // the entry points catch everything
    return f;
  };
  llvm::Function* rt_kernel = declare("ss_rt_kernel", {i8p, i8p, i8pp, i64});
  llvm::Function* rt_sgemm = declare("ss_rt_sgemm", {i8p, i64, i32, i32, i64, i64, i64, i8p, i64, i8p, i64, i8p});
  llvm::Function* rt_collective = declare("ss_rt_collective", {i8p, i64});
  llvm::Function* rt_instr = declare("ss_rt_instr", {i8p, i64});

  auto* driver = llvm::Function::Create(llvm::FunctionType::get(i32, {i8p}, false), llvm::Function::ExternalLinkage,
                                        name, mod);
  driver->addFnAttr(llvm::Attribute::NoUnwind);
  llvm::Value* c = driver->getArg(0);
  llvm::BasicBlock* fail = llvm::BasicBlock::Create(ctx, "fail", driver);
  b.SetInsertPoint(llvm::BasicBlock::Create(ctx, "entry", driver, fail));
  llvm::Value* slots = b.CreateLoad(i8pp, b.CreateBitCast(c, i8pp->getPointerTo()), "slots");
  size_t max_bufs = 1;
  for (const FusedKernel& k : kernels) max_bufs = std::max(max_bufs, k.inputs.size() + k.outputs.size());
  llvm::Value* bufs = b.CreateAlloca(i8p, b.getInt64(max_bufs), "bufs");

  auto slot_addr = [&](ir::ValueId v) { return b.CreateConstGEP1_64(i8p, slots, static_cast<uint64_t>(v)); };
  auto slot = [&](ir::ValueId v) { return b.CreateLoad(i8p, slot_addr(v)); };
  int call = 0;
  auto checked = [&](llvm::Function* fn, std::vector<llvm::Value*> args) {
    llvm::Value* status = b.CreateCall(fn, args);
    llvm::BasicBlock* next = llvm::BasicBlock::Create(ctx, "s" + std::to_string(++call), driver, fail);
    b.CreateCondBr(b.CreateICmpNE(status, b.getInt32(0)), fail, next);
    b.SetInsertPoint(next);
  };
  for (const DriverStep& s : steps) {
    switch (s.kind) {
      case DriverStep::Kind::kKernel: {
        const FusedKernel& k = kernels.at(s.kernel);
        llvm::Function* fn = mod.getFunction(k.name);
        SS_CHECK(fn, "kernel ", k.name, " is not in the module");
        size_t i = 0;
        for (ir::ValueId v : k.inputs) b.CreateStore(slot(v), b.CreateConstGEP1_64(i8p, bufs, i++));
        for (size_t j = 0; j < k.outputs.size(); ++j) {  // an output stored in place: its input's buffer
          const int into = j < k.store_into.size() ? k.store_into[j] : -1;
          b.CreateStore(slot(into >= 0 ? k.inputs[into] : k.outputs[j]), b.CreateConstGEP1_64(i8p, bufs, i++));
        }
        checked(rt_kernel, {c, b.CreateBitCast(fn, i8p), bufs, b.getInt64(ir::NumElements(k.shape))});
        break;
      }
      case DriverStep::Kind::kSgemm:
        checked(rt_sgemm, {c, b.getInt64(s.value), b.getInt32(s.ta), b.getInt32(s.tb), b.getInt64(s.m), b.getInt64(s.n),
                           b.getInt64(s.k), slot(s.a), b.getInt64(s.lda), slot(s.b), b.getInt64(s.ldb), slot(s.value)});
        break;
      case DriverStep::Kind::kAlias: b.CreateStore(slot(s.source), slot_addr(s.value)); break;
      case DriverStep::Kind::kCollective: checked(rt_collective, {c, b.getInt64(s.value)}); break;
      case DriverStep::Kind::kInstr: checked(rt_instr, {c, b.getInt64(s.value)}); break;
    }
  }
  b.CreateRet(b.getInt32(0));
  b.SetInsertPoint(fail);
  b.CreateRet(b.getInt32(1));
}

}  // namespace shardstep::jit
