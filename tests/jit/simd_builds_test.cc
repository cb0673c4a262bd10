// The loops written once over jit/simd.h's vector types (jit/simd_each_target.inc) give the same bits
// in their AVX-512 and AVX2 builds: the Winograd loops (forward and filter gradient), the channels-last
// stem and 2x2 max pooling with its gradient. Both builds run only on an AVX-512 CPU (the AVX2 one
// through simd::LanesForTesting); elsewhere the test says so and checks that the narrower lanes cannot
// be forced past what the CPU has.
#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "jit/max_pool_2x2.h"
#include "jit/simd.h"
#include "jit/stem_conv.h"
#include "jit/winograd_nhwc.h"
#include "tests/jit/conv_test_util.h"

using namespace shardstep;
using conv_test::RandomF32;

namespace {

// run(out) on 16 lanes and on 8, each into a buffer of `size` floats first filled with a marker.
void CheckSameBits(int64_t size, const std::function<void(float*)>& run) {
  std::vector<float> wide(size, 7.0f), narrow(size, 7.0f);
  jit::simd::LanesForTesting() = 16;
  run(wide.data());
  jit::simd::LanesForTesting() = 8;
  REQUIRE(jit::simd::CpuLanes() == 8);
  run(narrow.data());
  jit::simd::LanesForTesting() = 0;
  CHECK(std::memcmp(wide.data(), narrow.data(), 4 * size) == 0);
}

}  // namespace

TEST_CASE("the AVX-512 and AVX2 builds of the vector loops give the same bits", "[jit][conv]") {
  if (jit::simd::CpuLanes() != 16) {
    jit::simd::LanesForTesting() = 16;
    CHECK(jit::simd::CpuLanes() != 16);  // never wider than the CPU
    jit::simd::LanesForTesting() = 0;
    WARN("no AVX-512: only one build of the vector loops runs here");
    return;
  }
  SECTION("Winograd") {
    // 48 input channels (3 AVX-512 vectors, 6 AVX2 ones: the filter gradient's channel blocks have a
    // tail on both), 32 and 80 output channels, partial tiles.
    for (const auto& [c, o, h, w] : {std::array<int64_t, 4>{48, 32, 7, 9}, {32, 80, 6, 5}, {64, 64, 14, 14}}) {
      INFO(c << " -> " << o << " channels, " << h << "x" << w);
      const int64_t n = 3;
      const jit::ConvShape g{n, c, h, w, o, 3, 3, 1, 1, 1, 1, h, w};
      const runtime::Tensor x = RandomF32({n, h, w, c}, 1), wt = RandomF32({o, c, 3, 3}, 2), dy = RandomF32({n, h, w, o}, 3);
      CheckSameBits(n * h * w * o, [&](float* y) { CHECK(jit::WinogradNhwcForward(g, x.f32.data(), wt.f32.data(), y)); });
      CheckSameBits(o * c * 9, [&](float* dw) { CHECK(jit::WinogradNhwcFilterGrad(g, x.f32.data(), dy.f32.data(), dw)); });
    }
  }
  SECTION("channels-last stem") {
    const int64_t n = 5, h = 9, w = 13, o = 32;  // 13 columns: a row tail on 8- and 4-pixel steps
    const jit::ConvShape g{n, 1, h, w, o, 3, 3, 1, 1, 1, 1, h, w};
    REQUIRE(jit::StemConvNhwcApplies(g));
    const runtime::Tensor x = RandomF32({n, h, w, 1}, 4), wt = RandomF32({o, 1, 3, 3}, 5), dy = RandomF32({n, h, w, o}, 6);
    CheckSameBits(n * h * w * o, [&](float* y) { jit::StemConvForwardNhwc(g, x.f32.data(), wt.f32.data(), y); });
    CheckSameBits(o * 9, [&](float* dw) { jit::StemConvFilterGradNhwc(g, x.f32.data(), dy.f32.data(), dw); });
  }
  SECTION("channels-last 2x2 max pooling") {
    for (int64_t c : {32, 20, 12}) {  // lane tails on both builds
      INFO(c << " channels");
      const jit::NhwcPool g{3, 6, 10, c};
      runtime::Tensor x = RandomF32({3, 6, 10, c}, 7);
      for (size_t i = 0; i < x.f32.size(); i += 5) x.f32[i] = x.f32[i + 1];  // ties
      x.f32[11] = NAN;
      const runtime::Tensor dy = RandomF32({3, 3, 5, c}, 8);
      CheckSameBits(3 * 3 * 5 * c, [&](float* y) { jit::MaxPool2x2Nhwc(g, x.f32.data(), y); });
      for (bool relu : {false, true})
        CheckSameBits(3 * 6 * 10 * c,
                      [&](float* dx) { jit::MaxPool2x2GradNhwc(g, x.f32.data(), dy.f32.data(), dx, relu); });
    }
  }
}
