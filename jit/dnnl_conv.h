// Convolution and its two gradients planned once per shape (at compile time): im2col + sgemm per image
// (jit/cpu_kernels.h) or oneDNN's convolution primitives, built when the step is planned. The work is
// split into blocks that depend only on the shapes (chunks of images for the forward pass and the
// input gradient; the filter gradient's fixed groups of images, their partial sums added in order),
// each block one oneDNN call on one OpenMP thread inside a TBB task (jit/dnnl_kernels.h): the results
// do not depend on the number of threads or replicas.
#pragma once

#include <memory>
#include <string>

#include "jit/cpu_kernels.h"

namespace shardstep::jit {

enum class ConvKind { kForward, kInputGrad, kFilterGrad };
// kDnnlPlain: oneDNN on the IR's NCHW/OIHW memory. kDnnlBlocked: oneDNN's preferred (blocked) layouts
// (format `any`), reordered from and to NCHW/OIHW around every block. kDnnlWinograd: oneDNN's
// Winograd F(4x4, 3x3) kernels on the blocked layouts (3x3, stride 1; about half the multiplies, within
// the conformance tolerance); a call whose result holds an inf or a NaN is computed again on the
// kDnnlBlocked path, since Winograd's transforms spread one non-finite input over a whole tile.
// kStem: direct AVX-512 loops for a 3x3 stride-1 convolution over one input channel (jit/stem_conv.h;
// the forward pass and the filter gradient). kDnnlChannelsLast: oneDNN's direct kernels on activations
// stored NHWC (the JIT's channels-last form, jit/channels_last.h), read and written in place: only the
// weights are reordered. On that path a one-channel stem takes the stem loops' channels-last form, and
// the 16 -> 16 channel 3x3 stride-1 convolutions (resnet20's first
// stage) take two faster routes: the filter gradient our own AVX-512 loops (jit/nhwc16_filter_grad.h),
// the input gradient oneDNN's forward kernel with the filter turned (see ConvKernel::RunTurned). Where
// Winograd pays (WinogradAllowed), 3x3 stride-1 padding-1 convolutions with channels in 16s take our
// Winograd F(2x2, 3x3) loops (jit/winograd_nhwc.h) for the forward pass (not next to max pooling:
// ConvTies), the filter gradient and, through the turned filter, the input gradient; oneDNN's kernel
// stays for the calls whose weights or result are not all finite.
enum class ConvPath { kIm2col, kDnnlPlain, kDnnlBlocked, kDnnlWinograd, kStem, kDnnlChannelsLast };
const char* ConvPathName(ConvPath p);
// Whether equal input patches must give equal forward outputs: a module with max pooling, whose choice
// among equal values follows exact ties (Winograd's result depends on a patch's place in its tile).
enum class ConvTies { kFree, kExact };

// Whether a step may run convolutions channels-last (jit/channels_last.h): not when the environment
// variable SHARDSTEP_CONV=im2col asks for im2col for every convolution (read once per process).
bool ChannelsLastAllowed();
// Whether Winograd pays on this CPU at all (bench/conv: on an AMD CPU it did, on an Intel one with AMX
// it did not); read once per process.
bool WinogradCpu();
// Whether our channels-last Winograd loops (jit/winograd_nhwc.h) may run where they apply: on a CPU
// where they pay (WinogradCpu, or one without AVX-512), unless the environment variable SHARDSTEP_CONV
// asks for direct or im2col kernels.
bool WinogradAllowed();
// The faster path for this convolution by bench/conv's measurements: a rule on the shape (and ties)
// and the CPU class alone, so the same module always computes the same bits on one machine.
ConvPath PreferredConvPath(ConvKind kind, const ConvShape& g, ConvTies ties = ConvTies::kExact,
                           bool winograd_cpu = WinogradCpu());
// The path a step takes: PreferredConvPath, or im2col for every convolution when the environment
// variable SHARDSTEP_CONV=im2col is set, or no Winograd with SHARDSTEP_CONV=direct (read once per
// process; to compare them).
ConvPath ChooseConvPath(ConvKind kind, const ConvShape& g, ConvTies ties = ConvTies::kExact);

// Images per oneDNN call for the forward pass and the input gradient.
constexpr int64_t kConvChunk = 8;

// One convolution op of a step. Forward: Run(x, w, y); input gradient: Run(dy, w, dx); filter
// gradient: Run(x, dy, dw); activations NCHW, or NHWC on the kDnnlChannelsLast path. Thread-safe: replicas run it at once. After the calling thread's first
// call (which makes its memory objects), a call with the operands at the same addresses allocates
// nothing (executed through oneDNN's C API: no argument map).
class ConvKernel {
 public:
  // ties: on the kDnnlChannelsLast path, kFree lets a forward pass take the Winograd loops.
  ConvKernel(ConvKind kind, const ConvShape& g, ConvPath path, ConvTies ties = ConvTies::kExact);
  ~ConvKernel();
  void Run(const float* a, const float* b, float* out) const;
  ConvPath path() const { return path_; }
  // Whether its calls run Winograd loops (oneDNN's, or ours on NHWC activations, also turned).
  bool winograd() const;
  // oneDNN's implementation names (e.g. "jit:avx2"), or "im2col+sgemm".
  std::string Describe() const;

  struct Impl;  // the primitives (dnnl_conv.cc)

 private:
  void RunExactChannelsLast(const float* a, const float* b, float* out) const;
  void RunTurned(const float* dy, const float* w, float* dx) const;
  void RunPrimitives(const float* a, const float* b, float* out) const;
  ConvKind kind_;
  ConvShape g_;
  ConvPath path_;
  std::shared_ptr<const Impl> impl_;  // the primitives (null for kIm2col, kStem, nhwc16_filter_grad_, stem_nhwc_)
  bool nhwc16_filter_grad_ = false;   // kDnnlChannelsLast filter gradient by Nhwc16FilterGrad
  bool stem_nhwc_ = false;            // kDnnlChannelsLast one-channel stem (StemConvForwardNhwc, ...)
  bool winograd_nhwc_ = false;        // kDnnlChannelsLast forward or filter gradient by the Winograd loops
                                      // (impl_ the exact path)
  // kDnnlChannelsLast input gradient of a 3x3 stride-1 padding-1 convolution with 16 channels in and
  // out, or with channels in 16s where the Winograd loops run: the forward kernel that computes it from
  // the turned filter (RunTurned).
  std::shared_ptr<const ConvKernel> turned_forward_;
};

// The kernel for (kind, shape, ties), built at the first request (when a step is planned) and cached
// for the process; the path is ChooseConvPath's (the next one when oneDNN refuses the shape: Winograd,
// then blocked, then im2col).
std::shared_ptr<const ConvKernel> PlannedConv(ConvKind kind, const ConvShape& g, ConvTies ties = ConvTies::kExact);
// The kernel on NHWC activations (kDnnlChannelsLast; `g` still names the sizes as NCHW/OIHW), or null
// when oneDNN has none for the shape. Cached as PlannedConv's.
std::shared_ptr<const ConvKernel> PlannedChannelsLastConv(ConvKind kind, const ConvShape& g,
                                                          ConvTies ties = ConvTies::kExact);

}  // namespace shardstep::jit
