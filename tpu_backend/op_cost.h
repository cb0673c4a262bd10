// The compute half of the step-time simulator: one IR instruction's time on a TPU core by roofline,
// max(FLOPs / unit rate, HBM bytes / HBM bandwidth), from the hardware table's public numbers.
//
// - matmul and the convolutions run on the matrix units (MXUs): at the bf16 peak with --precision bf16
//   (their inputs are rounded to bf16, so they read 2 bytes per input element), at peak / mxu_f32_passes
//   in f32. A 128x128 MXU holds a tile of the contraction x output-feature dimensions; dimensions that are
//   not multiples of 128 leave cells idle, so the rate is scaled by K/ceil128(K) * N/ceil128(N)
//   (convolutions: their im2col form, K = Cin·kh·kw and N = output channels; a first layer with 3 input
//   channels fills 147 of 256 rows, not 3 of 128).
// - everything else with FLOPs (ir/cost.h counts them) runs on the vector unit;
// - bytes: every operand and the result once (constants are splats: free; reshape is a bitcast: free;
//   data movement reads and writes its result), except inside a fusion group of the elementwise fuser
//   (ir/passes/elementwise_fuser.h, the groups the backends run as one loop): a value passed between
//   members of one group never goes to HBM, only the group's inputs and the values used outside it do.
// Leaves and collectives cost nothing here (collectives: the interconnect stream, simulator.h).
#pragma once

#include <cstdint>
#include <vector>

#include "ir/module.h"
#include "tpu_backend/hardware.h"

namespace shardstep::tpu {

enum class Precision { kBf16, kF32 };

struct OpCost {
  int64_t flops = 0;
  int64_t hbm_bytes = 0;
  bool matrix_unit = false;
  double seconds = 0;
};

// The fusion groups of a module the elementwise fuser has marked: group[v] (-1: none) and whether v's
// value is written to HBM (used outside its group, or assigned, output or a gradient).
struct FusionInfo {
  std::vector<int64_t> group;
  std::vector<char> materialized;
};
FusionInfo FusionOf(const ir::Module& fused);

OpCost CostOfOp(const ir::Module& m, ir::ValueId v, const HardwareTable& hw, Precision precision,
                const FusionInfo* fusion = nullptr);

}  // namespace shardstep::tpu
