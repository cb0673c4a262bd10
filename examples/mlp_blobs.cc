// A 2-layer MLP learns three Gaussian blobs in the plane, on 2 replicas with a sharded weight update:
// the whole new-user program (shardstep/shardstep.h), from the model to a checkpoint.
#include <cmath>
#include <algorithm>
#include <cstdio>
#include <random>

#include "shardstep/shardstep.h"

using namespace shardstep;

// `n` points: label k is a blob of stddev 0.5 around (3 cos(2πk/3), 3 sin(2πk/3)).
TensorMap Blobs(int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> noise(0.0f, 0.5f);
  std::vector<float> x;
  std::vector<int32_t> y;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t k = static_cast<int32_t>(rng() % 3);
    x.push_back(3.0f * std::cos(2.0944f * k) + noise(rng));
    x.push_back(3.0f * std::sin(2.0944f * k) + noise(rng));
    y.push_back(k);
  }
  return {{"image", Tensor::F32({n, 2}, x)}, {"label", Tensor::S32({n}, y)}};
}

int main() {
  const int64_t batch = 64;
  dsl::Model m("mlp_blobs", /*seed=*/1);
  auto x = m.input("image", dsl::f32({batch, 2}));
  auto y = m.input("label", dsl::s32({batch}));
  auto logits = x.dense(32, "fc1").relu().dense(3, "fc2");
  m.output("logits", logits);
  auto program = m.train(logits.cross_entropy_mean(y))
                     .optimizer(dsl::Adam().lr(0.02))
                     .replicas(2)
                     .shard_weight_update(true)
                     .build();

  Session session(m, program, "cpu");
  float loss = 0;
  for (int step = 0; step < 100; ++step) {
    TensorMap out = session.Step(Blobs(batch, step));
    loss = out.at("loss").f32[0];
    if (step % 20 == 0) std::printf("step %d loss %.4f\n", step, loss);
  }

  // Predict needs no labels and takes any number of points; count the correct classes on fresh ones.
  const int64_t n = 200;
  TensorMap test = Blobs(n, 1000);
  Tensor scores = session.Predict({{"image", test.at("image")}}).at("logits");
  int correct = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float* row = scores.f32.data() + i * 3;
    correct += (std::max_element(row, row + 3) - row) == test.at("label").s32[i];
  }
  std::printf("final loss %.4f, test accuracy %d/%lld\n", loss, correct, static_cast<long long>(n));
  session.Save("mlp_blobs.safetensors");  // Session::Load restores it, at any replica count
  return loss < 0.1 && correct >= n * 9 / 10 ? 0 : 1;
}
