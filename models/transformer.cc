// transformer_lm and bert in the DSL; names as the contract pins them (parity tests read them).
#include "models/transformer.h"

#include <cmath>
#include <string>

#include "ir/error.h"

namespace shardstep::models {
namespace {

using dsl::Lowering;
using ir::Builder;
using ir::DType;
using ir::ValueId;

constexpr double kEmbeddingStddev = 0.02;  // GPT-2 / BERT initialiser of the embedding tables

void CheckPositive(int64_t v, const char* option) {
  if (v < 1) throw Error(Str("--", option, " ", v, " must be at least 1"));
}

void CheckCommon(const TransformerConfig& c) {
  CheckPositive(c.context, "context");
  CheckPositive(c.layers, "layers");
  CheckPositive(c.width, "width");
  CheckPositive(c.heads, "heads");
  CheckPositive(c.mlp_width, "mlp-width");
  if (c.width % c.heads != 0) throw Error(Str("--heads ", c.heads, " does not divide --width ", c.width));
  if (c.context > c.positions)
    throw Error(Str("--context ", c.context, " is longer than the position table (", c.positions, ")"));
}

int64_t Or(int64_t v, int64_t fallback) { return v != 0 ? v : fallback; }

// A [V, D] table weight initialised N(0, 0.02).
dsl::Tensor Table(dsl::Model& m, const std::string& name, int64_t rows, int64_t dim) {
  return m.weight(name, dsl::f32({rows, dim}), "normal", {{"stddev", kEmbeddingStddev}});
}

// table [V, D] rows at ids [B, T] -> [B, T, D] (gradient: scatter-add into the table).
dsl::Tensor Gather(dsl::Model& m, const dsl::Tensor& table, const dsl::Tensor& ids, const std::string& what) {
  return m.Record(Str("gather '", what, "'"), dsl::Loc::current(), [table, ids](Lowering& L) {
    return L.b->Emit(ir::OpCode::kGather, {L[table], L[ids]});
  });
}

// [T, T] f32: -1e9 where s > t (a future position), else 0. -1e9 rather than -inf keeps a fully masked
// row finite and matches the pinned reference.
dsl::Tensor CausalMask(dsl::Model& m, int64_t t) {
  return m.Record("causal mask", dsl::Loc::current(), [t](Lowering& L) {
    Builder& b = *L.b;
    const ir::TensorType type{DType::kS32, {t, t}};
    ValueId future = b.Binary(ir::OpCode::kGt, b.Iota(type, 1), b.Iota(type, 0));
    ValueId zero = b.Constant(0.0, {DType::kF32, {t, t}});
    return b.Select(future, b.ScalarLike(-1e9, zero), zero);
  });
}

// Multi-head self-attention on x [B, T, D]: name.q/k/v/o dense(D) with bias; scores q k^T / sqrt(Dh)
// per head (+ mask when given), softmax over the keys, dropout on the probabilities; without dropout,
// one attention op (causal: the causal mask as its attribute, `mask` unused).
dsl::Tensor SelfAttention(const dsl::Tensor& x, const std::string& name, const TransformerConfig& c, int64_t batch,
                          double p, const dsl::Tensor& mask, bool causal) {
  const int64_t t = c.context, d = c.width, h = c.heads, dh = d / h;
  auto heads = [&](const dsl::Tensor& y) { return y.reshape_full({batch, t, h, dh}).transpose({0, 2, 1, 3}); };
  dsl::Tensor q = heads(x.dense(d, name + ".q"));
  dsl::Tensor k = heads(x.dense(d, name + ".k"));
  dsl::Tensor v = heads(x.dense(d, name + ".v"));
  const double scale = 1.0 / std::sqrt(static_cast<double>(dh));
  dsl::Tensor heads_out;  // [B, H, T, Dh]
  if (p == 0.0 && (causal || !mask.defined())) {
    heads_out = dsl::attention(q, k, v, scale, causal);  // one op: the same values, no T x T tensors in memory
  } else {
    dsl::Tensor scores = q.matmul(k, false, true) * scale;  // [B, H, T, T]
    if (mask.defined()) scores = scores + mask;
    heads_out = scores.softmax(-1).dropout(p).matmul(v);
  }
  dsl::Tensor out = heads_out.transpose({0, 2, 1, 3}).reshape_full({batch, t, d});  // [B, T, D]
  return out.dense(d, name + ".o");
}

}  // namespace

TransformerConfig TransformerLmConfig(const ModelOptions& o) {
  if (!o.size.empty()) throw Error(Str("--size ", o.size, " is for bert; transformer_lm takes --layers, --width, ..."));
  TransformerConfig c;
  c.context = Or(o.context, 128);
  c.layers = Or(o.layers, 4);
  c.width = Or(o.width, 256);
  c.heads = Or(o.heads, 4);
  c.mlp_width = Or(o.mlp_width, 4 * c.width);
  c.vocab = o.vocab;
  c.positions = c.context;  // the table is as long as the context
  if (c.vocab == 0) throw Error("--vocab must be set (from the data)");
  CheckPositive(c.vocab, "vocab");
  CheckCommon(c);
  return c;
}

TransformerConfig BertConfig(const ModelOptions& o) {
  TransformerConfig c;
  const std::string size = o.size.empty() ? "small" : o.size;
  if (size == "small") {
    c = {128, 4, 256, 4, 0, 0, 512};
  } else if (size == "base") {
    c = {128, 12, 768, 12, 0, 30522, 512};
  } else if (size == "large") {
    c = {128, 24, 1024, 16, 0, 30522, 512};
  } else {
    throw Error(Str("--size ", o.size, " is not one of small, base, large"));
  }
  c.context = Or(o.context, c.context);
  c.layers = Or(o.layers, c.layers);
  c.width = Or(o.width, c.width);
  c.heads = Or(o.heads, c.heads);
  c.mlp_width = Or(o.mlp_width, 4 * c.width);
  c.vocab = Or(o.vocab, c.vocab);
  if (c.vocab == 0) throw Error("--vocab must be set (from the data)");
  CheckPositive(c.vocab, "vocab");
  CheckCommon(c);
  return c;
}

dsl::Tensor DefineTransformerLm(dsl::Model& m, const ModelOptions& o) {
  const TransformerConfig c = TransformerLmConfig(o);
  const double p = o.dropout;
  auto tokens = m.input("tokens", dsl::s32({o.batch, c.context}));
  auto targets = m.input("targets", dsl::s32({o.batch, c.context}));
  dsl::Tensor tok_emb = Table(m, "tok_emb.w", c.vocab, c.width);
  dsl::Tensor pos_emb = Table(m, "pos_emb.w", c.positions, c.width);
  dsl::Tensor x = (Gather(m, tok_emb, tokens, "tok_emb") + pos_emb.slice(0, 0, c.context)).dropout(p);
  const dsl::Tensor mask = CausalMask(m, c.context);
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string n = "h" + std::to_string(i);
    dsl::Tensor a = x + SelfAttention(x.layer_norm(n + ".ln1"), n, c, o.batch, p, mask, true).dropout(p);
    dsl::Tensor mlp = a.layer_norm(n + ".ln2").dense(c.mlp_width, n + ".fc1").gelu().dense(c.width, n + ".fc2");
    x = a + mlp.dropout(p);
  }
  dsl::Tensor logits = x.layer_norm("ln_f").matmul(tok_emb, false, true);  // tied: x @ tok_emb.w^T
  m.output("logits", logits);
  dsl::CrossEntropyOptions ce;
  ce.label_smoothing = o.label_smoothing;
  return logits.cross_entropy_mean(targets, ce);
}

dsl::Tensor DefineBert(dsl::Model& m, const ModelOptions& o) {
  const TransformerConfig c = BertConfig(o);
  constexpr double kEps = 1e-12;  // BERT's layer-norm epsilon
  constexpr int64_t kTokenTypes = 2;
  const double p = o.dropout;
  auto tokens = m.input("tokens", dsl::s32({o.batch, c.context}));
  auto segments = m.input("segments", dsl::s32({o.batch, c.context}));
  auto targets = m.input("targets", dsl::s32({o.batch, c.context}));
  auto weights = m.input("mask_weights", dsl::f32({o.batch, c.context}));
  auto next_sentence = m.input("next_sentence", dsl::s32({o.batch}));
  dsl::Tensor tok_emb = Table(m, "tok_emb.w", c.vocab, c.width);
  dsl::Tensor pos_emb = Table(m, "pos_emb.w", c.positions, c.width);
  dsl::Tensor type_emb = Table(m, "type_emb.w", kTokenTypes, c.width);
  dsl::Tensor x = Gather(m, tok_emb, tokens, "tok_emb") + pos_emb.slice(0, 0, c.context) +
                  Gather(m, type_emb, segments, "type_emb");
  x = x.layer_norm("emb_ln", kEps).dropout(p);
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string n = "h" + std::to_string(i);
    dsl::Tensor a = (x + SelfAttention(x, n, c, o.batch, p, dsl::Tensor(), false).dropout(p)).layer_norm(n + ".ln1", kEps);
    dsl::Tensor mlp = a.dense(c.mlp_width, n + ".fc1").gelu().dense(c.width, n + ".fc2");
    x = (a + mlp.dropout(p)).layer_norm(n + ".ln2", kEps);
  }
  // Masked-LM head.
  dsl::Tensor h = x.dense(c.width, "mlm.dense").gelu().layer_norm("mlm.ln", kEps);
  dsl::Tensor bias = m.weight("mlm.bias", dsl::f32({c.vocab}), "zeros", {}, dsl::WeightOptions::NoDecay());
  dsl::Tensor logits = h.matmul(tok_emb, false, true) + bias;  // decoder tied to the token embedding
  m.output("logits", logits);
  // Pooler (tanh dense on the [CLS] position) and the next-sentence classifier, as the released
  // pre-training checkpoints have them (no dropout between them, as BertForPreTraining).
  dsl::Tensor pooled = x.slice(1, 0, 1).reshape({c.width}).dense(c.width, "pooler").tanh();
  dsl::Tensor nsp_logits = pooled.dense(2, "nsp");
  m.output("nsp_logits", nsp_logits);
  dsl::CrossEntropyOptions ce;
  ce.label_smoothing = o.label_smoothing;
  return logits.cross_entropy_mean(targets, ce, weights) + nsp_logits.cross_entropy_mean(next_sentence);
}

}  // namespace shardstep::models
