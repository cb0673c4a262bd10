// xtensor in the C++ API (runtime/xtensor_io.h and the Executor's xtensor overloads): zero-copy views,
// conversions, and an MLP trained on xtensor batches that matches the Tensor path bit for bit.
#include "runtime/xtensor_io.h"

#include <catch2/catch.hpp>

#include <cstring>
#include <xtensor/xbuilder.hpp>
#include <xtensor/xmath.hpp>
#include <xtensor/xview.hpp>

#include "dsl/dsl.h"
#include "models/models.h"
#include "runtime/executor.h"
#include "runtime/sharding.h"

using namespace shardstep;
using namespace shardstep::runtime;

namespace {

// Bitwise equality of two float arrays (NaN-safe, -0 != +0).
bool SameBits(const xt::xarray<float>& a, const xt::xarray<float>& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("View adapts a tensor's buffer in place", "[xtensor]") {
  Tensor t = Tensor::F32({2, 3}, {1, 2, 3, 4, 5, 6});
  auto v = View<float>(t);
  REQUIRE(v.shape() == std::vector<std::size_t>{2, 3});
  CHECK(v(1, 2) == 6);
  CHECK(v.data() == t.f32.data());  // no copy
  v(0, 1) = 20;                      // writes through
  CHECK(t.f32[1] == 20);
  xt::view(v, 1, xt::all()) *= 2.0f;
  CHECK(t.f32 == std::vector<float>{1, 20, 3, 8, 10, 12});

  const Tensor& c = t;
  CHECK(xt::sum(View<float>(c))() == Approx(54));
  Tensor labels = Tensor::S32({3}, {7, 8, 9});
  CHECK(View<int32_t>(labels)(2) == 9);
  CHECK(View<float>(Tensor::Scalar(2.5f))() == 2.5f);  // rank 0
  CHECK_THROWS_WITH(View<float>(labels), Catch::Contains("s32[3] needs element type int32_t"));
  CHECK_THROWS_WITH(View<int32_t>(t), Catch::Contains("f32[2,3] needs element type float"));
}

TEST_CASE("FromXtensor copies an expression into an f32 or s32 tensor", "[xtensor]") {
  const Tensor f = FromXtensor(xt::arange<float>(6.0f).reshape({2, 3}) * 0.5f);
  CHECK(f == Tensor::F32({2, 3}, {0, 0.5f, 1, 1.5f, 2, 2.5f}));
  const xt::xarray<int32_t> labels = {3, 1, 4};
  CHECK(FromXtensor(labels) == Tensor::S32({3}, {3, 1, 4}));
  CHECK(FromXtensor(xt::xarray<float>(1.5f)) == Tensor::Scalar(1.5f));
}

TEST_CASE("TensorMaps convert to xtensor maps and back, s32 exactly", "[xtensor]") {
  const TensorMap m{{"w", Tensor::F32({2}, {1.25f, -0.0f})}, {"step", Tensor::S32({}, {41})}};
  const XtensorMap x = ToXtensor(m);
  CHECK(SameBits(x.at("w"), xt::xarray<float>{1.25f, -0.0f}));
  CHECK(x.at("step")() == 41.0f);
  CHECK(FromXtensor(x, m) == m);  // dtypes taken from `m`
  CHECK(FromXtensor(x).at("step").dtype() == ir::DType::kF32);

  XtensorMap bad = x;
  bad["step"] = 41.5f;
  CHECK_THROWS_WITH(FromXtensor(bad, m), Catch::Contains("@step: s32 values must be integers"));
  CHECK_THROWS_WITH(ToXtensor({{"big", Tensor::S32({1}, {(1 << 24) + 1})}}), Catch::Contains("@big"));

  const TensorMap in = FromXtensor(XtensorMap{{"image", xt::zeros<float>({2, 3})}},
                                   XtensorS32Map{{"label", xt::xarray<int32_t>{1, 2}}});
  CHECK(in.at("image").type.ToString() == "f32[2,3]");
  CHECK(in.at("label") == Tensor::S32({2}, {1, 2}));
  CHECK_THROWS_WITH(FromXtensor(XtensorMap{{"x", xt::zeros<float>({1})}}, XtensorS32Map{{"x", xt::zeros<int32_t>({1})}}),
                    Catch::Contains("@x given both"));
}

TEST_CASE("an MLP trained on xtensor batches matches the Tensor path bitwise", "[xtensor][train]") {
  constexpr int64_t kBatch = 16;
  constexpr int kSteps = 4;
  dsl::Model model("mlp", /*seed=*/3);
  models::ModelOptions mo;
  mo.batch = kBatch;
  mo.hidden = {16};
  dsl::Program p = model.train(models::DefineMlp(model, mo)).optimizer(dsl::Adam().lr(1e-2)).build();
  const TensorMap init = InitLogicalState(p.step);
  auto by_tensor = MakeInterpreterExecutor(p.step, init);
  auto by_xtensor = MakeInterpreterExecutor(p.step, init);

  for (int s = 0; s < kSteps; ++s) {
    // A user's batch, made with xtensor.
    xt::xarray<float> images = xt::sin(xt::arange<float>(s * 100.0f, s * 100.0f + kBatch * 784) * 0.37f);
    images.reshape({kBatch, 784});
    const xt::xarray<int32_t> labels = (xt::arange<int32_t>(kBatch) * 7 + s) % 10;

    // The Tensor path, built by hand.
    const TensorMap in{{"image", Tensor::F32({kBatch, 784}, std::vector<float>(images.begin(), images.end()))},
                       {"label", Tensor::S32({kBatch}, std::vector<int32_t>(labels.begin(), labels.end()))}};
    const TensorMap out = by_tensor->Step(in);
    const XtensorMap xout = by_xtensor->Step({{"image", images}}, {{"label", labels}});

    REQUIRE(xout.count("loss"));
    INFO("step " << s);
    CHECK(SameBits(xout.at("loss"), View<float>(out.at("loss"))));
  }

  // The weights read back as xtensor, bit for bit those of the Tensor path.
  const TensorMap state = by_tensor->LogicalState();
  const XtensorMap xstate = by_xtensor->LogicalStateXt();
  REQUIRE(xstate.size() == state.size());
  for (const auto& [name, t] : state) {
    INFO("variable " << name);
    if (t.dtype() == ir::DType::kF32) CHECK(SameBits(xstate.at(name), View<float>(t)));
    else CHECK(xstate.at(name) == xt::cast<float>(View<int32_t>(t)));
    CHECK_FALSE(t == init.at(name));  // trained
  }
  CHECK(xstate.at("step")() == kSteps);

  // Loaded back from xtensor (the step counter returns to s32), the state is unchanged.
  by_xtensor->LoadLogicalState(xstate);
  CHECK(by_xtensor->LogicalState() == state);
  // A weight edited as xtensor reaches the executor.
  XtensorMap edited = xstate;
  edited.at("fc1.b").fill(0.25f);
  by_xtensor->LoadLogicalState(edited);
  CHECK(xt::all(xt::equal(View<float>(by_xtensor->LogicalState().at("fc1.b")), 0.25f)));
}
