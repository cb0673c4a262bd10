// A network's first convolution over one input channel (a grey image), 3x3, stride 1, padding 1, as
// direct AVX-512 loops (the channels-last forms also AVX2): the forward pass and the filter gradient
// (the input has no gradient).
//
// With one input channel, im2col + sgemm multiplies a 9-row column matrix (K = 9: sgemm's worst
// shape) and oneDNN's blocked kernels pad the channel to a block of 16. Here a row segment of 16
// outputs loads its 9 shifted input vectors once and makes every output channel from them with 9
// FMAs (the forward pass), or adds their products with the output gradient into 9 accumulators per
// output channel (the filter gradient): bench/conv measures it against the other paths.
//
// Every output multiplies all 9 taps, padded zeros included, in the same order (the interpreter's
// semantics: an inf weight meeting padding gives a NaN, and equal input patches give equal outputs).
// The forward pass splits images into blocks as TBB tasks (the results do not depend on the split); the
// filter gradient sums fixed groups of images (kFilterGradGroups, as the other paths), each group's
// sum in one fixed order, then adds the groups in order: the same bits on any number of threads.
#pragma once

#include "jit/cpu_kernels.h"

namespace shardstep::jit {

// The same groups of images as the other filter-gradient paths (dnnl_conv.cc, cpu_kernels.cc).
constexpr int64_t kStemFilterGradGroups = 8;

// Whether the stem loops compute this shape (one input channel, a 3x3 filter, stride 1, padding 1)
// on this CPU (AVX-512 Foundation, read once per process).
bool StemConvApplies(const ConvShape& g);

// x [n, 1, h, w], w [o, 1, 3, 3] -> y [n, o, h, w].
void StemConvForward(const ConvShape& g, const float* x, const float* w, float* y);
// x [n, 1, h, w], dy [n, o, h, w] -> dw [o, 1, 3, 3].
void StemConvFilterGrad(const ConvShape& g, const float* x, const float* dy, float* dw);

// The same on channels-last activations (jit/channels_last.h), for o a multiple of 16: y and dy are
// [n, h, w, o] (the image [n, h, w, 1] is the same bytes as [n, 1, h, w]). The forward pass gives the
// NCHW loops' bits; the filter gradient sums each group's terms in another order. These two also run
// on AVX2 CPUs (the same loops built for AVX2 + FMA, the same bits).
bool StemConvNhwcApplies(const ConvShape& g);
void StemConvForwardNhwc(const ConvShape& g, const float* x, const float* w, float* y);
void StemConvFilterGradNhwc(const ConvShape& g, const float* x, const float* dy, float* dw);

}  // namespace shardstep::jit
