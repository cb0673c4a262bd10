// ChannelsLast: the JIT's rewrite of a step's convolutions and the loops between them to NHWC.
//
// oneDNN's direct convolution kernels want channels innermost. On the IR's NCHW activations every call
// reordered its input to a blocked layout and its output back (bench/conv, resnet20's step: 107-114 ms
// of convolutions with the reorders, 82-86 ms without). This rewrite runs those convolutions on NHWC
// activations (jit_nhwc=1, ConvPath::kDnnlChannelsLast) and carries NHWC through what lies between
// them: elementwise ops (batch norm's arithmetic, relu and its mask, the residual adds, bf16 rounding),
// broadcasts of per-channel values (their dims remapped) and reductions whose kept dimensions keep
// their order (batch norm's sums over N, H, W; global average pooling over H, W), and 2x2 stride-2 max
// pooling with its gradient (the CNN's, jit/max_pool_2x2.h). A value needed NCHW
// elsewhere (a reshape, a pooling op) is transposed back where it is read; a transpose of a transpose
// is never made. A network's first convolution over one input channel (a grey image) runs too, by the
// stem loops' channels-last form (jit/stem_conv.h): its image is the same bytes in both layouts (a
// reshape), and its output NHWC spares the transposes of the first stage's activations.
//
// Elementwise ops compute the same values in another order of elements, so they keep their bits; a
// reduction sums the same terms in the order of its new layout (within the conformance tolerance of
// the interpreter's, as before: reductions accumulate in f64), the same on every run and thread count.
#pragma once

#include "ir/module.h"

namespace shardstep::jit {

// The attribute marking a convolution whose activation operands and result are NHWC ([N,H,W,C]); its
// attributes (stride, padding, input_shape, filter_shape) and weights keep the IR's NCHW/OIHW meaning.
inline constexpr const char* kNhwcAttr = "jit_nhwc";

// Rewrites f32 convolutions with at least 8 input and 8 output channels that oneDNN has an NHWC kernel
// for (and one-channel stems the stem loops take), and their neighbourhood as above, when the module
// has at least two such forward convolutions besides a stem, or one after a stem with every max
// pooling of the module taken by the NHWC loops.
// Returns the convolutions rewritten.
int ConvolutionsChannelsLast(ir::Module& m);

}  // namespace shardstep::jit
