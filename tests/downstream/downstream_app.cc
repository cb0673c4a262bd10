// The downstream project's program: a model written with the DSL (a small residual MLP), trained
// through the public API on 2 replicas with the sharded weight update, exactly as an outside user
// would from the installed package. Exits 0 only when the loss fell by at least half.
#include <cmath>
#include <cstdio>
#include <random>

#include "shardstep/shardstep.h"

using namespace shardstep;

// Two interleaved spirals in the plane, labels 0 and 1 (not linearly separable).
TensorMap Spirals(int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::normal_distribution<float> noise(0.0f, 0.05f);
  std::vector<float> x;
  std::vector<int32_t> y;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t k = static_cast<int32_t>(rng() % 2);
    const float t = 0.25f + 2.5f * u(rng);
    const float angle = t * 3.0f + k * 3.14159f;
    x.push_back(t * std::cos(angle) + noise(rng));
    x.push_back(t * std::sin(angle) + noise(rng));
    y.push_back(k);
  }
  return {{"point", Tensor::F32({n, 2}, x)}, {"label", Tensor::S32({n}, y)}};
}

int main() {
  const int64_t batch = 64;
  dsl::Model m("downstream_spirals", /*seed=*/3);
  auto x = m.input("point", dsl::f32({batch, 2}));
  auto y = m.input("label", dsl::s32({batch}));
  auto h = x.dense(64, "in").tanh();
  h = h + h.dense(64, "block").relu();  // one residual block
  auto logits = h.dense(2, "out");
  m.output("logits", logits);
  auto program = m.train(logits.cross_entropy_mean(y))
                     .optimizer(dsl::Adam().lr(0.01))
                     .replicas(2)
                     .shard_weight_update(true)
                     .build();
  Session session(m, program, "cpu");

  const int steps = 150;
  double first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    const float loss = session.Step(Spirals(batch, step)).at("loss").f32[0];
    if (!std::isfinite(loss)) {
      std::printf("step %d: loss %f\n", step, loss);
      return 1;
    }
    if (step < 10) first += loss / 10;
    if (step >= steps - 10) last += loss / 10;
  }
  std::printf("downstream: mean loss of the first 10 steps %.4f, of the last 10 %.4f (%d steps, %d replicas)\n",
              first, last, steps, session.num_replicas());
  return last < 0.5 * first ? 0 : 1;
}
