// Transformers on text: transformer_lm (GPT-style, pre-LN, causal; task kLanguageModel) and bert (post-LN
// encoder with a masked-LM head; task kMaskedLm). Names and layouts as the contract pins them.
#pragma once

#include <cstdint>

#include "dsl/dsl.h"
#include "models/models.h"

namespace shardstep::models {

// transformer_lm: inputs "tokens", "targets" s32 [B, T]; output "logits" [B, T, vocab]; loss = mean
// cross-entropy over all B*T positions (label smoothing o.label_smoothing). x = tok_emb.w[tokens] +
// pos_emb.w[0:T] -> dropout; blocks h{i}: a = x + dropout(attn(ln1(x))), x = a + dropout(mlp(ln2(a)));
// causal attention (-1e9 added where s > t), dropout on the probabilities; GELU (tanh) MLP; ln_f; logits
// tied to tok_emb.w. Defaults: context 128, 4 layers, width 256, 4 heads, mlp_width 4 * width; dropout
// o.dropout; vocab o.vocab (required).
dsl::Tensor DefineTransformerLm(dsl::Model& m, const ModelOptions& o);

// bert (the pre-training architecture of Devlin et al. 2019): inputs "tokens", "segments" (token types
// 0/1), "targets" s32 [B, T], "mask_weights" f32 [B, T], "next_sentence" s32 [B] (1 = segment B follows
// segment A); outputs "logits" [B, T, vocab], "nsp_logits" [B, 2]; loss = the global-batch mean of the
// masked-LM cross-entropy over the positions weighted by mask_weights + the global-batch mean
// next-sentence cross-entropy. Post-LN encoder: tok_emb.w[tokens] + pos_emb.w[0:T] +
// type_emb.w[segments] -> emb_ln -> dropout; blocks h{i}: a = ln1(x + dropout(attn(x))),
// x = ln2(a + dropout(fc2(gelu(fc1(a))))) (no causal mask; examples are full, so no padding mask);
// masked-LM head: mlm.dense (D) -> GELU -> mlm.ln, decoder tied to tok_emb.w plus the output bias
// mlm.bias [vocab]; pooler: tanh(pooler (D) of x[:, 0]) (the [CLS] position); next-sentence
// classifier nsp (2) on it. Layer norms eps 1e-12 as BERT. Parameters as BertForPreTraining:
// base 110,106,428, large 336,226,108.
// Sizes (o.size): small (default; L4 D256 H4, vocab o.vocab), base (L12 D768 H12, vocab 30522),
// large (L24 D1024 H16, vocab 30522); position table 512, 2 token types, MLP 4D, context 128 by
// default. Non-zero o.layers/width/heads/mlp_width/context/vocab override the size's values.
dsl::Tensor DefineBert(dsl::Model& m, const ModelOptions& o);

// The resolved sizes of a transformer (for reports and tests).
struct TransformerConfig {
  int64_t context, layers, width, heads, mlp_width, vocab, positions;
};
// Throws shardstep::Error naming the offending option (as the CLI spells it).
TransformerConfig TransformerLmConfig(const ModelOptions& o);
TransformerConfig BertConfig(const ModelOptions& o);

}  // namespace shardstep::models
