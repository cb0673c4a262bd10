// Winograd F(2x2, 3x3) convolution on channels-last (NHWC) activations, as AVX-512 or AVX2 loops (one
// body, jit/winograd_nhwc_loops.inc, built for each; the widest the CPU has runs): the forward
// pass and the filter gradient of a 3x3, stride-1, padding-1 convolution with input and output channels
// in multiples of 16 from 32 (and, through the turned filter, its input gradient: ConvKernel::RunTurned).
//
// oneDNN's direct kernels already run resnet20's convolutions at this CPU's f32 peak; Winograd's
// F(2x2, 3x3) computes a 2x2 output tile with 16 multiplies per channel pair where the direct form
// needs 36 (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", 2016). oneDNN's own
// Winograd (F(4x4, 3x3), blocked layouts, transforms through memory) gained nothing with 16 channels
// (jit/dnnl_conv.cc). Here each group of T output tiles of one image runs in cache: its input tiles
// transformed (V = B^T d B, 16 positions x T tiles x C channels), one small product per position
// (M[p] = V[p] U[p], the filter transformed once per call, U = G g G^T, [16][C][O]), and the output
// transform (Y = A^T M A) stored straight into the NHWC output: the activations are read and written
// once, as by the direct kernel. The filter gradient is the same identity transposed: dW = G^T [(A dY
// A^T) (.) (B^T d B)] G summed over the tiles, the products over the tiles of several images per sweep.
// With 16 channels on AVX-512 the transforms cost as much as the multiplies they save (bench/conv:
// 0.93-1.45x the direct kernel's time, slower in the step), so those stay on oneDNN and the 16-channel
// loops there. On AVX2 (AMD Zen 3, bench/conv at 28x28, batch 128), where oneDNN's direct kernels run
// at 55-75% of the FMA peak, the loops take 0.7-0.8x the direct time forward with 16-64 channels,
// 0.6-0.9x in the gradients, and resnet20's step 195 -> 151 ms: they take 16 channels too.
//
// Numbers: the transforms add and halve exactly up to f32 rounding; the result differs from the
// direct sum in the last bits (within the conformance tolerance of the interpreter's, as oneDNN's
// Winograd). One input inf or NaN spreads over its whole tile, where the direct sum confines it to the
// outputs whose window holds it, and the filter's halvings can turn an inf weight into NaNs: the
// caller checks the weights first, and the loops report a result that is not finite, so the caller
// computes such calls by its exact path. A tile's outputs depend on its place in the image, so two
// equal input patches can give different outputs in their last bits: not for a module with max
// pooling (ConvTies::kExact). Each output is computed by one fixed sequence of operations whatever
// the thread count: the same bits on any number of threads.
#pragma once

#include "jit/cpu_kernels.h"

namespace shardstep::jit {

// Whether these loops compute this convolution (3x3, stride 1, padding 1, input and output channels
// multiples of 16 from 32 (AVX-512) or 16 (AVX2) up to 256) on this CPU (AVX-512 Foundation, or AVX2 with FMA; read once per
// process).
bool WinogradNhwcApplies(const ConvShape& g);
// The loops this CPU runs: "avx512", "avx2" or "none".
const char* WinogradNhwcIsa();

// x [n, h, w, c] (NHWC), w [o, c, 3, 3] (OIHW, finite) -> y [n, h, w, o] (NHWC). Returns false when an
// output is an inf or a NaN (y then holds values the caller must recompute). Scratch per thread, grown
// at its first call: no allocation afterwards.
bool WinogradNhwcForward(const ConvShape& g, const float* x, const float* w, float* y);

// The filter gradient of the same convolution: x [n, h, w, c] and dy [n, h, w, o] (NHWC) -> dw [o, c,
// 3, 3] (OIHW), dW = G^T [(A dY A^T) (.) (B^T d B)] G summed over the tiles, in fixed groups of images
// added in order. Returns false when an element of dw is an inf or a NaN (the caller recomputes).
bool WinogradNhwcFilterGrad(const ConvShape& g, const float* x, const float* dy, float* dw);

}  // namespace shardstep::jit
