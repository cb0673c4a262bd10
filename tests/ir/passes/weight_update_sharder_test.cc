// WeightUpdateSharder tests: IR text in, IR text out (CHECK lines on the printed module), and the
// numbers: the module before and after the pass train side by side on N replica threads
// (InProcessCollectives), bitwise equal for elementwise updates, within 1e-6 where norms are involved.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "dsl/dsl.h"
#include "ir/error.h"
#include "ir/passes/autodiff.h"
#include "ir/passes/data_parallel_lowering.h"
#include "ir/passes/optimizer_lowering.h"
#include "ir/passes/pipeline.h"
#include "runtime/executor.h"
#include "ir/parser.h"
#include "ir/passes/collective_combiner.h"
#include "ir/passes/nonfinite_guard.h"
#include "ir/passes/weight_update_sharder.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "tests/ir/passes/pass_test_util.h"

namespace shardstep::ir {
namespace {

using namespace ::shardstep::ir::testing;

TEST_CASE("the CHECK-line helper finds, binds and rejects", "[weight-update-sharder][filecheck]") {
  const std::string text = "%1 = a(%0) : f32[2]\n%2 = b(%1) {x=[[0,1]]} : f32[2]\n%3 = c(%2) : f32[]\n";
  CHECK(FileCheck(text, "CHECK: [[A:%\\d+]] = a(%0)\nCHECK-NEXT: b([[A]]) {x=[[0,1]]}\nCHECK: c(") == "");
  CHECK(FileCheck(text, "CHECK: c(\nCHECK: a(") != "");                    // order matters
  CHECK(FileCheck(text, "CHECK: a(\nCHECK-NEXT: c(") != "");                // NEXT is the next line
  CHECK(FileCheck(text, "CHECK: [[A:%\\d+]] = a(\nCHECK: c([[A]])") != "");  // %1 is not c's operand
  CHECK(FileCheck(text, "CHECK: a(\nCHECK-NOT: b(\nCHECK: c(") != "");
  CHECK(FileCheck(text, "CHECK: a(\nCHECK-NOT: z(\nCHECK: c(") == "");
  CHECK(FileCheck(text, "CHECK-NOT: {{[bc]}}(%{{\\d}}) : f32[]") != "");  // checked to the end
  CHECK(FileCheck(text, "CHECK-NOT: a(%{{\\d}}) : f32[]") == "");           // outside {{}} text is literal
  CHECK(Count(text, " : f32[") == 3);
}

// ---- Running the pass ----

struct Sharded {
  Module before, after;
  std::string text;  // Print(after)
  bool changed = false;
  ShardingReport report;
};

Sharded RunSharder(const std::string& text, ShardingOptions o = {}) {
  Sharded s;
  s.before = ParseVerified(text);
  s.after = s.before;
  WeightUpdateSharder pass(o);
  s.changed = pass.Run(s.after);
  Verify(s.after);
  s.text = Print(s.after);
  s.report = pass.report();
  CHECK(Parse(s.text) == s.after);  // the result round-trips through the text form
  return s;
}

// ---- Modules ----

// Adam (PyTorch order, as OptimizerLowering emits it) on one weight; the step counter drives the bias
// corrections. The per-replica gradient is x * w.
const char* kAdam = R"IR(
module @adam replicas=2 {
  %0 = input @x : f32[4,3]
  %1 = variable @w {role="weight"} : f32[4,3]
  %2 = mul(%0, %1) : f32[4,3]
  %3 = all_reduce(%2) {reduction="mean"} : f32[4,3]
  %4 = variable @step {role="step"} : s32[]
  %5 = convert(%4) {dtype="f32"} : f32[]
  %6 = constant {value=1.0} : f32[]
  %7 = add(%5, %6) : f32[]
  %8 = constant {value=0.9} : f32[]
  %9 = pow(%8, %7) : f32[]
  %10 = sub(%6, %9) : f32[]
  %11 = constant {value=0.999} : f32[]
  %12 = pow(%11, %7) : f32[]
  %13 = sub(%6, %12) : f32[]
  %14 = constant {value=0.01} : f32[]
  %15 = div(%14, %10) : f32[]
  %16 = sqrt(%13) : f32[]
  %17 = variable @w/m {role="optimizer_state"} : f32[4,3]
  %18 = variable @w/v {role="optimizer_state"} : f32[4,3]
  %19 = constant {value=0.9} : f32[4,3]
  %20 = mul(%19, %17) : f32[4,3]
  %21 = constant {value=0.1} : f32[4,3]
  %22 = mul(%21, %3) : f32[4,3]
  %23 = add(%20, %22) : f32[4,3]
  %24 = constant {value=0.999} : f32[4,3]
  %25 = mul(%24, %18) : f32[4,3]
  %26 = mul(%3, %3) : f32[4,3]
  %27 = constant {value=0.001} : f32[4,3]
  %28 = mul(%27, %26) : f32[4,3]
  %29 = add(%25, %28) : f32[4,3]
  %30 = sqrt(%29) : f32[4,3]
  %31 = broadcast(%16) {dims=[], shape=[4,3]} : f32[4,3]
  %32 = div(%30, %31) : f32[4,3]
  %33 = constant {value=1e-08} : f32[4,3]
  %34 = add(%32, %33) : f32[4,3]
  %35 = div(%23, %34) : f32[4,3]
  %36 = broadcast(%15) {dims=[], shape=[4,3]} : f32[4,3]
  %37 = mul(%36, %35) : f32[4,3]
  %38 = sub(%1, %37) : f32[4,3]
  %39 = constant {value=1} : s32[]
  %40 = add(%4, %39) : s32[]
  gradient @w = %3
  assign @w/m = %23
  assign @w/v = %29
  assign @w = %38
  assign @step = %40
}
)IR";

// Nesterov momentum with weight decay at 4 replicas: w [8,2] and b [4] both shard along dim 0.
const char* kMomentum = R"IR(
module @momentum replicas=4 {
  %0 = input @x : f32[8,2]
  %1 = input @y : f32[4]
  %2 = variable @w {role="weight"} : f32[8,2]
  %3 = variable @b {role="weight"} : f32[4]
  %4 = mul(%0, %2) : f32[8,2]
  %5 = all_reduce(%4) {reduction="mean"} : f32[8,2]
  %6 = mul(%1, %3) : f32[4]
  %7 = all_reduce(%6) {reduction="mean"} : f32[4]
  %8 = constant {value=0.05} : f32[]
  %9 = variable @w/momentum {role="optimizer_state"} : f32[8,2]
  %10 = constant {value=0.001} : f32[8,2]
  %11 = mul(%10, %2) : f32[8,2]
  %12 = add(%5, %11) : f32[8,2]
  %13 = constant {value=0.9} : f32[8,2]
  %14 = mul(%13, %9) : f32[8,2]
  %15 = add(%14, %12) : f32[8,2]
  %16 = mul(%13, %15) : f32[8,2]
  %17 = add(%12, %16) : f32[8,2]
  %18 = broadcast(%8) {dims=[], shape=[8,2]} : f32[8,2]
  %19 = mul(%18, %17) : f32[8,2]
  %20 = sub(%2, %19) : f32[8,2]
  %21 = variable @b/momentum {role="optimizer_state"} : f32[4]
  %22 = constant {value=0.9} : f32[4]
  %23 = mul(%22, %21) : f32[4]
  %24 = add(%23, %7) : f32[4]
  %25 = broadcast(%8) {dims=[], shape=[4]} : f32[4]
  %26 = mul(%25, %24) : f32[4]
  %27 = sub(%3, %26) : f32[4]
  assign @w/momentum = %15
  assign @w = %20
  assign @b/momentum = %24
  assign @b = %27
}
)IR";

// LAMB (You et al.) on w1 [4,2] (dim0) and w2 [3] (flat, one padding element at N=2): the trust ratio
// needs ||w|| and ||r|| of each tensor separately.
const char* kLamb = R"IR(
module @lamb replicas=2 {
  %0 = input @x1 : f32[4,2]
  %1 = input @x2 : f32[3]
  %2 = variable @w1 {role="weight"} : f32[4,2]
  %3 = variable @w2 {role="weight"} : f32[3]
  %4 = mul(%0, %2) : f32[4,2]
  %5 = all_reduce(%4) {reduction="mean"} : f32[4,2]
  %6 = mul(%1, %3) : f32[3]
  %7 = all_reduce(%6) {reduction="mean"} : f32[3]
  %8 = constant {value=0.01} : f32[]
  %9 = constant {value=0.1} : f32[]
  %10 = constant {value=0.001} : f32[]
  %11 = constant {value=0.0} : f32[]
  %12 = constant {value=1.0} : f32[]
  %13 = variable @w1/m {role="optimizer_state"} : f32[4,2]
  %14 = variable @w1/v {role="optimizer_state"} : f32[4,2]
  %15 = constant {value=0.9} : f32[4,2]
  %16 = mul(%15, %13) : f32[4,2]
  %17 = constant {value=0.1} : f32[4,2]
  %18 = mul(%17, %5) : f32[4,2]
  %19 = add(%16, %18) : f32[4,2]
  %20 = constant {value=0.999} : f32[4,2]
  %21 = mul(%20, %14) : f32[4,2]
  %22 = mul(%5, %5) : f32[4,2]
  %23 = constant {value=0.001} : f32[4,2]
  %24 = mul(%23, %22) : f32[4,2]
  %25 = add(%21, %24) : f32[4,2]
  %26 = broadcast(%9) {dims=[], shape=[4,2]} : f32[4,2]
  %27 = div(%19, %26) : f32[4,2]
  %28 = broadcast(%10) {dims=[], shape=[4,2]} : f32[4,2]
  %29 = div(%25, %28) : f32[4,2]
  %30 = sqrt(%29) : f32[4,2]
  %31 = constant {value=1e-06} : f32[4,2]
  %32 = add(%30, %31) : f32[4,2]
  %33 = div(%27, %32) : f32[4,2]
  %34 = constant {value=0.01} : f32[4,2]
  %35 = mul(%34, %2) : f32[4,2]
  %36 = add(%33, %35) : f32[4,2]
  %37 = mul(%2, %2) : f32[4,2]
  %38 = reduce_sum(%37) {axes=[0,1]} : f32[]
  %39 = sqrt(%38) : f32[]
  %40 = mul(%36, %36) : f32[4,2]
  %41 = reduce_sum(%40) {axes=[0,1]} : f32[]
  %42 = sqrt(%41) : f32[]
  %43 = gt(%39, %11) : f32[]
  %44 = gt(%42, %11) : f32[]
  %45 = mul(%43, %44) : f32[]
  %46 = div(%39, %42) : f32[]
  %47 = select(%45, %46, %12) : f32[]
  %48 = mul(%8, %47) : f32[]
  %49 = broadcast(%48) {dims=[], shape=[4,2]} : f32[4,2]
  %50 = mul(%49, %36) : f32[4,2]
  %51 = sub(%2, %50) : f32[4,2]
  %52 = variable @w2/m {role="optimizer_state"} : f32[3]
  %53 = variable @w2/v {role="optimizer_state"} : f32[3]
  %54 = constant {value=0.9} : f32[3]
  %55 = mul(%54, %52) : f32[3]
  %56 = constant {value=0.1} : f32[3]
  %57 = mul(%56, %7) : f32[3]
  %58 = add(%55, %57) : f32[3]
  %59 = constant {value=0.999} : f32[3]
  %60 = mul(%59, %53) : f32[3]
  %61 = mul(%7, %7) : f32[3]
  %62 = constant {value=0.001} : f32[3]
  %63 = mul(%62, %61) : f32[3]
  %64 = add(%60, %63) : f32[3]
  %65 = broadcast(%9) {dims=[], shape=[3]} : f32[3]
  %66 = div(%58, %65) : f32[3]
  %67 = broadcast(%10) {dims=[], shape=[3]} : f32[3]
  %68 = div(%64, %67) : f32[3]
  %69 = sqrt(%68) : f32[3]
  %70 = constant {value=1e-06} : f32[3]
  %71 = add(%69, %70) : f32[3]
  %72 = div(%66, %71) : f32[3]
  %73 = constant {value=0.01} : f32[3]
  %74 = mul(%73, %3) : f32[3]
  %75 = add(%72, %74) : f32[3]
  %76 = mul(%3, %3) : f32[3]
  %77 = reduce_sum(%76) {axes=[0]} : f32[]
  %78 = sqrt(%77) : f32[]
  %79 = mul(%75, %75) : f32[3]
  %80 = reduce_sum(%79) {axes=[0]} : f32[]
  %81 = sqrt(%80) : f32[]
  %82 = gt(%78, %11) : f32[]
  %83 = gt(%81, %11) : f32[]
  %84 = mul(%82, %83) : f32[]
  %85 = div(%78, %81) : f32[]
  %86 = select(%84, %85, %12) : f32[]
  %87 = mul(%8, %86) : f32[]
  %88 = broadcast(%87) {dims=[], shape=[3]} : f32[3]
  %89 = mul(%88, %75) : f32[3]
  %90 = sub(%3, %89) : f32[3]
  assign @w1/m = %19
  assign @w1/v = %25
  assign @w1 = %51
  assign @w2/m = %58
  assign @w2/v = %64
  assign @w2 = %90
}
)IR";

// SGD with global-norm clipping (torch.nn.utils.clip_grad_norm_) over three tensors of different shapes.
const char* kClip = R"IR(
module @clip replicas=2 {
  %0 = input @x : f32[4,2]
  %1 = variable @w1 {role="weight"} : f32[4,2]
  %2 = variable @w2 {role="weight"} : f32[6]
  %3 = variable @w3 {role="weight"} : f32[2,3]
  %4 = mul(%0, %1) : f32[4,2]
  %5 = all_reduce(%4) {reduction="mean"} : f32[4,2]
  %6 = reshape(%0) {shape=[8]} : f32[8]
  %7 = slice(%6) {limit=[6], start=[0]} : f32[6]
  %8 = mul(%7, %2) : f32[6]
  %9 = all_reduce(%8) {reduction="mean"} : f32[6]
  %10 = reshape(%7) {shape=[2,3]} : f32[2,3]
  %11 = mul(%10, %3) : f32[2,3]
  %12 = all_reduce(%11) {reduction="mean"} : f32[2,3]
  %13 = mul(%5, %5) : f32[4,2]
  %14 = reduce_sum(%13) {axes=[0,1]} : f32[]
  %15 = mul(%9, %9) : f32[6]
  %16 = reduce_sum(%15) {axes=[0]} : f32[]
  %17 = add(%14, %16) : f32[]
  %18 = mul(%12, %12) : f32[2,3]
  %19 = reduce_sum(%18) {axes=[0,1]} : f32[]
  %20 = add(%17, %19) : f32[]
  %21 = sqrt(%20) : f32[]
  %22 = constant {value=0.05} : f32[]
  %23 = constant {value=1e-06} : f32[]
  %24 = add(%21, %23) : f32[]
  %25 = div(%22, %24) : f32[]
  %26 = constant {value=1.0} : f32[]
  %27 = min(%25, %26) : f32[]
  %28 = constant {value=0.1} : f32[]
  %29 = broadcast(%27) {dims=[], shape=[4,2]} : f32[4,2]
  %30 = mul(%5, %29) : f32[4,2]
  %31 = broadcast(%28) {dims=[], shape=[4,2]} : f32[4,2]
  %32 = mul(%31, %30) : f32[4,2]
  %33 = sub(%1, %32) : f32[4,2]
  %34 = broadcast(%27) {dims=[], shape=[6]} : f32[6]
  %35 = mul(%9, %34) : f32[6]
  %36 = broadcast(%28) {dims=[], shape=[6]} : f32[6]
  %37 = mul(%36, %35) : f32[6]
  %38 = sub(%2, %37) : f32[6]
  %39 = broadcast(%27) {dims=[], shape=[2,3]} : f32[2,3]
  %40 = mul(%12, %39) : f32[2,3]
  %41 = broadcast(%28) {dims=[], shape=[2,3]} : f32[2,3]
  %42 = mul(%41, %40) : f32[2,3]
  %43 = sub(%3, %42) : f32[2,3]
  assign @w1 = %33
  assign @w2 = %38
  assign @w3 = %43
}
)IR";

// w [5,3]: 15 elements at N=2, so flat with one padding element. The update reads a sum, a max and a
// mean of d = m' - 0.5 (d is -0.5 on the padding, so an unmasked reduction would see it).
const char* kPadded = R"IR(
module @padded replicas=2 {
  %0 = input @x : f32[5,3]
  %1 = variable @w {role="weight"} : f32[5,3]
  %2 = mul(%0, %1) : f32[5,3]
  %3 = all_reduce(%2) {reduction="mean"} : f32[5,3]
  %4 = variable @w/momentum {role="optimizer_state"} : f32[5,3]
  %5 = constant {value=0.9} : f32[5,3]
  %6 = mul(%5, %4) : f32[5,3]
  %7 = add(%6, %3) : f32[5,3]
  %8 = constant {value=0.5} : f32[5,3]
  %9 = sub(%7, %8) : f32[5,3]
  %10 = mul(%9, %9) : f32[5,3]
  %11 = reduce_sum(%10) {axes=[0,1]} : f32[]
  %12 = neg(%10) : f32[5,3]
  %13 = reduce_max(%12) {axes=[0,1]} : f32[]
  %14 = reduce_mean(%9) {axes=[0,1]} : f32[]
  %15 = sqrt(%11) : f32[]
  %16 = add(%15, %13) : f32[]
  %17 = add(%16, %14) : f32[]
  %18 = constant {value=0.01} : f32[]
  %19 = mul(%18, %17) : f32[]
  %20 = broadcast(%19) {dims=[], shape=[5,3]} : f32[5,3]
  %21 = mul(%20, %7) : f32[5,3]
  %22 = sub(%1, %21) : f32[5,3]
  assign @w/momentum = %7
  assign @w = %22
}
)IR";

// The update symmetrises the gradient (transpose) and adds g·w (matmul): neither partitions.
const char* kFallback = R"IR(
module @fallback replicas=3 {
  %0 = input @x : f32[3,3]
  %1 = variable @w {role="weight"} : f32[3,3]
  %2 = mul(%0, %1) : f32[3,3]
  %3 = all_reduce(%2) {reduction="mean"} : f32[3,3]
  %4 = transpose(%3) {perm=[1,0]} : f32[3,3]
  %5 = add(%3, %4) : f32[3,3]
  %6 = matmul(%3, %1) {transpose_a=0, transpose_b=0} : f32[3,3]
  %7 = add(%5, %6) : f32[3,3]
  %8 = constant {value=0.1} : f32[3,3]
  %9 = mul(%8, %7) : f32[3,3]
  %10 = sub(%1, %9) : f32[3,3]
  assign @w = %10
}
)IR";

// 8 replicas in two data-parallel groups of 4: clipped momentum on w [8,2] (dim0) and a normed update
// of b [6] (flat at G=4: two padding elements).
const char* kGroups = R"IR(
module @groups replicas=8 {
  %0 = input @x : f32[8,2]
  %1 = input @y : f32[6]
  %2 = variable @w {role="weight"} : f32[8,2]
  %3 = variable @b {role="weight"} : f32[6]
  %4 = mul(%0, %2) : f32[8,2]
  %5 = all_reduce(%4) {groups=[[0,1,2,3],[4,5,6,7]], reduction="mean"} : f32[8,2]
  %6 = mul(%1, %3) : f32[6]
  %7 = all_reduce(%6) {groups=[[0,1,2,3],[4,5,6,7]], reduction="mean"} : f32[6]
  %8 = mul(%5, %5) : f32[8,2]
  %9 = reduce_sum(%8) {axes=[0,1]} : f32[]
  %10 = mul(%7, %7) : f32[6]
  %11 = reduce_sum(%10) {axes=[0]} : f32[]
  %12 = add(%9, %11) : f32[]
  %13 = sqrt(%12) : f32[]
  %14 = constant {value=0.05} : f32[]
  %15 = constant {value=1e-06} : f32[]
  %16 = add(%13, %15) : f32[]
  %17 = div(%14, %16) : f32[]
  %18 = constant {value=1.0} : f32[]
  %19 = min(%17, %18) : f32[]
  %20 = constant {value=0.1} : f32[]
  %21 = mul(%20, %19) : f32[]
  %22 = variable @w/momentum {role="optimizer_state"} : f32[8,2]
  %23 = constant {value=0.9} : f32[8,2]
  %24 = mul(%23, %22) : f32[8,2]
  %25 = broadcast(%19) {dims=[], shape=[8,2]} : f32[8,2]
  %26 = mul(%5, %25) : f32[8,2]
  %27 = add(%24, %26) : f32[8,2]
  %28 = broadcast(%20) {dims=[], shape=[8,2]} : f32[8,2]
  %29 = mul(%28, %27) : f32[8,2]
  %30 = sub(%2, %29) : f32[8,2]
  %31 = variable @b/momentum {role="optimizer_state"} : f32[6]
  %32 = constant {value=0.9} : f32[6]
  %33 = mul(%32, %31) : f32[6]
  %34 = add(%33, %7) : f32[6]
  %35 = constant {value=0.5} : f32[6]
  %36 = sub(%34, %35) : f32[6]
  %37 = mul(%36, %36) : f32[6]
  %38 = reduce_sum(%37) {axes=[0]} : f32[]
  %39 = sqrt(%38) : f32[]
  %40 = mul(%21, %39) : f32[]
  %41 = broadcast(%40) {dims=[], shape=[6]} : f32[6]
  %42 = mul(%41, %34) : f32[6]
  %43 = sub(%3, %42) : f32[6]
  assign @w/momentum = %27
  assign @w = %30
  assign @b/momentum = %34
  assign @b = %43
}
)IR";

// A forward that reads the weights (h = x w, and b as an output), momentum on w, SGD on b [3].
const char* kForward = R"IR(
module @forward replicas=2 {
  %0 = input @x : f32[2,4]
  %1 = variable @w {role="weight"} : f32[4,3]
  %2 = matmul(%0, %1) {transpose_a=0, transpose_b=0} : f32[2,3]
  %3 = matmul(%0, %2) {transpose_a=1, transpose_b=0} : f32[4,3]
  %4 = all_reduce(%3) {reduction="mean"} : f32[4,3]
  %5 = variable @b {role="weight"} : f32[3]
  %6 = reduce_sum(%2) {axes=[0]} : f32[3]
  %7 = all_reduce(%6) {reduction="mean"} : f32[3]
  %8 = variable @w/momentum {role="optimizer_state"} : f32[4,3]
  %9 = constant {value=0.9} : f32[4,3]
  %10 = mul(%9, %8) : f32[4,3]
  %11 = add(%10, %4) : f32[4,3]
  %12 = constant {value=0.1} : f32[4,3]
  %13 = mul(%12, %11) : f32[4,3]
  %14 = sub(%1, %13) : f32[4,3]
  %15 = constant {value=0.1} : f32[3]
  %16 = mul(%15, %7) : f32[3]
  %17 = sub(%5, %16) : f32[3]
  assign @w/momentum = %11
  assign @w = %14
  assign @b = %17
  output @h = %2
  output @b = %5
}
)IR";

// ---- Cases ----

TEST_CASE("Adam: the all-reduce becomes a reduce-scatter, m and v live as shards, the weight is all-gathered",
          "[weight-update-sharder][adam]") {
  Sharded s = RunSharder(kAdam);
  INFO(s.text);
  CHECK(s.changed);
  // The state variables take the shard shape and record their format.
  CHECK(FileCheck(s.text, R"C(
    CHECK: variable @w/m {logical_shape=[4,3], role="optimizer_state", shard_count=2, shard_format="dim0"} : f32[2,3]
    CHECK: variable @w/v {logical_shape=[4,3], role="optimizer_state", shard_count=2, shard_format="dim0"} : f32[2,3]
  )C") == "");
  // The per-replica gradient is reduce-scattered (dim 0 divides: no re-layout), the update runs on
  // [2,3] shards, the weight's local slice is taken by replica id, and the new shard is all-gathered
  // into the weight's assignment.
  CHECK(FileCheck(s.text, R"C(
    CHECK: [[W:%\d+]] = variable @w {role="weight"} : f32[4,3]
    CHECK: [[G:%\d+]] = mul(%0, [[W]]) : f32[4,3]
    CHECK: [[RS:%\d+]] = reduce_scatter([[G]]) {{[{](combined=\d+, )?}}group_size=2, reduction="mean"} : f32[2,3]
    CHECK: mul({{%\d+}}, [[RS]]) : f32[2,3]
    CHECK: mul([[RS]], [[RS]]) : f32[2,3]
    CHECK: [[ROWS:%\d+]] = reshape([[W]]) {shape=[2,6]} : f32[2,6]
    CHECK-NEXT: [[R:%\d+]] = replica_id : s32[]
    CHECK-NEXT: [[MINE:%\d+]] = gather([[ROWS]], [[R]]) : f32[6]
    CHECK-NEXT: [[WS:%\d+]] = reshape([[MINE]]) {shape=[2,3]} : f32[2,3]
    CHECK-NEXT: [[NEW:%\d+]] = sub([[WS]], {{%\d+}}) : f32[2,3]
    CHECK: [[AG:%\d+]] = all_gather([[NEW]]) {{[{](combined=\d+, )?}}group_size=2} : f32[4,3]
    CHECK: assign @w = [[AG]]
  )C") == "");
  CHECK(Count(s.text, "all_reduce") == 0);
  CHECK(Count(s.text, "reduce_scatter(") == 1);
  CHECK(Count(s.text, "all_gather(") == 1);
  // No full-size f32[4,3] arithmetic is left in the update: only the input, the weight, the local
  // gradient and the all-gather.
  CHECK(Count(s.text, ": f32[4,3]") == 4);
  CHECK(CountOps(s.after, OpCode::kAllReduce) == 0);
  CHECK(s.after.gradients.empty());  // the all-reduced gradients the optimizer consumed are gone
  EXPECT_SAME_TRAINING(s.before, s.after, /*tol=*/0);
}

TEST_CASE("momentum (Nesterov, weight decay) at 4 replicas: bitwise equal to the replicated update",
          "[weight-update-sharder][momentum]") {
  Sharded s = RunSharder(kMomentum);
  INFO(s.text);
  CHECK(FileCheck(s.text, R"C(
    CHECK: [[W:%\d+]] = variable @w {role="weight"} : f32[8,2]
    CHECK: variable @w/momentum {logical_shape=[8,2], role="optimizer_state", shard_count=4, shard_format="dim0"} : f32[2,2]
    CHECK: variable @b/momentum {logical_shape=[4], role="optimizer_state", shard_count=4, shard_format="dim0"} : f32[1]
    CHECK: reduce_scatter({{%\d+}}) {{[{](combined=\d+, )?}}group_size=4, reduction="mean"} : f32[2,2]
    CHECK: reduce_scatter({{%\d+}}) {{[{](combined=\d+, )?}}group_size=4, reduction="mean"} : f32[1]
  )C") == "");
  // Weight decay reads w: the replicated weight is sliced locally (no communication) for it.
  CHECK(FileCheck(s.text, R"C(
    CHECK: [[W:%\d+]] = variable @w {role="weight"} : f32[8,2]
    CHECK: [[ROWS:%\d+]] = reshape([[W]]) {shape=[4,4]} : f32[4,4]
    CHECK: [[MINE:%\d+]] = gather([[ROWS]], {{%\d+}}) : f32[4]
    CHECK: [[WS:%\d+]] = reshape([[MINE]]) {shape=[2,2]} : f32[2,2]
    CHECK: mul({{%\d+}}, [[WS]]) : f32[2,2]
    CHECK: [[AGW:%\d+]] = all_gather({{%\d+}}) {{[{](combined=\d+, )?}}group_size=4} : f32[8,2]
    CHECK: [[AGB:%\d+]] = all_gather({{%\d+}}) {{[{](combined=\d+, )?}}group_size=4} : f32[4]
    CHECK: assign @w = [[AGW]]
    CHECK: assign @b = [[AGB]]
  )C") == "");
  CHECK(Count(s.text, "all_reduce") == 0);
  CHECK(Count(s.text, "reduce_scatter(") == 2);
  CHECK(Count(s.text, "all_gather(") == 2);
  EXPECT_SAME_TRAINING(s.before, s.after, /*tol=*/0);
}

TEST_CASE("LAMB: per-tensor norms become partial reductions plus an all-reduce of a scalar",
          "[weight-update-sharder][lamb]") {
  Sharded s = RunSharder(kLamb);
  INFO(s.text);
  // Four norms (||w1||, ||r1||, ||w2||, ||r2||): each is a local sum over this replica's shard and an
  // all-reduce(sum) of that one scalar; nothing of tensor size is all-reduced.
  CHECK(Count(s.text, "all_reduce(") == 4);
  CHECK(Count(s.text, "reduction=\"sum\"} : f32[]") == 4);
  CHECK(FileCheck(s.text, "CHECK-NOT: all_reduce({{.*}}) {reduction=\"mean\"}") == "");
  CHECK(Count(s.text, "reduce_scatter(") == 2);
  CHECK(Count(s.text, "all_gather(") == 2);
  // w1 (dim0): the shard [2,2] is summed over both axes; w2 (flat, padded to 4): [2] over axis 0,
  // with padding masked out first.
  CHECK(FileCheck(s.text, R"C(
    CHECK: [[P1:%\d+]] = reduce_sum({{%\d+}}) {axes=[0,1]} : f32[]
    CHECK-NEXT: all_reduce([[P1]]) {{[{](combined=\d+, )?}}reduction="sum"} : f32[]
    CHECK: [[P2:%\d+]] = reduce_sum({{%\d+}}) {axes=[0,1]} : f32[]
    CHECK-NEXT: all_reduce([[P2]]) {{[{](combined=\d+, )?}}reduction="sum"} : f32[]
  )C") == "");
  CHECK(FileCheck(s.text, R"C(
    CHECK: variable @w2/m {logical_shape=[3], role="optimizer_state", shard_count=2, shard_format="flat"} : f32[2]
    CHECK: [[ONES:%\d+]] = constant {value=1.0} : f32[3]
    CHECK-NEXT: [[OPAD:%\d+]] = pad([[ONES]]) {high=[1], low=[0]} : f32[4]
    CHECK-NEXT: [[OROWS:%\d+]] = reshape([[OPAD]]) {shape=[2,2]} : f32[2,2]
    CHECK-NEXT: [[MASK:%\d+]] = gather([[OROWS]], {{%\d+}}) : f32[2]
    CHECK: [[SEL:%\d+]] = select([[MASK]], {{%\d+}}, {{%\d+}}) : f32[2]
    CHECK-NEXT: [[P3:%\d+]] = reduce_sum([[SEL]]) {axes=[0]} : f32[]
    CHECK-NEXT: all_reduce([[P3]]) {{[{](combined=\d+, )?}}reduction="sum"} : f32[]
  )C") == "");
  // The tensors' norms stay apart: no partial reduction reads values of both tensors.
  for (const Instr& in : s.after.instrs) {
    if (in.op != OpCode::kReduceSum) continue;
    const Shape& x = s.after.type(in.operands[0]).shape;
    CHECK((x == Shape{2, 2} || x == Shape{2}));
  }
  EXPECT_SAME_TRAINING(s.before, s.after, /*tol=*/1e-6);

  SECTION("packed by the collective combiner, the norms still respect the tensor boundaries") {
    Module packed = s.after;
    REQUIRE(CollectiveCombiner(1 << 20, 64).Run(packed));
    Verify(packed);
    const std::string text = Print(packed);
    INFO(text);
    CHECK(Count(text, "reduce_scatter(") == 1);
    CHECK(Count(text, "all_gather(") == 1);
    CHECK(Count(text, "all_reduce(") == 1);
    CHECK(FileCheck(text, R"C(
      CHECK: [[PACK:%\d+]] = concat({{%\d+}}, {{%\d+}}, {{%\d+}}, {{%\d+}}) {axis=0} : f32[4]
      CHECK-NEXT: all_reduce([[PACK]]) {{[{](combined=\d+, )?}}reduction="sum"} : f32[4]
    )C") == "");
    EXPECT_SAME_TRAINING(s.before, packed, /*tol=*/1e-6);
  }
}

TEST_CASE("global-norm clipping across three tensors: one partial sum per tensor, scalars all-reduced",
          "[weight-update-sharder][clipping]") {
  Sharded s = RunSharder(kClip);
  INFO(s.text);
  CHECK(Count(s.text, "reduce_scatter(") == 3);
  CHECK(Count(s.text, "all_gather(") == 3);
  CHECK(Count(s.text, "all_reduce(") == 3);
  CHECK(FileCheck(s.text, "CHECK-NOT: all_reduce({{.*}} : f32[{{\\d}}") == "");  // no tensor all-reduce
  CHECK(FileCheck(s.text, R"C(
    CHECK: [[RS1:%\d+]] = reduce_scatter({{%\d+}}) {{[{](combined=\d+, )?}}group_size=2, reduction="mean"} : f32[2,2]
    CHECK: [[RS2:%\d+]] = reduce_scatter({{%\d+}}) {{[{](combined=\d+, )?}}group_size=2, reduction="mean"} : f32[3]
    CHECK: [[RS3:%\d+]] = reduce_scatter({{%\d+}}) {{[{](combined=\d+, )?}}group_size=2, reduction="mean"} : f32[1,3]
    CHECK: [[SQ1:%\d+]] = mul([[RS1]], [[RS1]]) : f32[2,2]
    CHECK-NEXT: [[P1:%\d+]] = reduce_sum([[SQ1]]) {axes=[0,1]} : f32[]
    CHECK-NEXT: [[T1:%\d+]] = all_reduce([[P1]]) {{[{](combined=\d+, )?}}reduction="sum"} : f32[]
    CHECK: [[SQ2:%\d+]] = mul([[RS2]], [[RS2]]) : f32[3]
    CHECK-NEXT: [[P2:%\d+]] = reduce_sum([[SQ2]]) {axes=[0]} : f32[]
    CHECK-NEXT: [[T2:%\d+]] = all_reduce([[P2]]) {{[{](combined=\d+, )?}}reduction="sum"} : f32[]
    CHECK-NEXT: add([[T1]], [[T2]]) : f32[]
    CHECK: [[SQ3:%\d+]] = mul([[RS3]], [[RS3]]) : f32[1,3]
    CHECK-NEXT: [[P3:%\d+]] = reduce_sum([[SQ3]]) {axes=[0,1]} : f32[]
    CHECK-NEXT: [[T3:%\d+]] = all_reduce([[P3]]) {{[{](combined=\d+, )?}}reduction="sum"} : f32[]
  )C") == "");
  // The clipping coefficient is computed once, replicated (scalar arithmetic), and read by every shard.
  CHECK(Count(s.text, "min(") == 1);
  CHECK(s.report.fallbacks.empty());
  EXPECT_SAME_TRAINING(s.before, s.after, /*tol=*/1e-6);
}

// Reporting the clipped gradient's global norm is common. The output reads a scalar of the update
// region; it must read the rewritten norm, not keep the full-size all-reduces of every gradient alive
// next to the reduce-scatters (that doubles the step's communication).
TEST_CASE("an output reading the global gradient norm does not keep the full all-reduces alive",
          "[weight-update-sharder][clipping][bug]") {
  std::string text = kClip;
  text.replace(text.find("  assign @w1"), 0, "  output @grad_norm = %21\n");
  Sharded s = RunSharder(text);
  INFO(s.text);
  CHECK(Count(s.text, "reduce_scatter(") == 3);
  CHECK(FileCheck(s.text, "CHECK-NOT: all_reduce({{.*}} : f32[{{\\d}}") == "");  // no tensor all-reduce
  CHECK(Count(s.text, "all_reduce(") == 3);
  EXPECT_SAME_TRAINING(s.before, s.after, /*tol=*/1e-6);
}

TEST_CASE("a tensor whose size is not a multiple of N: flattened, padded, and the padding masked in reductions",
          "[weight-update-sharder][padding]") {
  Sharded s = RunSharder(kPadded);
  INFO(s.text);
  CHECK(FileCheck(s.text, R"C(
    CHECK: variable @w/momentum {logical_shape=[5,3], role="optimizer_state", shard_count=2, shard_format="flat"} : f32[8]
    CHECK: [[FLAT:%\d+]] = reshape({{%\d+}}) {shape=[15]} : f32[15]
    CHECK-NEXT: [[PAD:%\d+]] = pad([[FLAT]]) {high=[1], low=[0]} : f32[16]
    CHECK-NEXT: [[RS:%\d+]] = reduce_scatter([[PAD]]) {{[{](combined=\d+, )?}}group_size=2, reduction="mean"} : f32[8]
  )C") == "");
  // The mask: ones over the 15 real elements, zero-padded, this replica's slice.
  CHECK(FileCheck(s.text, R"C(
    CHECK: [[ONES:%\d+]] = constant {value=1.0} : f32[15]
    CHECK-NEXT: [[OPAD:%\d+]] = pad([[ONES]]) {high=[1], low=[0]} : f32[16]
    CHECK-NEXT: [[OROWS:%\d+]] = reshape([[OPAD]]) {shape=[2,8]} : f32[2,8]
    CHECK: [[MASK:%\d+]] = gather([[OROWS]], {{%\d+}}) : f32[8]
    CHECK: [[S:%\d+]] = select([[MASK]], {{%\d+}}, {{%\d+}}) : f32[8]
    CHECK-NEXT: [[PS:%\d+]] = reduce_sum([[S]]) {axes=[0]} : f32[]
    CHECK-NEXT: all_reduce([[PS]]) {{[{](combined=\d+, )?}}reduction="sum"} : f32[]
    CHECK: [[NINF:%\d+]] = constant {value=-inf} : f32[8]
    CHECK-NEXT: [[SM:%\d+]] = select([[MASK]], {{%\d+}}, [[NINF]]) : f32[8]
    CHECK-NEXT: [[PM:%\d+]] = reduce_max([[SM]]) {axes=[0]} : f32[]
    CHECK-NEXT: all_reduce([[PM]]) {{[{](combined=\d+, )?}}reduction="max"} : f32[]
    CHECK: [[SE:%\d+]] = select([[MASK]], {{%\d+}}, {{%\d+}}) : f32[8]
    CHECK-NEXT: [[PE:%\d+]] = reduce_sum([[SE]]) {axes=[0]} : f32[]
    CHECK-NEXT: [[TE:%\d+]] = all_reduce([[PE]]) {{[{](combined=\d+, )?}}reduction="sum"} : f32[]
    CHECK-NEXT: [[N:%\d+]] = constant {value=15.0} : f32[]
    CHECK-NEXT: div([[TE]], [[N]]) : f32[]
  )C") == "");
  // The weight's local slice comes from its padded flat form; the gathered result drops the padding.
  CHECK(FileCheck(s.text, R"C(
    CHECK: [[W:%\d+]] = variable @w {role="weight"} : f32[5,3]
    CHECK: [[WF:%\d+]] = reshape([[W]]) {shape=[15]} : f32[15]
    CHECK-NEXT: [[WP:%\d+]] = pad([[WF]]) {high=[1], low=[0]} : f32[16]
    CHECK-NEXT: [[WR:%\d+]] = reshape([[WP]]) {shape=[2,8]} : f32[2,8]
    CHECK-NEXT: gather([[WR]], {{%\d+}}) : f32[8]
    CHECK: [[AG:%\d+]] = all_gather({{%\d+}}) {{[{](combined=\d+, )?}}group_size=2} : f32[16]
    CHECK-NEXT: [[CUT:%\d+]] = slice([[AG]]) {limit=[15], start=[0]} : f32[15]
    CHECK-NEXT: [[NW:%\d+]] = reshape([[CUT]]) {shape=[5,3]} : f32[5,3]
    CHECK: assign @w = [[NW]]
  )C") == "");
  REQUIRE(s.report.variables.size() == 2);
  CHECK(s.report.variables[1].padding == 1);
  CHECK(s.report.variables[1].format == "flat");
  EXPECT_SAME_TRAINING(s.before, s.after, /*tol=*/1e-6);
}

TEST_CASE("a non-partitionable op runs replicated on gathered values, and the report names it",
          "[weight-update-sharder][fallback]") {
  Sharded s = RunSharder(kFallback);
  INFO(s.text);
  // transpose and matmul read the all-gathered gradient; their results are sliced back to the shard.
  CHECK(FileCheck(s.text, R"C(
    CHECK: [[RS:%\d+]] = reduce_scatter({{%\d+}}) {{[{](combined=\d+, )?}}group_size=3, reduction="mean"} : f32[1,3]
    CHECK-NEXT: [[FULL:%\d+]] = all_gather([[RS]]) {{[{](combined=\d+, )?}}group_size=3} : f32[3,3]
    CHECK-NEXT: [[T:%\d+]] = transpose([[FULL]]) {perm=[1,0]} : f32[3,3]
    CHECK: [[TS:%\d+]] = gather([[T]], {{%\d+}}) : f32[3]
    CHECK: add([[RS]], {{%\d+}}) : f32[1,3]
    CHECK: [[MM:%\d+]] = matmul([[FULL]], {{%\d+}}) {transpose_a=0, transpose_b=0} : f32[3,3]
    CHECK: gather([[MM]], {{%\d+}}) : f32[3]
  )C") == "");
  CHECK(Count(s.text, "all_gather(") == 2);  // the fallbacks' operand and the weight
  REQUIRE(s.report.fallbacks.size() == 2);
  CHECK_THAT(s.report.fallbacks[0], Catch::Contains("transpose(f32[3,3]) -> f32[3,3]") &&
                                        Catch::Contains("not partitionable"));
  CHECK_THAT(s.report.fallbacks[1], Catch::Contains("matmul(f32[3,3], f32[3,3]) -> f32[3,3]"));
  const std::string table = s.report.ToString();
  CHECK_THAT(table, Catch::Contains("fallback: ") && Catch::Contains("transpose") && Catch::Contains("matmul"));
  EXPECT_SAME_TRAINING(s.before, s.after, /*tol=*/0);
}

TEST_CASE("replica groups: 8 replicas in groups of 4, every collective carries the groups",
          "[weight-update-sharder][groups]") {
  ShardingOptions o;
  o.group_size = 4;
  Sharded s = RunSharder(kGroups, o);
  INFO(s.text);
  const std::string groups = "groups=[[0,1,2,3],[4,5,6,7]]";
  CHECK(Count(s.text, "reduce_scatter(") == 2);
  CHECK(Count(s.text, "all_gather(") == 2);
  CHECK(Count(s.text, "group_size=4, " + groups + ", reduction=\"mean\"}") == 2);
  CHECK(Count(s.text, "all_gather(") == Count(s.text, "group_size=4, " + groups + "} : f32["));
  // Each scalar norm all-reduce stays inside the group (no group_size on an all-reduce).
  CHECK(Count(s.text, "all_reduce(") == 3);
  CHECK(Count(s.text, "{" + groups + ", reduction=\"sum\"} : f32[]") == 3);
  CHECK(FileCheck(s.text, R"C(
    CHECK: variable @w/momentum {logical_shape=[8,2], role="optimizer_state", shard_count=4, shard_format="dim0"} : f32[2,2]
    CHECK: variable @b/momentum {logical_shape=[6], role="optimizer_state", shard_count=4, shard_format="flat"} : f32[2]
  )C") == "");
  // Local slices are indexed by the position in the group: r - (r / 4) * 4.
  CHECK(FileCheck(s.text, R"C(
    CHECK: [[R:%\d+]] = replica_id : s32[]
    CHECK-NEXT: [[FOUR:%\d+]] = constant {value=4{{(\.0)?}}} : s32[]
    CHECK-NEXT: [[Q:%\d+]] = div([[R]], [[FOUR]]) : s32[]
    CHECK-NEXT: [[QG:%\d+]] = mul([[Q]], [[FOUR]]) : s32[]
    CHECK-NEXT: [[POS:%\d+]] = sub([[R]], [[QG]]) : s32[]
    CHECK: gather({{%\d+}}, [[POS]]) : f32[4]
  )C") == "");
  EXPECT_SAME_TRAINING(s.before, s.after, /*tol=*/1e-6, /*group_size=*/4);
}

// The pass takes the group size from its options; the gradients' all-reduces carry their own groups.
// When the two disagree the sharded module must still compute what the module computed (or the pass
// must refuse with an error), never silently reduce over other replicas.
TEST_CASE("sharding options that disagree with the all-reduce's replica groups never change the result",
          "[weight-update-sharder][groups][bug]") {
  SECTION("grouped all-reduces (groups of 4), default options") {
    Module before = Parse(kGroups);
    Module after = before;
    WeightUpdateSharder pass;  // group_size 0: "all replicas form one group"
    bool refused = false;
    try {
      pass.Run(after);
    } catch (const Error& e) {
      refused = true;
      INFO(e.what());
    }
    if (!refused) {
      Verify(after);
      INFO(Print(after));
      EXPECT_SAME_TRAINING(before, after, /*tol=*/1e-6, /*group_size=*/4);
    }
  }
  SECTION("all-reduces over all 4 replicas, options with groups of 2") {
    ShardingOptions o;
    o.group_size = 2;
    Module before = Parse(kMomentum);
    Module after = before;
    WeightUpdateSharder pass(o);
    bool refused = false;
    try {
      pass.Run(after);
    } catch (const Error& e) {
      refused = true;
      INFO(e.what());
    }
    if (!refused) {
      Verify(after);
      INFO(Print(after));
      EXPECT_SAME_TRAINING(before, after, /*tol=*/0, /*group_size=*/4);
    }
  }
}

// Mixed replica groups at N=4: w1's gradient is reduced within [[0,1],[2,3]], w2's over all four
// replicas. Momentum on both; w1's update is scaled by 1 / (1 + ||m1||), a norm inside its chain.
// The scalar learning rate %8 is shared by both chains (a replicated scalar joins nothing).
const char* kMixedGroups = R"IR(
module @mixed replicas=4 {
  %0 = input @x1 : f32[4,2]
  %1 = input @x2 : f32[6]
  %2 = variable @w1 {role="weight"} : f32[4,2]
  %3 = variable @w2 {role="weight"} : f32[6]
  %4 = mul(%0, %2) : f32[4,2]
  %5 = all_reduce(%4) {groups=[[0,1],[2,3]], reduction="mean"} : f32[4,2]
  %6 = mul(%1, %3) : f32[6]
  %7 = all_reduce(%6) {reduction="mean"} : f32[6]
  %8 = constant {value=0.1} : f32[]
  %9 = variable @w1/momentum {role="optimizer_state"} : f32[4,2]
  %10 = constant {value=0.9} : f32[4,2]
  %11 = mul(%10, %9) : f32[4,2]
  %12 = add(%11, %5) : f32[4,2]
  %13 = mul(%12, %12) : f32[4,2]
  %14 = reduce_sum(%13) {axes=[0,1]} : f32[]
  %15 = sqrt(%14) : f32[]
  %16 = constant {value=1.0} : f32[]
  %17 = add(%15, %16) : f32[]
  %18 = div(%8, %17) : f32[]
  %19 = broadcast(%18) {dims=[], shape=[4,2]} : f32[4,2]
  %20 = mul(%19, %12) : f32[4,2]
  %21 = sub(%2, %20) : f32[4,2]
  %22 = variable @w2/momentum {role="optimizer_state"} : f32[6]
  %23 = constant {value=0.9} : f32[6]
  %24 = mul(%23, %22) : f32[6]
  %25 = add(%24, %7) : f32[6]
  %26 = broadcast(%8) {dims=[], shape=[6]} : f32[6]
  %27 = mul(%26, %25) : f32[6]
  %28 = sub(%3, %27) : f32[6]
  assign @w1/momentum = %12
  assign @w1 = %21
  assign @w2/momentum = %25
  assign @w2 = %28
}
)IR";

// Trains `before` and `after` side by side (as TrainingDifference) and compares, after every step,
// the logical state each replica sees: every sharded variable reassembled from that replica's own
// group of its shard count (runtime::LogicalStateFrom), so variables sharded over different groups
// are each checked against the replicated run. "" when all agree within `tol`.
std::string MixedGroupsDifference(const Module& before, const Module& after, double tol, int steps = 3) {
  std::mt19937 rng(7);
  const TensorMap logical = RandomLogicalState(before, rng);
  const auto inputs = RandomInputs(before, steps, rng);
  const Run rb = Train(before, logical, inputs), ra = Train(after, logical, inputs);
  std::string out;
  for (int s = 0; s < steps; ++s)
    for (int r = 0; r < before.num_replicas; ++r) {
      const TensorMap lb = runtime::LogicalStateFrom(before, rb.states[s], r);
      const TensorMap la = runtime::LogicalStateFrom(after, ra.states[s], r);
      for (auto& [name, t] : lb) {
        const std::string d = la.count(name) ? Compare("@" + name, la.at(name), t, tol) : "@" + name + " missing";
        if (!d.empty()) out += Str("step ", s, ", replica ", r, ": ", d, "\n");
      }
    }
  const TensorMap last = runtime::LogicalStateFrom(before, rb.states.back(), 0);
  for (const char* w : {"w1", "w2"})
    if (last.at(w) == logical.at(w)) out += Str("training did not change @", w, "\n");
  return out;
}

TEST_CASE("mixed replica groups: each gradient all-reduce is sharded within its own groups",
          "[weight-update-sharder][groups][mixed]") {
  Sharded s = RunSharder(kMixedGroups);
  INFO(s.text);
  REQUIRE(s.changed);
  const std::string halves = "groups=[[0,1],[2,3]]";
  CHECK(FileCheck(s.text, R"C(
    CHECK: variable @w1/momentum {logical_shape=[4,2], role="optimizer_state", shard_count=2, shard_format="dim0"} : f32[2,2]
    CHECK: variable @w2/momentum {logical_shape=[6], role="optimizer_state", shard_count=4, shard_format="flat"} : f32[2]
  )C") == "");
  // w1: reduce-scatter, norm and all-gather within the halves; w2: over all four (no groups attribute).
  CHECK(FileCheck(s.text, R"C(
    CHECK: reduce_scatter({{%\d+}}) {group_size=2, groups=[[0,1],[2,3]], reduction="mean"} : f32[2,2]
    CHECK: all_reduce({{%\d+}}) {groups=[[0,1],[2,3]], reduction="sum"} : f32[]
    CHECK: all_gather({{%\d+}}) {group_size=2, groups=[[0,1],[2,3]]} : f32[4,2]
  )C") == "");
  CHECK(FileCheck(s.text, R"C(
    CHECK: [[PAD:%\d+]] = pad({{%\d+}}) {high=[2], low=[0]} : f32[8]
    CHECK-NEXT: reduce_scatter([[PAD]]) {group_size=4, reduction="mean"} : f32[2]
    CHECK: all_gather({{%\d+}}) {group_size=4} : f32[8]
  )C") == "");
  CHECK(FileCheck(s.text, "CHECK-NOT: all_reduce({{.*}} : f32[{{\\d}}") == "");  // no tensor all-reduce is left
  CHECK(Count(s.text, "reduce_scatter(") == 2);
  CHECK(Count(s.text, "all_gather(") == 2);
  CHECK(Count(s.text, "all_reduce(") == 1);
  CHECK(Count(s.text, halves) == 3);
  // Local slices: w1's by the position in its half (r - (r / 2) * 2), w2's by the replica id.
  CHECK(FileCheck(s.text, R"C(
    CHECK: [[R:%\d+]] = replica_id : s32[]
    CHECK-NEXT: [[TWO:%\d+]] = constant {value=2{{(\.0)?}}} : s32[]
    CHECK-NEXT: [[Q:%\d+]] = div([[R]], [[TWO]]) : s32[]
  )C") == "");
  for (const VariableShardingRow& row : s.report.variables) {
    INFO(row.name << ": " << row.why);
    if (row.name == "w1/momentum") CHECK((row.sharded && row.why.find("(groups of 2)") != std::string::npos));
    if (row.name == "w2/momentum") CHECK((row.sharded && row.why.find("(groups of 4)") != std::string::npos));
  }
  const std::string d = MixedGroupsDifference(s.before, s.after, /*tol=*/1e-6);
  CHECK(d == "");

  SECTION("the collective combiner keeps the two groupings apart, and the result is unchanged") {
    Module combined = s.after;
    CollectiveCombiner(1 << 20, 64).Run(combined);
    Verify(combined);
    INFO(Print(combined));
    CHECK(Count(Print(combined), "reduce_scatter(") == 2);
    CHECK(MixedGroupsDifference(s.before, combined, /*tol=*/1e-6) == "");
  }
}

TEST_CASE("mixed replica groups: the numbers at N=4 with a plain momentum update are bitwise equal",
          "[weight-update-sharder][groups][mixed]") {
  std::string text = kMixedGroups;
  text.replace(text.find("%19 = broadcast(%18)"), std::string("%19 = broadcast(%18)").size(), "%19 = broadcast(%8)");
  Sharded s = RunSharder(text);
  INFO(s.text);
  CHECK(Count(s.text, "all_reduce(") == 0);
  CHECK(MixedGroupsDifference(s.before, s.after, /*tol=*/0) == "");
}

TEST_CASE("mixed replica groups within one update chain are refused, naming the all-reduces and their groups",
          "[weight-update-sharder][groups][mixed]") {
  // Global-norm clipping joins w1's and w2's updates into one chain; their gradients disagree on groups.
  const char* text = R"IR(
module @mixed_clip replicas=4 {
  %0 = input @x1 : f32[4,2]
  %1 = input @x2 : f32[6]
  %2 = variable @w1 {role="weight"} : f32[4,2]
  %3 = variable @w2 {role="weight"} : f32[6]
  %4 = mul(%0, %2) : f32[4,2]
  %5 = all_reduce(%4) {groups=[[0,1],[2,3]], reduction="mean"} : f32[4,2]
  %6 = mul(%1, %3) : f32[6]
  %7 = all_reduce(%6) {groups=[[0,1,2,3]], reduction="mean"} : f32[6]
  %8 = mul(%5, %5) : f32[4,2]
  %9 = reduce_sum(%8) {axes=[0,1]} : f32[]
  %10 = mul(%7, %7) : f32[6]
  %11 = reduce_sum(%10) {axes=[0]} : f32[]
  %12 = add(%9, %11) : f32[]
  %13 = broadcast(%12) {dims=[], shape=[4,2]} : f32[4,2]
  %14 = mul(%13, %5) : f32[4,2]
  %15 = sub(%2, %14) : f32[4,2]
  %16 = broadcast(%12) {dims=[], shape=[6]} : f32[6]
  %17 = mul(%16, %7) : f32[6]
  %18 = sub(%3, %17) : f32[6]
  assign @w1 = %15
  assign @w2 = %18
}
)IR";
  Module m = ParseVerified(text);
  const std::string before = Print(m);
  WeightUpdateSharder pass;
  try {
    pass.Run(m);
    FAIL("sharded a chain whose gradients use different replica groups");
  } catch (const Error& e) {
    CHECK(std::string(e.what()) ==
          "weight-update-sharder: module @mixed_clip: the updates of @w1, @w2 are one computation, but its gradient "
          "all-reduces use different replica groups: %5 (all_reduce) groups=[[0,1],[2,3]] and %7 (all_reduce) "
          "groups=[[0,1,2,3]]; sharding needs one grouping per update chain");
  }
  CHECK(Print(m) == before);  // refused before changing anything
}

TEST_CASE("non-contiguous replica groups are refused, naming the all-reduce", "[weight-update-sharder][groups]") {
  std::string text = kMixedGroups;
  text.replace(text.find("groups=[[0,1],[2,3]]"), std::string("groups=[[0,1],[2,3]]").size(), "groups=[[0,2],[1,3]]");
  Module m = ParseVerified(text);
  WeightUpdateSharder pass;
  CHECK_THROWS_WITH(pass.Run(m), "weight-update-sharder: module @mixed: %5 (all_reduce) reduces over groups "
                                 "[[0,2],[1,3]]; only contiguous replica groups of equal size are supported, such as "
                                 "[[0,1],[2,3]]");
}

TEST_CASE("an already-sharded module: a second Run returns false and the text is unchanged",
          "[weight-update-sharder][idempotent]") {
  for (const char* text : {kAdam, kMomentum, kLamb, kClip, kPadded, kFallback}) {
    Sharded s = RunSharder(text);
    REQUIRE(s.changed);
    Module again = s.after;
    WeightUpdateSharder second;
    CHECK_FALSE(second.Run(again));
    CHECK(Print(again) == s.text);
  }
  SECTION("also after the collective combiner") {
    Sharded s = RunSharder(kClip);
    Module combined = s.after;
    CollectiveCombiner(1 << 20, 64).Run(combined);
    const std::string text = Print(combined);
    WeightUpdateSharder second;
    CHECK_FALSE(second.Run(combined));
    CHECK(Print(combined) == text);
  }
  SECTION("with gather_at_start") {
    ShardingOptions o;
    o.gather_at_start = true;
    Sharded s = RunSharder(kForward, o);
    Module again = s.after;
    WeightUpdateSharder second(o);
    CHECK_FALSE(second.Run(again));
    CHECK(Print(again) == s.text);
  }
}

TEST_CASE("replicas=1, or a group of one: no change", "[weight-update-sharder][noop]") {
  SECTION("replicas=1") {
    std::string text = kAdam;
    text.replace(text.find("replicas=2"), 10, "replicas=1");
    Sharded s = RunSharder(text);
    CHECK_FALSE(s.changed);
    CHECK(s.text == Print(s.before));
    CHECK(Count(s.text, "all_reduce(") == 1);
  }
  SECTION("group_size=1") {
    ShardingOptions o;
    o.group_size = 1;
    Sharded s = RunSharder(kMomentum, o);
    CHECK_FALSE(s.changed);
    CHECK(s.text == Print(s.before));
  }
}

TEST_CASE("a module without a weight update: Run returns false and the text is unchanged",
          "[weight-update-sharder][noop][bug]") {
  // replicas=2, a forward with an all-reduced output and a step counter: nothing to shard.
  const char* text = R"IR(
module @forward_only replicas=2 {
  %0 = input @x : f32[4]
  %1 = variable @w {role="weight"} : f32[4]
  %2 = mul(%0, %1) : f32[4]
  %3 = all_reduce(%2) {reduction="mean"} : f32[4]
  %4 = variable @count {role="step"} : s32[]
  %5 = constant {value=1} : s32[]
  %6 = add(%4, %5) : s32[]
  assign @count = %6
  output @y = %3
}
)IR";
  Sharded s = RunSharder(text);
  CHECK(s.text == Print(s.before));
  CHECK_FALSE(s.changed);  // Pass::Run "returns whether it changed anything"
}

TEST_CASE("gather_at_start: weights become sharded variables and the forward reads their all-gather",
          "[weight-update-sharder][gather-at-start]") {
  ShardingOptions o;
  o.gather_at_start = true;
  Sharded s = RunSharder(kForward, o);
  INFO(s.text);
  CHECK(FileCheck(s.text, R"C(
    CHECK: [[W:%\d+]] = variable @w {logical_shape=[4,3], role="weight", shard_count=2, shard_format="dim0"} : f32[2,3]
    CHECK: [[B:%\d+]] = variable @b {logical_shape=[3], role="weight", shard_count=2, shard_format="flat"} : f32[2]
    CHECK: variable @w/momentum {logical_shape=[4,3], role="optimizer_state", shard_count=2, shard_format="dim0"} : f32[2,3]
    CHECK: [[WF:%\d+]] = all_gather([[W]]) {{[{](combined=\d+, )?}}group_size=2} : f32[4,3]
    CHECK-NEXT: [[H:%\d+]] = matmul(%0, [[WF]]) {transpose_a=0, transpose_b=0} : f32[2,3]
    CHECK: [[BF:%\d+]] = all_gather([[B]]) {{[{](combined=\d+, )?}}group_size=2} : f32[4]
    CHECK-NEXT: [[BL:%\d+]] = slice([[BF]]) {limit=[3], start=[0]} : f32[3]
    CHECK: [[NW:%\d+]] = sub([[W]], {{%\d+}}) : f32[2,3]
    CHECK: [[NB:%\d+]] = sub([[B]], {{%\d+}}) : f32[2]
    CHECK: assign @w = [[NW]]
    CHECK: assign @b = [[NB]]
    CHECK: output @h = [[H]]
    CHECK: output @b = [[BL]]
  )C") == "");
  // The weights are not gathered at the end of the step any more: the only all-gathers read variables.
  for (const Instr& in : s.after.instrs)
    if (in.op == OpCode::kAllGather) CHECK(s.after.at(in.operands[0]).op == OpCode::kVariable);
  CHECK(Count(s.text, "all_gather(") == 2);
  CHECK(Count(s.text, "reduce_scatter(") == 2);
  REQUIRE(s.report.variables.size() == 3);
  CHECK(s.report.variables[0].sharded);
  CHECK(s.report.variables[0].why == "weight: sharded, all-gathered at the start of the step");
  CHECK(s.report.variables[1].sharded);
  CHECK(s.report.variables[1].padding == 1);
  EXPECT_SAME_TRAINING(s.before, s.after, /*tol=*/0);
}

// Optimizer state that something outside the update reads must stay whole. Here an output reads the
// momentum buffer directly: sharding it would silently change what the output holds.
TEST_CASE("optimizer state read by an output stays replicated", "[weight-update-sharder][bug]") {
  const char* text = R"IR(
module @state_output replicas=2 {
  %0 = input @x : f32[4]
  %1 = variable @w {role="weight"} : f32[4]
  %2 = mul(%0, %1) : f32[4]
  %3 = all_reduce(%2) {reduction="mean"} : f32[4]
  %4 = variable @w/momentum {role="optimizer_state"} : f32[4]
  %5 = constant {value=0.9} : f32[4]
  %6 = mul(%5, %4) : f32[4]
  %7 = add(%6, %3) : f32[4]
  %8 = sub(%1, %7) : f32[4]
  assign @w/momentum = %7
  assign @w = %8
  output @momentum = %4
}
)IR";
  Sharded s = RunSharder(text);
  INFO(s.text);
  CHECK(s.after.type(s.after.FindOutput("momentum")).ToString() == "f32[4]");
  REQUIRE(s.report.variables.size() == 2);
  CHECK_FALSE(s.report.variables[1].sharded);
  EXPECT_SAME_TRAINING(s.before, s.after, /*tol=*/0);
}

// Every kind of row: sharded / replicated weight (dim0, flat), a variable the update does not assign,
// the step counter, sharded state (dim0, flat with padding), state read outside the update, a variable
// of another role; and a fallback (a per-column scale broadcast from [3] to [4,3]).
const char* kReport = R"IR(
module @report replicas=2 {
  %0 = input @x : f32[4,3]
  %1 = input @y : f32[5]
  %2 = variable @w {role="weight"} : f32[4,3]
  %3 = variable @b {role="weight"} : f32[5]
  %4 = variable @frozen {role="weight"} : f32[2]
  %5 = mul(%0, %2) : f32[4,3]
  %6 = all_reduce(%5) {reduction="mean"} : f32[4,3]
  %7 = mul(%1, %3) : f32[5]
  %8 = all_reduce(%7) {reduction="mean"} : f32[5]
  %9 = variable @step {role="step"} : s32[]
  %10 = variable @w/m {role="optimizer_state"} : f32[4,3]
  %11 = variable @b/m {role="optimizer_state"} : f32[5]
  %12 = variable @b/ema {role="optimizer_state"} : f32[5]
  %13 = variable @scale {role="hyper"} : f32[4,3]
  %14 = variable @col {role="hyper"} : f32[3]
  %15 = constant {value=0.9} : f32[4,3]
  %16 = mul(%15, %10) : f32[4,3]
  %17 = add(%16, %6) : f32[4,3]
  %18 = broadcast(%14) {dims=[1], shape=[4,3]} : f32[4,3]
  %19 = mul(%18, %17) : f32[4,3]
  %20 = mul(%13, %19) : f32[4,3]
  %21 = sub(%2, %20) : f32[4,3]
  %22 = constant {value=0.5} : f32[4,3]
  %23 = mul(%22, %13) : f32[4,3]
  %24 = constant {value=0.9} : f32[5]
  %25 = mul(%24, %11) : f32[5]
  %26 = add(%25, %8) : f32[5]
  %27 = constant {value=0.1} : f32[5]
  %28 = mul(%27, %26) : f32[5]
  %29 = sub(%3, %28) : f32[5]
  %30 = constant {value=0.5} : f32[5]
  %31 = mul(%30, %12) : f32[5]
  %32 = mul(%30, %3) : f32[5]
  %33 = add(%31, %32) : f32[5]
  %34 = reduce_sum(%12) {axes=[0]} : f32[]
  %35 = constant {value=1} : s32[]
  %36 = add(%9, %35) : s32[]
  assign @w = %21
  assign @b = %29
  assign @step = %36
  assign @w/m = %17
  assign @b/m = %26
  assign @b/ema = %33
  assign @scale = %23
  output @ema_sum = %34
}
)IR";

TEST_CASE("report: one row per variable (sharded, why, format, padding, bytes) and the printed table",
          "[weight-update-sharder][report]") {
  Sharded s = RunSharder(kReport);
  INFO(s.text);
  const ShardingReport& r = s.report;
  CHECK(r.group_size == 2);
  struct Row {
    const char* name;
    const char* role;
    bool sharded;
    const char* format;
    int64_t padding, before, after;
    const char* why;
  };
  const std::vector<Row> expected = {
      {"w", "weight", false, "dim0", 0, 48, 48, "weight: update runs on a local slice, all-gathered at the end of the step"},
      {"b", "weight", false, "flat", 1, 20, 20, "weight: update runs on a local slice, all-gathered at the end of the step"},
      {"frozen", "weight", false, "-", 0, 8, 8, "not updated by the weight update"},
      {"step", "step", false, "-", 0, 4, 4, "scalar: replicated"},
      {"w/m", "optimizer_state", true, "dim0", 0, 48, 24, "optimizer state: lives as a 1/N shard"},
      {"b/m", "optimizer_state", true, "flat", 1, 20, 12, "optimizer state: lives as a 1/N shard"},
      {"b/ema", "optimizer_state", false, "-", 0, 20, 20, "used outside the weight update: replicated"},
      {"scale", "hyper", false, "-", 0, 48, 48, "replicated"},
      {"col", "hyper", false, "-", 0, 12, 12, "not updated by the weight update"},
  };
  REQUIRE(r.variables.size() == expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const VariableShardingRow& row = r.variables[i];
    const Row& e = expected[i];
    INFO("row " << i << ": " << row.name);
    CHECK(row.name == e.name);
    CHECK(row.role == e.role);
    CHECK(row.sharded == e.sharded);
    CHECK(row.format == e.format);
    CHECK(row.padding == e.padding);
    CHECK(row.bytes_before == e.before);
    CHECK(row.bytes_after == e.after);
    CHECK(row.why == e.why);
    // DESIGN §5: sharded bytes = replicated / N plus at most N-1 padding elements.
    if (row.sharded) {
      CHECK(row.bytes_after * 2 == row.bytes_before + 4 * row.padding);
      CHECK(row.padding <= 1);
    }
  }
  REQUIRE(r.fallbacks.size() == 1);
  CHECK_THAT(r.fallbacks[0], Catch::Contains("broadcast(f32[3]) -> f32[4,3]") &&
                                 Catch::Contains("not partitionable; runs replicated on all-gathered values"));

  const std::string table = r.ToString();
  INFO(table);
  const std::vector<std::string> lines = Lines(table);
  REQUIRE(lines.size() == 1 + expected.size() + 1 + 1);
  CHECK(FileCheck(table, R"C(
    CHECK: variable{{ +}}role{{ +}}sharded{{ +}}format{{ +}}padding{{ +}}bytes before{{ +}}bytes after{{ +}}why
    CHECK-NEXT: w {{ +}}weight {{ +}}no {{ +}}dim0 {{ +}}0 {{ +}}48 B {{ +}}48 B {{ +}}weight: update runs on a local slice
    CHECK-NEXT: b {{ +}}weight {{ +}}no {{ +}}flat {{ +}}1 {{ +}}20 B {{ +}}20 B
    CHECK-NEXT: frozen {{ +}}weight {{ +}}no {{ +}}- {{ +}}0 {{ +}}8 B {{ +}}8 B {{ +}}not updated by the weight update
    CHECK-NEXT: step {{ +}}step {{ +}}no {{ +}}- {{ +}}0 {{ +}}4 B {{ +}}4 B {{ +}}scalar: replicated
    CHECK-NEXT: w/m {{ +}}optimizer_state {{ +}}yes {{ +}}dim0 {{ +}}0 {{ +}}48 B {{ +}}24 B {{ +}}optimizer state: lives as a 1/N shard
    CHECK-NEXT: b/m {{ +}}optimizer_state {{ +}}yes {{ +}}flat {{ +}}1 {{ +}}20 B {{ +}}12 B
    CHECK-NEXT: b/ema {{ +}}optimizer_state {{ +}}no {{ +}}- {{ +}}0 {{ +}}20 B {{ +}}20 B {{ +}}used outside the weight update: replicated
    CHECK-NEXT: scale {{ +}}hyper {{ +}}no {{ +}}- {{ +}}0 {{ +}}48 B {{ +}}48 B {{ +}}replicated
    CHECK-NEXT: col {{ +}}hyper {{ +}}no
    CHECK-NEXT: total {{ +}}228 B {{ +}}196 B {{ +}}(per replica, group of 2)
    CHECK-NEXT: fallback: %18 broadcast(f32[3]) -> f32[4,3]: not partitionable
  )C") == "");
  // Columns line up: every row's "sharded" column starts where the header's does.
  const size_t col = lines[0].find("sharded");
  for (size_t i = 1; i <= expected.size(); ++i) CHECK(lines[i].substr(col, 2) == (expected[i - 1].sharded ? "ye" : "no"));
  EXPECT_SAME_TRAINING(s.before, s.after, /*tol=*/0);
}

TEST_CASE("report: KiB and MiB in the byte columns", "[weight-update-sharder][report]") {
  const char* text = R"IR(
module @big replicas=4 {
  %0 = input @x : f32[512,512]
  %1 = variable @w {role="weight"} : f32[512,512]
  %2 = mul(%0, %1) : f32[512,512]
  %3 = all_reduce(%2) {reduction="mean"} : f32[512,512]
  %4 = variable @w/momentum {role="optimizer_state"} : f32[512,512]
  %5 = constant {value=0.9} : f32[512,512]
  %6 = mul(%5, %4) : f32[512,512]
  %7 = add(%6, %3) : f32[512,512]
  %8 = sub(%1, %7) : f32[512,512]
  %9 = input @y : f32[256]
  %10 = variable @b {role="weight"} : f32[256]
  %11 = mul(%9, %10) : f32[256]
  %12 = all_reduce(%11) {reduction="mean"} : f32[256]
  %13 = variable @b/momentum {role="optimizer_state"} : f32[256]
  %14 = constant {value=0.9} : f32[256]
  %15 = mul(%14, %13) : f32[256]
  %16 = add(%15, %12) : f32[256]
  %17 = sub(%10, %16) : f32[256]
  assign @w/momentum = %7
  assign @w = %8
  assign @b/momentum = %16
  assign @b = %17
}
)IR";
  Sharded s = RunSharder(text);
  const std::string table = s.report.ToString();
  INFO(table);
  CHECK(FileCheck(table, R"C(
    CHECK: w {{ +}}weight {{ +}}no {{ +}}dim0 {{ +}}0 {{ +}}1.00 MiB {{ +}}1.00 MiB
    CHECK: w/momentum {{ +}}optimizer_state {{ +}}yes {{ +}}dim0 {{ +}}0 {{ +}}1.00 MiB {{ +}}256.0 KiB
    CHECK: b {{ +}}weight {{ +}}no {{ +}}dim0 {{ +}}0 {{ +}}1.0 KiB {{ +}}1.0 KiB
    CHECK: b/momentum {{ +}}optimizer_state {{ +}}yes {{ +}}dim0 {{ +}}0 {{ +}}1.0 KiB {{ +}}256 B
    CHECK: total {{ +}}2.00 MiB {{ +}}1.25 MiB {{ +}}(per replica, group of 4)
  )C") == "");
}

TEST_CASE("batch-norm running statistics (model_state) stay replicated with their assignments, and are reported",
          "[weight-update-sharder][model-state]") {
  constexpr int kReplicas = 4;
  for (int bn_group : {0, 4, 2}) {  // per-replica statistics; cross-replica over all 4; over pairs
    const bool cross = bn_group > 0;
    INFO((cross ? "cross-replica" : "per-replica") << " batch norm, group " << bn_group);
    dsl::Model m("bn", 2);
    auto x = m.input("x", dsl::f32({8, 6}));
    auto y = m.input("y", dsl::s32({8}));
    auto bn = dsl::BatchNormOptions().with_cross_replica(cross).with_group_size(bn_group);
    auto h = x.dense(16, "fc1").batch_norm("bn", bn).relu();
    auto loss = h.dense(3, "fc2").cross_entropy(y).mean();
    m.train(loss);
    Module before = m.lower(kReplicas, dsl::Mode::kTrain);
    Autodiff("loss").Run(before);
    DataParallelLowering().Run(before);
    OptimizerLowering(OptimizerConfig().kind(OptimizerKind::kAdam).lr(1e-2)).Run(before);
    Verify(before);
    Module after = before;
    WeightUpdateSharder pass(ShardingOptions{kReplicas});  // the forward's all-reduces over pairs do not count
    REQUIRE(pass.Run(after));
    Verify(after);
    const ShardingReport& report = pass.report();
    INFO(report.ToString());
    int model_state_rows = 0;
    for (const VariableShardingRow& row : report.variables) {
      if (row.role == kRoleModelState) {
        ++model_state_rows;
        CHECK_FALSE(row.sharded);
        CHECK_THAT(row.why, Catch::Contains("model state"));
        CHECK(row.bytes_after == row.bytes_before);
      }
      if (row.name == "fc1.w/m") CHECK(row.sharded);
    }
    CHECK(model_state_rows == 2);
    for (const char* name : {"bn.running_mean", "bn.running_var"}) {
      ValueId v = after.FindVariable(name);
      REQUIRE(v != kNoValue);
      CHECK(after.type(v).shape == Shape{16});
      ShardFormat f;
      CHECK_FALSE(ShardFormat::FromAttrs(after.at(v), &f));
      ValueId assigned = after.AssignedValue(v);
      REQUIRE(assigned != kNoValue);
      CHECK(after.type(assigned).shape == Shape{16});
      CHECK(after.at(assigned).op != OpCode::kAllGather);  // computed in place, not gathered from shards
    }
    // Numbers: sharded and replicated steps agree, running statistics included.
    const runtime::TensorMap init = runtime::InitLogicalState(before);
    auto a = runtime::MakeInterpreterExecutor(before, init), b = runtime::MakeInterpreterExecutor(after, init);
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> d(-1, 1);
    for (int step = 0; step < 3; ++step) {
      runtime::TensorMap in;
      std::vector<float> xs(48);
      for (float& v : xs) v = d(rng);
      std::vector<int32_t> ys(8);
      for (int i = 0; i < 8; ++i) ys[i] = (i * 7 + step) % 3;
      in["x"] = runtime::Tensor::F32({8, 6}, xs);
      in["y"] = runtime::Tensor::S32({8}, ys);
      const float la = a->Step(in).at("loss").f32[0], lb = b->Step(in).at("loss").f32[0];
      CHECK(la == Approx(lb).epsilon(1e-6));
    }
    const runtime::TensorMap sa = a->LogicalState(), sb = b->LogicalState();
    for (const char* name : {"bn.running_mean", "bn.running_var", "bn.gamma", "fc1.w"}) {
      double worst = 0;
      for (int64_t i = 0; i < sa.at(name).elements(); ++i)
        worst = std::max<double>(worst, std::abs(sa.at(name).at(i) - sb.at(name).at(i)));
      INFO(name << " worst difference " << worst);
      CHECK(worst <= 1e-6);
    }
    double moved = 0;
    for (float v : sa.at("bn.running_mean").f32) moved += std::abs(v);
    CHECK(moved > 0);
  }
}

TEST_CASE("with the nonfinite guard and batch norm, no whole gradient is all-reduced beside its reduce-scatter",
          "[weight-update-sharder][model-state][guard]") {
  // The guard's step_finite flag gates every assignment, the model state's (running statistics, outside the
  // update region) too. Those must read the flag the sharded program computes (partial sums + a scalar
  // all-reduce); read the original one and the whole all-reduced gradients it sums stay alive (found by
  // the pod simulator: 25 full all-reduces next to the reduce-scatters in resnet50).
  constexpr int kReplicas = 4;
  dsl::Model m("bn_guard", 2);
  auto x = m.input("x", dsl::f32({8, 6}));
  auto y = m.input("y", dsl::s32({8}));
  auto h = x.dense(16, "fc1").batch_norm("bn").relu();
  m.train(h.dense(3, "fc2").cross_entropy(y).mean());
  Module before = m.lower(kReplicas, dsl::Mode::kTrain);
  Autodiff("loss").Run(before);
  DataParallelLowering().Run(before);
  OptimizerLowering(OptimizerConfig().kind(OptimizerKind::kAdam).lr(1e-2)).Run(before);
  REQUIRE(NonfiniteGuard().Run(before));
  Verify(before);
  Module after = before;
  REQUIRE(WeightUpdateSharder(ShardingOptions{kReplicas}).Run(after));
  Verify(after);
  int whole_gradients = 0, reduce_scatters = 0;
  for (const Instr& in : after.instrs) {
    whole_gradients += in.op == OpCode::kAllReduce && in.type.shape.size() == 2;  // fc1.w [6,16], fc2.w [16,3]
    reduce_scatters += in.op == OpCode::kReduceScatter;
  }
  INFO(Print(after));
  CHECK(reduce_scatters > 0);
  CHECK(whole_gradients == 0);
  // The same numbers, step_finite and the running statistics included; a non-finite batch is skipped by both.
  const runtime::TensorMap init = runtime::InitLogicalState(before);
  auto a = runtime::MakeInterpreterExecutor(before, init), b = runtime::MakeInterpreterExecutor(after, init);
  for (int step = 0; step < 3; ++step) {
    std::vector<float> xs(48);
    for (int i = 0; i < 48; ++i) xs[i] = std::sin(0.7f * static_cast<float>(i + 13 * step));
    if (step == 1) xs[5] = std::numeric_limits<float>::infinity();
    std::vector<int32_t> ys(8);
    for (int i = 0; i < 8; ++i) ys[i] = (i * 7 + step) % 3;
    const runtime::TensorMap in{{"x", runtime::Tensor::F32({8, 6}, xs)}, {"y", runtime::Tensor::S32({8}, ys)}};
    const runtime::TensorMap oa = a->Step(in), ob = b->Step(in);
    INFO("step " << step);
    CHECK(oa.at(kStepFiniteOutput).f32[0] == (step == 1 ? 0.0f : 1.0f));
    CHECK(ob.at(kStepFiniteOutput).f32[0] == oa.at(kStepFiniteOutput).f32[0]);
  }
  const runtime::TensorMap sa = a->LogicalState(), sb = b->LogicalState();
  for (const char* name : {"bn.running_mean", "bn.running_var", "bn.gamma", "fc1.w"}) {
    double worst = 0;
    for (int64_t i = 0; i < sa.at(name).elements(); ++i)
      worst = std::max<double>(worst, std::abs(sa.at(name).at(i) - sb.at(name).at(i)));
    INFO(name << " worst difference " << worst);
    CHECK(worst <= 1e-6);
  }
}

// ---- ShardOrderReductions: the replicated update computes its full reductions in the sharded order ----

struct Ordered {
  Module before, ordered, sharded;
  std::string text;  // Print(ordered)
  bool changed = false;
  std::vector<std::string> reductions, sharded_reductions;
};

Ordered RunOrdered(const std::string& text, ShardingOptions o = {}) {
  Ordered r;
  r.before = ParseVerified(text);
  r.ordered = r.sharded = r.before;
  ShardOrderReductions pass(o);
  r.changed = pass.Run(r.ordered);
  Verify(r.ordered);
  r.text = Print(r.ordered);
  CHECK(Parse(r.text) == r.ordered);
  r.reductions = pass.reductions();
  WeightUpdateSharder sharder(o);
  sharder.Run(r.sharded);
  r.sharded_reductions = sharder.report().reductions;
  return r;
}

// "%38 reduce_sum(f32[4,2])": which reduction a report line is about.
std::vector<std::string> ReductionNames(const std::vector<std::string>& lines) {
  std::vector<std::string> names;
  for (const std::string& l : lines) names.push_back(l.substr(0, l.find(':')));
  return names;
}

TEST_CASE("shard-order-reductions: LAMB's norms as N shard-shaped partial sums added in replica order, "
          "no communication", "[shard-order-reductions][lamb]") {
  Ordered r = RunOrdered(kLamb);
  INFO(r.text);
  CHECK(r.changed);
  // Nothing is sharded and nothing is communicated: the two gradient all-reduces stay, the state stays whole.
  CHECK(Count(r.text, "all_reduce(") == 2);
  CHECK(Count(r.text, "reduce_scatter(") + Count(r.text, "all_gather(") + Count(r.text, "replica_id") == 0);
  CHECK(Count(r.text, "shard_format") == 0);
  // w1 [4,2] (dim0 at N=2): rows [0,2) and [2,4), each summed as the sharded program sums its [2,2] shard, then
  // p0 + p1. w2 [3] (flat, one padding element): zero-padded to [4], halves [0,2) and [2,4), each over axis 0.
  CHECK(FileCheck(r.text, R"C(
    CHECK: [[W1:%\d+]] = variable @w1 {role="weight"} : f32[4,2]
    CHECK: [[SQ:%\d+]] = mul([[W1]], [[W1]]) : f32[4,2]
    CHECK: [[A:%\d+]] = slice([[SQ]]) {limit=[2,2], start=[0,0]} : f32[2,2]
    CHECK-NEXT: [[PA:%\d+]] = reduce_sum([[A]]) {axes=[0,1]} : f32[]
    CHECK-NEXT: [[B:%\d+]] = slice([[SQ]]) {limit=[4,2], start=[2,0]} : f32[2,2]
    CHECK-NEXT: [[PB:%\d+]] = reduce_sum([[B]]) {axes=[0,1]} : f32[]
    CHECK-NEXT: [[T:%\d+]] = add([[PA]], [[PB]]) : f32[]
    CHECK-NEXT: sqrt([[T]]) : f32[]
  )C") == "");
  CHECK(FileCheck(r.text, R"C(
    CHECK: [[W2:%\d+]] = variable @w2 {role="weight"} : f32[3]
    CHECK: [[SQ:%\d+]] = mul([[W2]], [[W2]]) : f32[3]
    CHECK: [[PAD:%\d+]] = pad([[SQ]]) {high=[1], low=[0]} : f32[4]
    CHECK-NEXT: [[A:%\d+]] = slice([[PAD]]) {limit=[2], start=[0]} : f32[2]
    CHECK-NEXT: [[PA:%\d+]] = reduce_sum([[A]]) {axes=[0]} : f32[]
    CHECK-NEXT: [[B:%\d+]] = slice([[PAD]]) {limit=[4], start=[2]} : f32[2]
    CHECK-NEXT: [[PB:%\d+]] = reduce_sum([[B]]) {axes=[0]} : f32[]
    CHECK-NEXT: add([[PA]], [[PB]]) : f32[]
  )C") == "");
  // No whole-tensor reduction is left: every reduce_sum reads a shard-shaped value, as in the sharded program.
  for (const Instr& in : r.ordered.instrs)
    if (in.op == OpCode::kReduceSum) CHECK((r.ordered.type(in.operands[0]).shape == Shape{2, 2} ||
                                             r.ordered.type(in.operands[0]).shape == Shape{2}));
  // The same four norms as the sharder partitions, reported as such.
  REQUIRE(r.reductions.size() == 4);
  CHECK(ReductionNames(r.reductions) == ReductionNames(r.sharded_reductions));
  CHECK_THAT(r.reductions[0], Catch::StartsWith("%38 reduce_sum(f32[4,2]): 2 partial sums of [2,2] shards"));
  CHECK_THAT(r.sharded_reductions[0], Catch::StartsWith("%38 reduce_sum(f32[4,2]): partial sum of each [2,2] shard"));
  CHECK_THAT(r.reductions[3], Catch::Contains("reduce_sum(f32[3]): 2 partial sums of [2] shards (zero-padded)"));
  // The point: sharding on or off now gives the same bits; the whole-tensor sums did not (the module is
  // unchanged otherwise, so it still trains as before up to rounding).
  EXPECT_SAME_TRAINING(r.ordered, r.sharded, /*tol=*/0);
  int differ = 0;
  for (unsigned seed = 1; seed <= 20; ++seed)
    differ += ::shardstep::ir::testing::TrainingDifference(r.before, r.sharded, 0, 0, 10, seed) != "";
  WARN("whole-tensor norms differ bitwise from the sharded ones for " << differ << " of 20 seeds");
  CHECK(differ > 0);
  EXPECT_SAME_TRAINING(r.ordered, r.before, /*tol=*/1e-6);
}

TEST_CASE("shard-order-reductions: bitwise equal to the sharded update for clipping, padding (sum, max, mean) and "
          "replica groups", "[shard-order-reductions]") {
  struct Case {
    const char* name;
    const char* text;
    int group_size;
    size_t reductions;
  };
  for (const Case& c : {Case{"clip", kClip, 0, 3}, Case{"padded", kPadded, 0, 3}, Case{"groups", kGroups, 4, 3},
                        Case{"lamb", kLamb, 0, 4}}) {
    INFO(c.name);
    ShardingOptions o;
    o.group_size = c.group_size;
    Ordered r = RunOrdered(c.text, o);
    INFO(r.text);
    CHECK(r.changed);
    CHECK(r.reductions.size() == c.reductions);
    CHECK(ReductionNames(r.reductions) == ReductionNames(r.sharded_reductions));
    for (int seed : {7, 8, 9}) {
      INFO("seed " << seed);
      CHECK(::shardstep::ir::testing::TrainingDifference(r.ordered, r.sharded, 0, c.group_size, 3, seed) == "");
    }
  }
  SECTION("padded max: the padding is -inf, as the sharded mask makes it") {
    Ordered r = RunOrdered(kPadded);
    INFO(r.text);
    CHECK(FileCheck(r.text, R"C(
      CHECK: [[ONES:%\d+]] = constant {value=1.0} : f32[15]
      CHECK-NEXT: [[OPAD:%\d+]] = pad([[ONES]]) {high=[1], low=[0]} : f32[16]
      CHECK: [[M:%\d+]] = slice([[OPAD]]) {limit=[16], start=[8]} : f32[8]
      CHECK: select([[M]], {{%\d+}}, {{%\d+}}) : f32[8]
      CHECK: [[PM:%\d+]] = reduce_max({{%\d+}}) {axes=[0]} : f32[]
      CHECK-NEXT: max([[PM]], {{%\d+}}) : f32[]
    )C") == "");
    // The mean: the sum of the two halves' sums, then divided by the 15 real elements.
    int means = 0;
    for (const Instr& in : r.ordered.instrs) {
      if (in.op != OpCode::kDiv || !in.type.shape.empty()) continue;
      const Instr& sum = r.ordered.at(in.operands[0]);
      const Instr& count = r.ordered.at(in.operands[1]);
      if (count.op != OpCode::kConstant || count.GetFloat("value") != 15.0) continue;
      ++means;
      REQUIRE(sum.op == OpCode::kAdd);
      for (ValueId half : sum.operands) {
        CHECK(r.ordered.at(half).op == OpCode::kReduceSum);
        CHECK(r.ordered.type(r.ordered.at(half).operands[0]).shape == Shape{8});
      }
    }
    CHECK(means == 1);
  }
  SECTION("mixed replica groups: w1's norm in its own groups of 2") {
    Ordered r = RunOrdered(kMixedGroups);
    INFO(r.text);
    REQUIRE(r.reductions.size() == 1);
    CHECK_THAT(r.reductions[0], Catch::Contains("2 partial sums of [2,2] shards"));
    CHECK(MixedGroupsDifference(r.ordered, r.sharded, /*tol=*/0) == "");
  }
}

TEST_CASE("shard-order-reductions: no change where the sharder would not shard", "[shard-order-reductions][noop]") {
  auto unchanged = [](const std::string& text, ShardingOptions o = {}) {
    Module m = ParseVerified(text);
    const std::string before = Print(m);
    ShardOrderReductions pass(o);
    CHECK_FALSE(pass.Run(m));
    CHECK(Print(m) == before);
    CHECK(pass.reductions().empty());
  };
  SECTION("no reduction in the update") { unchanged(kMomentum); }
  SECTION("replicas=1") {
    std::string text = kLamb;
    text.replace(text.find("replicas=2"), 10, "replicas=1");
    unchanged(text);
  }
  SECTION("group_size=1") {
    ShardingOptions o;
    o.group_size = 1;
    unchanged(kLamb, o);
  }
  SECTION("a module the sharder refuses (non-contiguous groups) trains replicated as it is, no error") {
    std::string text = kGroups;
    for (size_t p; (p = text.find("groups=[[0,1,2,3],[4,5,6,7]]")) != std::string::npos;)
      text.replace(p, std::string("groups=[[0,1,2,3],[4,5,6,7]]").size(), "groups=[[0,2,4,6],[1,3,5,7]]");
    REQUIRE_THROWS(WeightUpdateSharder().Run(*std::make_unique<Module>(ParseVerified(text))));
    unchanged(text);
  }
  SECTION("an already-sharded module") {
    Module m = ParseVerified(kLamb);
    REQUIRE(WeightUpdateSharder().Run(m));
    unchanged(Print(m));
  }
}

TEST_CASE("the training pipeline runs weight-update-sharder or shard-order-reductions", "[shard-order-reductions]") {
  auto has = [](const std::vector<std::string>& v, const std::string& s) {
    return std::find(v.begin(), v.end(), s) != v.end();
  };
  PipelineOptions o;
  o.replicas = 2;
  CHECK(has(KnownPassNames(), "shard-order-reductions"));
  CHECK(MakePass("shard-order-reductions", o)->name() == "shard-order-reductions");
  CHECK(has(BuildPipeline({"all"}, o).Names(), "weight-update-sharder"));
  CHECK_FALSE(has(BuildPipeline({"all"}, o).Names(), "shard-order-reductions"));
  o.shard_weight_update = false;
  CHECK_FALSE(has(BuildPipeline({"all"}, o).Names(), "weight-update-sharder"));
  CHECK(has(BuildPipeline({"all"}, o).Names(), "shard-order-reductions"));
  // BuildTrainingPipeline on a LAMB step: exactly one of the two runs, and each rewrites both norms of each weight.
  for (bool shard : {true, false}) {
    INFO("shard_weight_update " << shard);
    dsl::Model dm("tiny", 2);
    auto x = dm.input("x", dsl::f32({8, 6}));
    auto y = dm.input("y", dsl::s32({8}));
    dm.train(x.dense(5, "fc1").relu().dense(3, "fc2").cross_entropy(y).mean());
    Module m = dm.lower(2, dsl::Mode::kTrain);
    o.shard_weight_update = shard;
    o.optimizer = OptimizerConfig().kind(OptimizerKind::kLamb).lr(1e-2);
    std::vector<std::string> ran;
    size_t reductions = 0;
    BuildTrainingPipeline(o)
        .OnPass([&](const Pass& p, const Module&) {
          ran.push_back(p.name());
          if (auto* s = dynamic_cast<const WeightUpdateSharder*>(&p)) reductions = s->report().reductions.size();
          if (auto* s = dynamic_cast<const ShardOrderReductions*>(&p)) reductions = s->reductions().size();
        })
        .Run(m);
    CHECK(has(ran, "weight-update-sharder") == shard);
    CHECK(has(ran, "shard-order-reductions") == !shard);
    CHECK(reductions == 4);  // ||w|| and ||r|| of fc1.w and fc2.w (biases: no layer adaptation)
  }
}

}  // namespace
}  // namespace shardstep::ir
