// The JIT's own rewrites of a step module before it is planned (CompiledStep::Compile), in this order:
// RoundBeforeReshapes, RoundInProducers, RoundInTransposes, ReadBf16OperandsInPlace, (Bf16WeightCopies,
// with JitOptions::bf16_weight_copies), AttentionHeadsInPlace,
// MaskMaxPoolGradsByRelu, (ConvolutionsChannelsLast,
// jit/channels_last.h), ReluMasksFromInputs, RecomputeCheapValues, CopyBroadcastsPerReader, then (after the
// elementwise fuser, whose groups they read) SinkCheapLoopOutputs and MergeRepeatsInLoops. Each keeps every value's bits;
// they change where values are computed and what reaches memory. Some leave forms only the JIT reads
// (attributes below); `SHARDSTEP_JIT_DUMP=FILE` shows the module after them.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "ir/module.h"

namespace shardstep::jit {

// A matmul whose operands are the bf16 values themselves, read in place (ReadBf16OperandsInPlace).
inline constexpr const char* kBf16OperandsAttr = "jit_bf16_operands";
// A transpose from f32 to bf16 that rounds as it copies (RoundInTransposes).
inline constexpr const char* kRoundsAttr = "jit_rounds";
// An attention op's operands (kHeadsInAttr) or results (kHeadsOutAttr) in the model's [B, T, H, D]
// layout, H heads (AttentionHeadsInPlace; jit/attention.h heads_in, heads_out). 15 characters at most:
// the step reads them per call, and a longer std::string would allocate.
inline constexpr const char* kHeadsInAttr = "jit_heads_in";
inline constexpr const char* kHeadsOutAttr = "jit_heads_out";
// A max-pooling gradient with relu's mask applied in the same pass (MaskMaxPoolGradsByRelu).
inline constexpr const char* kReluMaskAttr = "jit_relu_mask";

// Whether `in` is an f32 matmul whose operands are both convert(convert(x, bf16), f32) (the
// mixed-precision pass's rounding): it runs as oneDNN bf16 x bf16 -> f32, not sgemm.
bool Bf16Operands(const ir::Module& m, const ir::Instr& in);

void RoundBeforeReshapes(ir::Module& m);
// convert(reshape*(transpose(reshape*(x))), bf16) with x an elementwise loop's value read only through
// that chain (the attention heads' q, k, v after their bias adds) becomes
// reshape*(transpose(reshape*(convert(x, bf16)))): the loop computing x writes it rounded, 2 bytes an
// element, and the transpose moves bf16 (StridedGather16), where x was written in f32 and read back by
// a rounding transpose. The same bits (rounding is elementwise). Runs before RoundInTransposes, which
// takes the transposes of other values.
void RoundInProducers(ir::Module& m);
// convert(reshape*(transpose(x)), bf16), each reshape and the transpose read by nothing else, becomes
// reshape*(t) with t the transpose of x to bf16, rounding each element as it is copied (kRoundsAttr):
// one pass writing 2 bytes an element instead of a transpose and a rounding loop (transformer_lm's
// attention heads: 32 of each over [32,4,128,32] per step). The same bits.
void RoundInTransposes(ir::Module& m);
// The same for attention and attention_grad with bf16=1 (jit/attention.h takes bf16 operands).
void ReadBf16OperandsInPlace(ir::Module& m);
// The transposes a model makes around attention, [B, T, H, D] <-> [B, H, T, D] (perm [0, 2, 1, 3]),
// read and written in place by the op, whose tasks gather their heads' rows into their own scratch and
// scatter their results (in cache), instead of passes over memory of their own (transformer_lm: 28
// per step, each over a [32, 4, 128, 32] tensor). Operands: when every operand of an attention or
// attention_grad is such a transpose (a rounding one, from RoundInTransposes, only with bf16=1: the op
// then rounds), it reads the transposes' operands (kHeadsInAttr). Results: attention's single reader
// such a transpose (a rounding one: the op rounds its output, which becomes bf16); attention_grad's
// readers its three parts' slices, each reshaped to [B, H, T, D] and read only by such transposes: the
// op writes [3, B, T, H, D] (kHeadsOutAttr), the slices and reshapes follow, the transposes go. The same
// bits: only where elements are stored moves.
void AttentionHeadsInPlace(ir::Module& m);
// The name of a weight's bf16 copy (Bf16WeightCopies): the weight's name and this suffix.
inline constexpr const char* kBf16CopySuffix = "#bf16";
// The weights' rounding moves into the optimizer's loop: convert(@w, bf16), with @w an f32 variable the
// step assigns from an elementwise value u (the update), reads a bf16 variable @w#bf16 instead, which
// the step assigns convert(u, bf16). The update's loop then writes the next step's rounded weight as it
// writes the weight (2 bytes an element more), and the loop that read each weight back to round it
// goes (the bf16 MLP: loops over 0.8M and 1M weights every step). The values a step computes are the
// same bits, provided @w#bf16 holds convert(@w, bf16) when the step starts: the copies are state their
// owner makes from the weights (jit::CpuExecutor: at each load of the state, and again after a step
// that did not finish), never part of the logical state or a checkpoint. A weight assigned from a
// collective (the sharded update's all-gather) keeps its rounding loop. Returns the copies as
// (copy's name, weight's name), in module order.
std::vector<std::pair<std::string, std::string>> Bf16WeightCopies(ir::Module& m);
void MaskMaxPoolGradsByRelu(ir::Module& m);
// Returns the number of masks rewritten.
int ReluMasksFromInputs(ir::Module& m);
// Return the number of copies made.
int RecomputeCheapValues(ir::Module& m);
int CopyBroadcastsPerReader(ir::Module& m);
// After the fuser (it reads the "fusion" groups): returns the number of loop outputs computed again in
// their readers' loops instead of written (step_rewrites.cc).
int SinkCheapLoopOutputs(ir::Module& m);
// After the fuser and SinkCheapLoopOutputs: within one loop, an op that repeats an earlier one of the same
// loop exactly (op, operands, attributes, type) is replaced by it. RecomputeCheapValues gives each reader
// its own copy of a chain, and a loop holding several such readers then computed the chain once per
// reader: transformer_lm's GELU gradient loop held x + b six times and its sigmoid three times (LLVM did
// not merge them). The same ops on the same values: the same bits. Returns the number of ops merged.
int MergeRepeatsInLoops(ir::Module& m);

}  // namespace shardstep::jit
