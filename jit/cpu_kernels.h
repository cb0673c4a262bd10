// Native CPU kernels the step driver calls for ops that are not fused loops: convolution (im2col +
// oneDNN sgemm per image) and pooling. Blocks of work depend only on the shapes, never on the number
// of threads, so results are reproducible; parallel across TBB tasks.
#pragma once

#include <cstdint>

#include "ir/module.h"
#include "jit/pool_window.h"

namespace shardstep::jit {

struct ConvShape {
  int64_t n, c, h, w;      // input NCHW
  int64_t o, kh, kw;       // filter OIHW
  int64_t sh, sw, ph, pw;  // stride, padding
  int64_t oh, ow;
  int64_t k() const { return c * kh * kw; }
  int64_t p() const { return oh * ow; }
};
// From the input shape, the filter shape and the op's stride/padding attributes.
ConvShape ConvShapeOf(const ir::Shape& x, const ir::Shape& w, const ir::Instr& in);

void Conv2dForward(const ConvShape& g, const float* x, const float* w, float* y);
void Conv2dInputGrad(const ConvShape& g, const float* dy, const float* w, float* dx);
void Conv2dFilterGrad(const ConvShape& g, const float* x, const float* dy, float* dw);

// Max/avg pooling over NCHW planes, the first maximum of a window wins (a NaN counts as a maximum).
using PoolShape = runtime::PoolWindow;
inline PoolShape PoolShapeOf(const ir::Shape& x, const ir::Instr& in) { return runtime::PoolWindowOf(x, in); }
void MaxPool(const PoolShape& g, const float* x, float* y);
// relu_mask: dx where x > 0 and +0 elsewhere (relu's gradient applied in the same pass; the JIT's
// MaskMaxPoolGradsByRelu).
void MaxPoolGrad(const PoolShape& g, const float* x, const float* dy, float* dx, bool relu_mask = false);

}  // namespace shardstep::jit
