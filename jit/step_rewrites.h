// The JIT's own rewrites of a step module before it is planned (CompiledStep::Compile), in this order:
// RoundBeforeReshapes, ReadBf16OperandsInPlace, MaskMaxPoolGradsByRelu, (ConvolutionsChannelsLast,
// jit/channels_last.h), RecomputeCheapValues, CopyBroadcastsPerReader. Each keeps every value's bits;
// they change where values are computed and what reaches memory. Some leave forms only the JIT reads
// (attributes below); `SHARDSTEP_JIT_DUMP=FILE` shows the module after them.
#pragma once

#include "ir/module.h"

namespace shardstep::jit {

// A matmul whose operands are the bf16 values themselves, read in place (ReadBf16OperandsInPlace).
inline constexpr const char* kBf16OperandsAttr = "jit_bf16_operands";
// A max-pooling gradient with relu's mask applied in the same pass (MaskMaxPoolGradsByRelu).
inline constexpr const char* kReluMaskAttr = "jit_relu_mask";

// Whether `in` is an f32 matmul whose operands are both convert(convert(x, bf16), f32) (the
// mixed-precision pass's rounding): it runs as oneDNN bf16 x bf16 -> f32, not sgemm.
bool Bf16Operands(const ir::Module& m, const ir::Instr& in);

void RoundBeforeReshapes(ir::Module& m);
void ReadBf16OperandsInPlace(ir::Module& m);
void MaskMaxPoolGradsByRelu(ir::Module& m);
// Return the number of copies made.
int RecomputeCheapValues(ir::Module& m);
int CopyBroadcastsPerReader(ir::Module& m);

}  // namespace shardstep::jit
