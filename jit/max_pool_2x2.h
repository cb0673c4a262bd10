// Max pooling over 2x2 windows with stride 2 (no padding) and its gradient, as AVX-512 loops over
// 16 outputs of a row at a time: the even and odd columns of two input rows are split into the four
// candidates of 16 windows, and the first-maximum rule (candidates in row-major order, a NaN counts as
// a maximum) runs as mask compares and blends. Masked loads and stores take a row's tail, so rows of
// 7 or 14 outputs (Fashion-MNIST's CNN) are vector work too; GCC's own vectorisation of the scalar loop
// (jit/cpu_kernels.cc) left them to scalar tails. The results are the scalar loops' bits: selects only,
// and the gradient's 0 + dy. The channels-last forms (jit/channels_last.h) take the same rule on NHWC
// activations, 16 channels (AVX2: 8) of one window position at a time: no shuffles.
#pragma once

#include "jit/cpu_kernels.h"

namespace shardstep::jit {

// Whether this CPU runs the NCHW loops below (AVX-512 Foundation; read once per process).
bool MaxPool2x2Vectorised();
// Whether it runs the channels-last ones (AVX-512 Foundation, or AVX2 with FMA).
bool MaxPool2x2NhwcVectorised();

// Requires g 2x2, stride 2, no padding. y[plane, i, j] = the first maximum of x's window (2i.., 2j..).
void MaxPool2x2(const PoolShape& g, const float* x, float* y);
// Requires also h == 2 oh and w == 2 ow (the windows tile the plane): every element of dx is written,
// 0 + dy at each window's first maximum (and, with relu_mask, only where that x > 0) and +0 elsewhere.
void MaxPool2x2Grad(const PoolShape& g, const float* x, const float* dy, float* dx, bool relu_mask);

// The same on NHWC activations: x [n, h, w, c], y and dy [n, h / 2, w / 2, c]; h and w even (the
// windows tile the image, so the gradient writes every element of dx). The bits of the NCHW forms.
struct NhwcPool {
  int64_t n, h, w, c;
};
void MaxPool2x2Nhwc(const NhwcPool& g, const float* x, float* y);
void MaxPool2x2GradNhwc(const NhwcPool& g, const float* x, const float* dy, float* dx, bool relu_mask);

}  // namespace shardstep::jit
