// The filter gradient of a 3x3, stride-1, padding-1 convolution with 16 channels in and 16 out, on
// channels-last (NHWC) activations, as direct AVX-512 loops.
//
// resnet20's first stage has six such convolutions. oneDNN's kernel for this gradient ran at 169
// GFLOP/s on 2 cores where its forward kernel for the same shape ran at 294 (bench/conv). Here one
// output position adds, for one tap, the outer product of its 16 input channels and 16 output-gradient
// channels into 16 accumulators (one per input channel, lanes over the output channels): 16 FMAs, each
// with its input value broadcast from memory, per gradient vector loaded. An image's input and
// gradient (2 x 50 KB at 28x28) stay in L2 while its 9 taps run.
//
// Taps that fall on padding are skipped (a padded zero times a finite gradient adds nothing); a
// gradient with an inf or a NaN takes the caller's exact path instead (ConvKernel::Run), where the
// padded zeros are multiplied as the interpreter does. The images are summed in the same fixed groups
// as the other filter-gradient paths, each group's sum in one fixed order (image, row, column), then
// the groups added in order: the same bits on any number of threads.
#pragma once

#include "jit/cpu_kernels.h"

namespace shardstep::jit {

// Whether these loops compute this filter gradient (16 -> 16 channels, 3x3, stride 1, padding 1) on
// this CPU (AVX-512 Foundation, read once per process).
bool Nhwc16FilterGradApplies(const ConvShape& g);

// x [n, h, w, 16], dy [n, h, w, 16] (NHWC) -> dw [16, 16, 3, 3] (OIHW).
void Nhwc16FilterGrad(const ConvShape& g, const float* x, const float* dy, float* dw);

}  // namespace shardstep::jit
