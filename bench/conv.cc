// bench/conv: resnet20's convolutions (batch 128, 28x28 input) forward, input gradient and filter
// gradient on the CPU JIT's six paths, measured in one run: im2col + sgemm per image (the old path),
// oneDNN's convolution primitives on plain NCHW/OIHW memory, on oneDNN's blocked layouts with the
// reorders from and to NCHW/OIHW included, oneDNN's Winograd kernels on those layouts (3x3
// stride-1 convolutions only), the stem loops (one input channel; jit/stem_conv.h; also on the
// CNN's 32-channel stem, which is not in resnet20's step count), and oneDNN on NHWC activations (the
// channels-last path a step takes for >= 8 channels, jit/channels_last.h: its operands and result
// are NHWC, so no reorder is timed; its result is transposed back for the checks), and on that path our
// Winograd F(2x2, 3x3) loops (jit/winograd_nhwc.h: the forward pass, and the input gradient through the
// turned filter; where WinogradAllowed). Each path runs as the step runs it (blocks of images as TBB
// tasks, one OpenMP thread per oneDNN call). Medians of wall time over --reps calls, the paths
// measured alternately so machine noise hits all alike; ratios are against im2col. It also checks
// the numbers: each path against im2col (max |diff| relative to the largest |value|), the same bits
// twice, and the same bits on one TBB thread as on all of them.
#include <CLI/CLI.hpp>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <memory>
#include <vector>

#include "ir/error.h"
#include "jit/data_movement.h"
#include "jit/dnnl_conv.h"
#include "jit/stem_conv.h"
#include "jit/dnnl_kernels.h"

using namespace shardstep;
using jit::ConvKind;
using jit::ConvPath;

namespace {

struct Layer {
  const char* name;
  int64_t c, o, stage, k, stride, pad, count;  // stage: input size image / 2^stage; count: per resnet20 step (0: the CNN's layer)
};

// resnet20 on 1 x image x image inputs (models/resnet.cc): stem, three stages of three blocks (the first block
// of stages 2 and 3 strides by 2 and has a 1x1 projection).
const Layer kLayers[] = {
    {"stem 1->16 3x3", 1, 16, 0, 3, 1, 1, 1},    {"cnn stem 1->32 3x3", 1, 32, 0, 3, 1, 1, 0},    {"s1 16->16 3x3", 16, 16, 0, 3, 1, 1, 6},
    {"s2 16->32 3x3/2", 16, 32, 0, 3, 2, 1, 1},  {"s2 32->32 3x3", 32, 32, 1, 3, 1, 1, 5},
    {"s3 32->64 3x3/2", 32, 64, 1, 3, 2, 1, 1},  {"s3 64->64 3x3", 64, 64, 2, 3, 1, 1, 5},
    {"proj 16->32 1x1/2", 16, 32, 0, 1, 2, 0, 1}, {"proj 32->64 1x1/2", 32, 64, 1, 1, 2, 0, 1},
    {"cnn 32->64 3x3", 32, 64, 1, 3, 1, 1, 0},
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// NCHW <-> NHWC of n images of c channels and p pixels.
std::vector<float> ToNhwc(const std::vector<float>& x, int64_t n, int64_t c, int64_t p) {
  std::vector<float> y(x.size());
  jit::NchwToNhwc(x.data(), n, c, p, y.data());
  return y;
}
std::vector<float> ToNchw(const std::vector<float>& x, int64_t n, int64_t c, int64_t p) {
  std::vector<float> y(x.size());
  jit::NhwcToNchw(x.data(), n, c, p, y.data());
  return y;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Convolution paths of the CPU JIT on resnet20's shapes"};
  int64_t batch = 128;
  int reps = 15;
  int64_t image = 28;
  app.add_option("--batch", batch, "images per call");
  app.add_option("--image", image, "input height and width (28: Fashion-MNIST, 32: CIFAR)")->check(CLI::Range(4, 512));
  app.add_option("--reps", reps, "timed calls per path (median)");
  CLI11_PARSE(app, argc, argv);
  jit::ConfigureThreadsForReplica(1);

  const ConvKind kinds[] = {ConvKind::kForward, ConvKind::kInputGrad, ConvKind::kFilterGrad};
  const char* kind_names[] = {"forward", "input-grad", "filter-grad"};
  const ConvPath paths[] = {ConvPath::kIm2col, ConvPath::kDnnlPlain, ConvPath::kDnnlBlocked, ConvPath::kDnnlWinograd,
                            ConvPath::kStem, ConvPath::kDnnlChannelsLast};
  constexpr int kPaths = 7, kNhwc = 5, kNhwcWinograd = 6;  // the last: kDnnlChannelsLast with ConvTies::kFree
  std::printf("image %lldx%lld, batch %lld, %d reps, %d hardware threads; median ms per call, ratio vs im2col\n",
              static_cast<long long>(image), static_cast<long long>(image), static_cast<long long>(batch), reps, jit::NumCores());
  std::printf("%-19s %-11s %9s %9s %6s %9s %6s %9s %6s %9s %6s %9s %6s %9s %6s  %-15s  %s\n", "layer", "kind", "im2col",
              "plain", "ratio", "blocked", "ratio", "winograd", "ratio", "stem", "ratio", "nhwc", "ratio", "nhwc-wino",
              "ratio", "preferred", "checks (max rel diff vs im2col; bits)");
  double step_old = 0, step_new = 0, step_nhwc = 0;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uni(-1, 1);
  bool all_ok = true;
  for (const Layer& l : kLayers) {
    int64_t h = image;
    for (int64_t s = 0; s < l.stage; ++s) h = (h + 2 - 3) / 2 + 1;  // a 3x3 stride-2 convolution with padding 1
    jit::ConvShape g{batch, l.c, h, h, l.o, l.k, l.k, l.stride, l.stride, l.pad, l.pad, 0, 0};
    g.oh = (g.h + 2 * g.ph - g.kh) / g.sh + 1;
    g.ow = (g.w + 2 * g.pw - g.kw) / g.sw + 1;
    std::vector<float> x(g.n * g.c * g.h * g.w), w(g.o * g.k()), dy(g.n * g.o * g.p());
    for (float& v : x) v = uni(rng);
    for (float& v : w) v = uni(rng);
    for (float& v : dy) v = uni(rng);
    const std::vector<float> x_nhwc = ToNhwc(x, g.n, g.c, g.h * g.w), dy_nhwc = ToNhwc(dy, g.n, g.o, g.p());
    for (int ki = 0; ki < 3; ++ki) {
      const ConvKind kind = kinds[ki];
      if (kind == ConvKind::kInputGrad && l.c == 1) continue;  // the step needs no gradient of the images
      const float* a = kind == ConvKind::kInputGrad ? dy.data() : x.data();
      const float* b = kind == ConvKind::kFilterGrad ? dy.data() : w.data();
      // The channels-last path's operands: the activations NHWC.
      const float* a_nhwc = kind == ConvKind::kInputGrad ? dy_nhwc.data() : x_nhwc.data();
      const float* b_nhwc = kind == ConvKind::kFilterGrad ? dy_nhwc.data() : w.data();
      auto A = [&](int p) { return p >= kNhwc ? a_nhwc : a; };
      auto B = [&](int p) { return p >= kNhwc ? b_nhwc : b; };
      const size_t out_size = kind == ConvKind::kForward ? dy.size() : kind == ConvKind::kInputGrad ? x.size() : w.size();
      // Every path that takes the shape (oneDNN's Winograd only 3x3 stride-1 ones with channels in 16s).
      std::vector<std::unique_ptr<jit::ConvKernel>> kernels;
      for (ConvPath p : paths) {
        try {
          // (The channels-last rewrite takes >= 8 channels, and one-channel stems by the stem loops.)
          const bool stem = kind != ConvKind::kInputGrad && jit::StemConvNhwcApplies(g);
          if (p == ConvPath::kDnnlChannelsLast && (g.c % 8 != 0 || g.o % 8 != 0) && !stem) throw Error("not rewritten");
          kernels.push_back(std::make_unique<jit::ConvKernel>(kind, g, p));
        } catch (const Error&) {
          kernels.push_back(nullptr);
        }
      }
      // The channels-last path as a module without max pooling takes it: with the Winograd loops where they apply.
      kernels.push_back(nullptr);
      if (kernels[kNhwc] && g.c != 1) {
        auto k = std::make_unique<jit::ConvKernel>(kind, g, ConvPath::kDnnlChannelsLast, jit::ConvTies::kFree);
        if (k->winograd()) kernels[kNhwcWinograd] = std::move(k);
      }
      std::vector<std::vector<float>> out(kPaths, std::vector<float>(out_size));
      std::vector<double> ms[kPaths];
      for (int p = 0; p < kPaths; ++p)
        if (kernels[p]) kernels[p]->Run(A(p), B(p), out[p].data());  // warm-up (per-thread state)
      for (int r = 0; r < reps; ++r)
        for (int p = 0; p < kPaths; ++p) {
          if (!kernels[p]) continue;
          const auto t0 = std::chrono::steady_clock::now();
          kernels[p]->Run(A(p), B(p), out[p].data());
          ms[p].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3);
        }
      // Checks: each path against im2col (the channels-last result transposed back to NCHW); the same
      // bits again, and on one TBB thread.
      auto nchw = [&](const std::vector<float>& v) {
        if (kind == ConvKind::kFilterGrad) return v;
        return kind == ConvKind::kForward ? ToNchw(v, g.n, g.o, g.p()) : ToNchw(v, g.n, g.c, g.h * g.w);
      };
      float scale = 0;
      for (float v : out[0]) scale = std::max(scale, std::fabs(v));
      std::string checks;
      const char* short_names[] = {"im2col", "plain", "blocked", "winograd", "stem", "nhwc", "nhwc-wino"};
      for (int p = 1; p < kPaths; ++p) {
        if (!kernels[p]) continue;
        double diff = 0;
        const std::vector<float> mine = p >= kNhwc ? nchw(out[p]) : out[p];
        for (size_t i = 0; i < out_size; ++i) diff = std::max(diff, static_cast<double>(std::fabs(mine[i] - out[0][i])));
        std::vector<float> again(out_size), one(out_size);
        kernels[p]->Run(A(p), B(p), again.data());
        tbb::task_arena(1).execute([&] { kernels[p]->Run(A(p), B(p), one.data()); });
        const bool same = SameBits(again, out[p]) && SameBits(one, out[p]);
        all_ok &= same && diff <= 1e-5 * scale;
        char buf[96];
        std::snprintf(buf, sizeof buf, "%s %.1e %s; ", short_names[p], diff / scale, same ? "same" : "DIFFER");
        checks += buf;
      }
      double m[kPaths];
      for (int p = 0; p < kPaths; ++p) m[p] = kernels[p] ? Median(ms[p]) : NAN;
      // resnet20 has no max pooling: its forward passes may take Winograd (ConvTies::kFree).
      const ConvPath chosen = jit::PreferredConvPath(kind, g, jit::ConvTies::kFree);
      const int ci = static_cast<int>(std::find(std::begin(paths), std::end(paths), chosen) - std::begin(paths));
      SS_CHECK(kernels[ci], "the preferred path ", jit::ConvPathName(chosen), " does not take ", l.name);
      step_old += l.count * m[0];
      step_new += l.count * m[ci];
      // (resnet20's step has two forward ones: rewritten; with the Winograd loops where they apply.)
      step_nhwc += l.count * (kernels[kNhwcWinograd] ? m[kNhwcWinograd] : kernels[kNhwc] ? m[kNhwc] : m[ci]);
      const int shown = kernels[kNhwcWinograd] ? kNhwcWinograd : kNhwc;
      std::printf("%-19s %-11s %9.3f %9.3f %6.2f %9.3f %6.2f %9.3f %6.2f %9.3f %6.2f %9.3f %6.2f %9.3f %6.2f  %-15s  %s[%s%s%s]\n",
                  l.name, kind_names[ki], m[0], m[1], m[1] / m[0], m[2], m[2] / m[0], m[3], m[3] / m[0], m[4], m[4] / m[0],
                  m[kNhwc], m[kNhwc] / m[0], m[kNhwcWinograd], m[kNhwcWinograd] / m[0], jit::ConvPathName(chosen),
                  checks.c_str(), kernels[ci]->Describe().c_str(), kernels[shown] ? "; " : "",
                  kernels[shown] ? kernels[shown]->Describe().c_str() : "");
    }
  }
  std::printf("resnet20 step's convolutions (each layer x its count): im2col %.2f ms, preferred NCHW paths %.2f ms (ratio %.2f), "
              "channels-last as the step runs them (nhwc where it applies: no reorders of the activations) %.2f ms (ratio %.2f)\n",
              step_old, step_new, step_new / step_old, step_nhwc, step_nhwc / step_old);
  std::printf("checks: %s\n", all_ok ? "all paths within 1e-5 of im2col, deterministic and thread-count independent"
                                     : "FAILED (see the rows)");
  return all_ok ? 0 : 1;
}
