// The attention and attention_grad ops on the CPU (ir/ops.def): blockwise over groups of heads, so a
// group's T x T scores, probabilities and their gradients stay in cache instead of being written to
// memory and read back by the next pass (the decomposed form's softmax loops and products read and wrote
// eight [B, H, T, T] tensors a layer). The products are oneDNN batched matmuls (f32, or bf16 x bf16 ->
// f32 when the op's bf16 attribute is set), the softmax plain loops compiled for AVX-512 where the CPU
// has it; the values are the reference interpreter's definition (runtime/interpreter.cc Attention) up to
// the order of the products' sums and the exp (within 1 ulp of libm, jit/vector_math.cc's algorithm).
#pragma once

#include <array>
#include <cstdint>

namespace shardstep::jit {

struct AttentionShape {
  int64_t heads = 0;  // the leading elements: independent [t, d] blocks of q, k, v
  int64_t t = 0, d = 0;
  float scale = 1;
  bool causal = false;
  bool bf16 = false;  // products on bf16 operands: q, k, v, dout rounded (bf16 values: exact), p and ds rounded
  std::array<bool, 4> stored_bf16{};  // q, k, v, dout stored as bf16 (uint16_t), else f32
  // The layout of q, k, v and dout (heads_in) and of the outputs (heads_out): 0, each head's [t, d] block
  // dense ([heads, t, d]); H > 0, the model's [heads / H, t, H, d] from before its split into heads. The
  // transposes around the op are then read and written in place (jit/step_rewrites.h
  // AttentionHeadsInPlace): each task gathers its heads' rows into its dense scratch (the products
  // want dense blocks: oneDNN runs strided ones on a slower kernel) and scatters its results.
  int64_t heads_in = 0, heads_out = 0;
  bool bf16_out = false;  // the forward's output stored rounded to bf16 (uint16_t), as runtime::F32ToBf16
};

// The softmax statistics of each query, [heads, t] floats each: the max of its scaled scores and the
// reciprocal of its exp-sum. AttentionForward writes them when given; AttentionBackward, given the
// forward's (the same q, k and shape), recomputes the probabilities from them in one pass instead of
// three (the same bits: the same operations on each element, on the same scores).
struct AttentionStats {
  float* max = nullptr;
  float* inv_sum = nullptr;
};

// out [heads, t, d] = softmax(scale q k^T (causal: -inf above the diagonal)) v, per head (f32, or bf16
// with bf16_out); `stats` (optional): written.
void AttentionForward(const AttentionShape& s, const void* q, const void* k, const void* v, void* out,
                      const AttentionStats* stats = nullptr);

// What AttentionBackward may write besides (or instead of) its f32 result, per part (dq, dk, dv), while
// the part's block of a group of heads is still in cache (jit/compiled_step.cc PlanAttentionGradParts):
// the part rounded to bf16 in the result's layout (the next products' operand), and its column sums over
// all B * T rows of H * d features (the projection's bias gradient), in the order of the JIT's Reduce
// for rows summed in blocks of `block_rows` (each column down the rows of a block in row order, in f64,
// the blocks added in order): the bits of the reduce_sum it replaces. Needs AttentionGradPartsFit.
struct AttentionGradParts {
  std::array<uint16_t*, 3> bf16{};  // null: not wanted
  std::array<float*, 3> sums{};     // null: not wanted; else H * d floats
  bool f32 = true;                  // write the f32 result too (something else reads it)
  int64_t block_rows = 0;           // rows per block of the sums
};
// Whether AttentionBackward can write the sums: the result in the heads-inner layout (heads_out = H), and
// whole batch elements per block of rows, whose heads are whole groups of heads (its tasks).
bool AttentionGradPartsFit(const AttentionShape& s, int64_t block_rows);

// out [3, heads, t, d] = dq, dk, dv of AttentionForward's output for its gradient dout (the
// probabilities recomputed from q and k, with the forward's `stats` when given); `parts` (optional):
// see AttentionGradParts.
void AttentionBackward(const AttentionShape& s, const void* q, const void* k, const void* v, const void* dout,
                       float* out, const AttentionGradParts* parts = nullptr, const AttentionStats* stats = nullptr);

// With bf16, p^T and ds^T are rounded to bf16 as the softmax loops write them; on (tests only), by a
// separate pass over each instead, the form before: both must give the same bits.
void SeparateRoundingForTesting(bool on);
// On (tests only): the softmax loops' generic form, one query at a time, instead of the AVX-512 or AVX2
// vectors of queries: both must give the same bits.
void GenericSoftmaxForTesting(bool on);

}  // namespace shardstep::jit
