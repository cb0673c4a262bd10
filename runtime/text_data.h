// Text corpora for the sequence models: the King James Bible (Debian's bible-kjv) or a user's plain text
// file, split into training text and held-out WHOLE books, as a character-level language-model source
// (transformer_lm) and a word-level masked-LM source (bert), behind runtime/batch_source.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/batch_source.h"

namespace shardstep::runtime {

struct TextDataOptions {
  std::string file;          // plain text corpus; "" = the King James Bible from Debian's bible-kjv
                             // (`bible -f 'gen1:1-rev22:21'`, cached as a plain file), error naming the
                             // package when it is missing
  int64_t context = 128;     // T
  int64_t batch = 64;        // global training batch
  int64_t eval_batch = 64;
  uint64_t seed = 0;
  bool shuffle = true;
  int64_t vocab_size = 0;    // masked LM: word vocabulary size incl. special tokens (0 = default; CLI --vocab)
  int64_t max_eval_batches = 0;  // 0 = the whole held-out split
};

struct TextData {
  std::unique_ptr<BatchSource> train;
  std::unique_ptr<EvalSet> eval;  // held-out whole books
  int64_t vocab = 0;              // what ModelOptions::vocab must be
};

// Character LM (task kLanguageModel): "tokens", "targets" s32 [B, T], targets[t] = the character after
// tokens[t]. The vocabulary is the sorted distinct bytes of the whole corpus (training and held-out
// text), so it depends only on the corpus. Training examples are the non-overlapping windows
// text[k*T, k*T + T + 1) of the training text; each epoch visits them in the order of a Fisher-Yates
// shuffle driven by splitmix64(seed + epoch) (file order without shuffle); the incomplete last batch
// of an epoch is dropped. Evaluation: the consecutive windows of the held-out text, in order.
TextData MakeCharLmData(const TextDataOptions& o);

// Masked LM with next-sentence pairs (task kMaskedLm, bert's pre-training data): "tokens" s32 [B, T]
// (masked), "segments" s32 [B, T] (token types), "targets" s32 [B, T] (the original tokens),
// "mask_weights" f32 [B, T] (1 where a token is to be predicted), "next_sentence" s32 [B]. The word
// vocabulary (WordTokenizer) is built from the training text. The training text's token stream
// (verses back to back) is cut into chunks of W = T - 3 words, one example each: [CLS] A [SEP] B [SEP]
// with A the start of the chunk (a random length in [W/4, W - W/4]) and B, with probability 0.5, the
// rest of the chunk, the words that follow A (next_sentence 1), else as many words from a random other
// place of the same split (0). Segments are 0 for [CLS] A [SEP], 1 for B [SEP]; there is no padding.
// Of each example's W word positions ([CLS] and [SEP] never), each is selected with probability 0.15
// (at least one per example); a selected token becomes [MASK] with probability 0.8, a random word with
// 0.1 and stays with 0.1. The choices depend only on (seed, epoch, example index), so Seek and any
// batch split give the same examples; evaluation examples (the held-out books) are drawn the same way
// with a fixed key, identical at every evaluation. Example order and Seek as for the character LM.
TextData MakeMaskedLmData(const TextDataOptions& o);

// ---- The pieces, for tests and tools. ----

inline constexpr const char* kBibleKjvPackage = "bible-kjv";

// One document of a corpus: a Bible book ("Ge", "Exo", ... as `bible` abbreviates them) or a part of a
// user file. Text is lines ending in '\n' (one verse per line for the Bible).
struct TextDocument {
  std::string name;
  std::string text;
};

struct TextCorpus {
  std::string name;                     // "kjv" or the file's path
  std::vector<TextDocument> documents;  // in corpus order
  std::vector<bool> held_out;           // per document
  std::string TrainText() const;        // the training documents concatenated, in order
  std::string HeldOutText() const;
  std::vector<std::string> HeldOutNames() const;
};

// The books held out of training for validation: whole books from both testaments, 6.5% of the
// characters (Ruth, Ecclesiastes, Lamentations, Jonah, Mark, 1 Corinthians, James, Revelation):
// 268,341 of 4,137,850 characters (6.5%).
const std::vector<std::string>& KjvHeldOutBooks();

// Splits `bible -f` output ("Ge1:1 In the beginning ...", one verse per line) into its 66 books with the
// references stripped. Throws shardstep::Error naming the first malformed line.
std::vector<TextDocument> ParseBibleOutput(const std::string& raw);

// $XDG_CACHE_HOME/shardstep/kjv.txt, else $HOME/.cache/shardstep/kjv.txt ("" when neither is set).
std::string KjvCachePath();

// The King James Bible: from the cache when it holds 66 books, else by running `bible_program`
// (a missing program is an error naming the package bible-kjv), then cached (written atomically;
// an unwritable cache is skipped). The cache is plain text: one verse per line, books separated by an
// empty line.
TextCorpus LoadKjv(const std::string& bible_program = "bible");

// A user's plain text file: documents are its lines; the last lines holding about 5% of the bytes
// (at least one line) are held out. Throws shardstep::Error naming the file when it cannot be read or
// is too short to split.
TextCorpus LoadTextFile(const std::string& path);

// file "" = LoadKjv(), else LoadTextFile(file).
TextCorpus LoadTextCorpus(const std::string& file);

// Word-level tokenizer for the masked LM. Text is lowercased (ASCII); a word is a maximal run of letters
// and digits; every other non-space byte is a token of its own; whitespace separates. Ids: the special
// tokens [PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4, then the most frequent tokens of the training
// text by decreasing count, ties in byte order, up to vocab_size ids in all.
class WordTokenizer {
 public:
  static constexpr int32_t kPad = 0, kUnk = 1, kCls = 2, kSep = 3, kMask = 4, kNumSpecial = 5;
  static constexpr int64_t kDefaultVocabSize = 8192;

  // vocab_size 0 = kDefaultVocabSize; fewer distinct tokens than that gives a smaller vocabulary.
  WordTokenizer(const std::string& training_text, int64_t vocab_size);
  std::vector<int32_t> Encode(const std::string& text) const;
  int64_t size() const { return static_cast<int64_t>(words_.size()); }
  const std::string& word(int32_t id) const { return words_.at(id); }
  int32_t id(const std::string& word) const;  // kUnk when unknown

  // The tokens of `text`, before the vocabulary lookup.
  static std::vector<std::string> Split(const std::string& text);

 private:
  std::vector<std::string> words_;
  std::unordered_map<std::string, int32_t> ids_;
};

}  // namespace shardstep::runtime
