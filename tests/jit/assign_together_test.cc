// Assignments take effect together in every backend: each assignment sees the variables' values from
// before the step. Swaps, rotations and "@a = @b + 1; @b = @a" run for two steps on the reference
// interpreter and on the CPU JIT (CompiledStep) against hand-computed values; the JIT's copy order
// (jit/buffer_plan.h SequenceAssignments) is checked on its own.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "ir/parser.h"
#include "ir/verifier.h"
#include "jit/buffer_plan.h"
#include "jit/compiled_step.h"
#include "runtime/interpreter.h"

namespace shardstep {
namespace {

using runtime::Tensor;
using runtime::TensorMap;

ir::Module ParseVerified(const std::string& text) {
  ir::Module m = ir::Parse(text);
  ir::Verify(m);
  return m;
}

// A backend: runs one step of `m` on `variables` and returns the outputs.
struct Backend {
  const char* name;
  bool jit;
};
constexpr Backend kBackends[] = {{"interpreter", false}, {"jit", true}};

// The variables after each of `steps` steps on `backend`.
std::vector<TensorMap> Steps(const Backend& backend, const ir::Module& m, TensorMap variables, int steps) {
  std::vector<TensorMap> after;
  std::shared_ptr<const jit::CompiledStep> compiled;
  jit::Workspace ws;
  if (backend.jit) {
    jit::JitOptions o;
    o.disk_cache = false;
    compiled = jit::CompiledStep::Compile(m, o);
  }
  for (int s = 0; s < steps; ++s) {
    if (backend.jit) compiled->Run(variables, {}, 0, nullptr, &ws);
    else runtime::RunStep(m, variables, {});
    after.push_back(variables);
  }
  return after;
}

Tensor F32(std::vector<float> v) {
  const int64_t n = static_cast<int64_t>(v.size());
  return Tensor::F32({n}, std::move(v));
}

void CheckSteps(const std::string& text, const TensorMap& initial, const std::vector<TensorMap>& expected) {
  const ir::Module m = ParseVerified(text);
  for (const Backend& b : kBackends) {
    INFO(b.name << "\n" << text);
    const std::vector<TensorMap> got = Steps(b, m, initial, static_cast<int>(expected.size()));
    for (size_t s = 0; s < expected.size(); ++s)
      for (const auto& [name, want] : expected[s]) {
        INFO("after step " << s + 1 << ", @" << name);
        REQUIRE(got[s].count(name));
        CHECK(got[s].at(name).f32 == want.f32);
      }
  }
}

TEST_CASE("a swap of two variables", "[jit][assign]") {
  const char* text = R"(module @swap {
  %0 = variable @a {role="weight"} : f32[3]
  %1 = variable @b {role="weight"} : f32[3]
  assign @a = %1
  assign @b = %0
})";
  const TensorMap init{{"a", F32({1, 2, 3})}, {"b", F32({10, 20, 30})}};
  CheckSteps(text, init,
             {{{"a", F32({10, 20, 30})}, {"b", F32({1, 2, 3})}}, {{"a", F32({1, 2, 3})}, {"b", F32({10, 20, 30})}}});
}

TEST_CASE("a swap through reshapes (the reads alias the variables)", "[jit][assign]") {
  const char* text = R"(module @swap2d {
  %0 = variable @a {role="weight"} : f32[2,2]
  %1 = variable @b {role="weight"} : f32[4]
  %2 = reshape(%1) {shape=[2,2]} : f32[2,2]
  %3 = reshape(%0) {shape=[4]} : f32[4]
  assign @b = %3
  assign @a = %2
})";
  const TensorMap init{{"a", Tensor::F32({2, 2}, {1, 2, 3, 4})}, {"b", F32({5, 6, 7, 8})}};
  CheckSteps(text, init,
             {{{"a", Tensor::F32({2, 2}, {5, 6, 7, 8})}, {"b", F32({1, 2, 3, 4})}},
              {{"a", Tensor::F32({2, 2}, {1, 2, 3, 4})}, {"b", F32({5, 6, 7, 8})}}});
}

TEST_CASE("a rotation of three variables", "[jit][assign]") {
  const char* text = R"(module @rotate {
  %0 = variable @a {role="weight"} : f32[2]
  %1 = variable @b {role="weight"} : f32[2]
  %2 = variable @c {role="weight"} : f32[2]
  assign @a = %1
  assign @b = %2
  assign @c = %0
})";
  const TensorMap init{{"a", F32({1, 1})}, {"b", F32({2, 2})}, {"c", F32({3, 3})}};
  CheckSteps(text, init,
             {{{"a", F32({2, 2})}, {"b", F32({3, 3})}, {"c", F32({1, 1})}},
              {{"a", F32({3, 3})}, {"b", F32({1, 1})}, {"c", F32({2, 2})}}});
}

TEST_CASE("@a = @b + 1 and @b = @a: the second reads @a from before the step", "[jit][assign]") {
  // Expected: (a, b) = ([1,2], [5,6]) -> ([6,7], [1,2]) -> ([2,3], [6,7]).
  const std::vector<TensorMap> expected = {{{"a", F32({6, 7})}, {"b", F32({1, 2})}},
                                           {{"a", F32({2, 3})}, {"b", F32({6, 7})}}};
  const TensorMap init{{"a", F32({1, 2})}, {"b", F32({5, 6})}};
  const std::string head = R"(module @plus_one {
  %0 = variable @a {role="weight"} : f32[2]
  %1 = variable @b {role="weight"} : f32[2]
  %2 = constant {value=1.0} : f32[2]
  %3 = add(%1, %2) : f32[2]
)";
  SECTION("the sum swapped into @a") { CheckSteps(head + "  assign @a = %3\n  assign @b = %0\n}", init, expected); }
  SECTION("the sum also an output, so copied into @a") {
    CheckSteps(head + "  assign @a = %3\n  assign @b = %0\n  output @sum = %3\n}", init, expected);
  }
  SECTION("assignments listed the other way round") {
    CheckSteps(head + "  assign @b = %0\n  assign @a = %3\n  output @sum = %3\n}", init, expected);
  }
}

TEST_CASE("a variable read after another one was overwritten: a chain, not a cycle", "[jit][assign]") {
  // @a = @b + 1, @b = @c, @c = @a * 2: every right-hand side uses the values from before the step.
  const char* text = R"(module @chain {
  %0 = variable @a {role="weight"} : f32[2]
  %1 = variable @b {role="weight"} : f32[2]
  %2 = variable @c {role="weight"} : f32[2]
  %3 = constant {value=1.0} : f32[2]
  %4 = add(%1, %3) : f32[2]
  %5 = constant {value=2.0} : f32[2]
  %6 = mul(%0, %5) : f32[2]
  assign @a = %4
  assign @b = %2
  assign @c = %6
  output @a_new = %4
})";
  const TensorMap init{{"a", F32({1, 2})}, {"b", F32({3, 4})}, {"c", F32({5, 6})}};
  // (a, b, c): ([1,2], [3,4], [5,6]) -> ([4,5], [5,6], [2,4]) -> ([6,7], [2,4], [8,10]).
  CheckSteps(text, init,
             {{{"a", F32({4, 5})}, {"b", F32({5, 6})}, {"c", F32({2, 4})}},
              {{"a", F32({6, 7})}, {"b", F32({2, 4})}, {"c", F32({8, 10})}}});
}

TEST_CASE("SequenceAssignments: reads before writes, temporaries only for cycles", "[jit][assign]") {
  using jit::AssignMove;
  auto position = [](const jit::AssignOrder& o, int move) {
    for (size_t i = 0; i < o.order.size(); ++i)
      if (o.order[i] == move) return static_cast<int>(i);
    return -1;
  };
  auto staged = [](const jit::AssignOrder& o) {
    int n = 0;
    for (char s : o.staged) n += s;
    return n;
  };
  SECTION("independent moves keep their order and stage nothing") {
    const jit::AssignOrder o = jit::SequenceAssignments({{0, -1}, {1, -1}, {2, 2}});
    CHECK(o.order == std::vector<int>{0, 1, 2});
    CHECK(staged(o) == 0);
  }
  SECTION("a chain: @b = @c is performed before @c is written, no temporary") {
    const jit::AssignOrder o = jit::SequenceAssignments({{2, -1}, {1, 2}});  // @c = tmp, @b = @c
    CHECK(position(o, 1) < position(o, 0));
    CHECK(staged(o) == 0);
  }
  SECTION("a swap stages one source") {
    const jit::AssignOrder o = jit::SequenceAssignments({{0, 1}, {1, 0}});
    CHECK(o.order.size() == 2);
    CHECK(staged(o) == 1);
  }
  SECTION("a rotation of three stages one source, and a tail hanging off it none") {
    const jit::AssignOrder o = jit::SequenceAssignments({{0, 1}, {1, 2}, {2, 0}, {3, 0}});
    CHECK(o.order.size() == 4);
    CHECK(staged(o) == 1);
    CHECK(position(o, 3) < position(o, 0));  // @d = @a reads @a before @a is written
  }
}

}  // namespace
}  // namespace shardstep
