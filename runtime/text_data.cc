// The KJV / plain-text corpora, the character-LM and masked-LM batch sources.
#include "runtime/text_data.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "ir/error.h"
#include "runtime/atomic_file.h"
#include "runtime/splitmix64.h"

namespace shardstep::runtime {
namespace {

namespace fs = std::filesystem;

constexpr int kKjvBooks = 66;
constexpr double kFileHeldOutFraction = 0.05;


uint64_t Mix(uint64_t a, uint64_t b) { return SplitMix64(a ^ (b * 0xd6e8feb86659fd93ull + 0x2545f4914f6cdd1dull)).Next(); }

void CheckOptions(const TextDataOptions& o) {
  if (o.context < 1) throw Error(Str("text data: --context ", o.context, " must be at least 1"));
  if (o.batch < 1) throw Error(Str("text data: --batch ", o.batch, " must be at least 1"));
  if (o.eval_batch < 1) throw Error(Str("text data: --eval-batch ", o.eval_batch, " must be at least 1"));
  if (o.max_eval_batches < 0)
    throw Error(Str("text data: --eval-batches ", o.max_eval_batches, " must be >= 0 (0 = all)"));
}

// The data order shared by both sources: BatchIterator's rules (runtime/dataset.h) over n examples.
class ExampleOrder {
 public:
  ExampleOrder(int64_t n, int64_t batch, bool shuffle, uint64_t seed)
      : n_(n), batch_(batch), shuffle_(shuffle), seed_(seed) {
    StartEpoch(0);
  }
  // The example indices of the next batch.
  const int64_t* Next() {
    if (pos_ + batch_ > n_) StartEpoch(epoch_ + 1);  // drop the incomplete batch
    const int64_t* out = &order_[pos_];
    pos_ += batch_;
    return out;
  }
  void Seek(int64_t epoch, int64_t position, const std::string& what) {
    if (epoch < 0 || position < 0 || position > n_)
      throw Error(Str(what, ": cannot seek to epoch ", epoch, " position ", position, " of ", n_, " examples"));
    StartEpoch(epoch);
    pos_ = position;
  }
  int64_t epoch() const { return epoch_; }
  int64_t position() const { return pos_; }
  int64_t batches_per_epoch() const { return n_ / batch_; }

 private:
  void StartEpoch(int64_t epoch) {
    epoch_ = epoch;
    pos_ = 0;
    order_.resize(n_);
    for (int64_t i = 0; i < n_; ++i) order_[i] = i;
    if (!shuffle_) return;
    SplitMix64 rng(seed_ + static_cast<uint64_t>(epoch));
    for (int64_t i = n_ - 1; i > 0; --i) std::swap(order_[i], order_[rng.Below(i + 1)]);
  }
  int64_t n_, batch_;
  bool shuffle_;
  uint64_t seed_;
  std::vector<int64_t> order_;
  int64_t epoch_ = 0, pos_ = 0;
};

Tensor& Slot(TensorMap* inputs, const char* name, ir::DType dtype, int64_t b, int64_t t) {
  Tensor& x = (*inputs)[name];
  x.type = {dtype, {b, t}};
  if (dtype == ir::DType::kS32) {
    x.s32.resize(b * t);
    x.f32.clear();
  } else {
    x.f32.resize(b * t);
    x.s32.clear();
  }
  return x;
}

std::string Join(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

// ---- Character LM ----

struct CharCorpus {
  std::string name;
  std::array<int32_t, 256> id{};
  std::vector<int32_t> train, held_out;  // token ids
  std::string held_out_names;
};

class CharLmSource : public BatchSource {
 public:
  CharLmSource(std::shared_ptr<const CharCorpus> c, const TextDataOptions& o)
      : c_(std::move(c)), t_(o.context), batch_(o.batch),
        n_((static_cast<int64_t>(c_->train.size()) - 1) / o.context), order_(n_, o.batch, o.shuffle, o.seed) {}
  void Next(TensorMap* inputs) override {
    Tensor& tok = Slot(inputs, "tokens", ir::DType::kS32, batch_, t_);
    Tensor& tgt = Slot(inputs, "targets", ir::DType::kS32, batch_, t_);
    const int64_t* idx = order_.Next();
    for (int64_t b = 0; b < batch_; ++b) {
      const int32_t* w = &c_->train[idx[b] * t_];
      std::copy(w, w + t_, &tok.s32[b * t_]);
      std::copy(w + 1, w + 1 + t_, &tgt.s32[b * t_]);
    }
  }
  int64_t epoch() const override { return order_.epoch(); }
  int64_t position() const override { return order_.position(); }
  void Seek(int64_t epoch, int64_t position) override { order_.Seek(epoch, position, "char LM data"); }
  int64_t batches_per_epoch() const override { return order_.batches_per_epoch(); }
  std::string Describe() const override {
    return Str(c_->name, " characters, train (", c_->train.size(), " characters, ", n_, " windows of ", t_,
               "; held out: ", c_->held_out_names, ")");
  }

 private:
  std::shared_ptr<const CharCorpus> c_;
  int64_t t_, batch_, n_;
  ExampleOrder order_;
};

class CharLmEval : public EvalSet {
 public:
  CharLmEval(std::shared_ptr<const CharCorpus> c, const TextDataOptions& o) : c_(std::move(c)), t_(o.context),
      batch_(o.eval_batch) {
    const int64_t windows = (static_cast<int64_t>(c_->held_out.size()) - 1) / t_;
    batches_ = windows / batch_;
    if (batches_ == 0)
      throw Error(Str("text data: the held-out text of ", c_->name, " (", c_->held_out.size(),
                      " characters) is too short for one eval batch of ", batch_, " x ", t_ + 1, " characters"));
    if (o.max_eval_batches > 0) batches_ = std::min(batches_, o.max_eval_batches);
  }
  int64_t num_batches() const override { return batches_; }
  void Batch(int64_t i, TensorMap* inputs) const override {
    if (i < 0 || i >= batches_) throw Error(Str("char LM eval: batch ", i, " out of range [0, ", batches_, ")"));
    Tensor& tok = Slot(inputs, "tokens", ir::DType::kS32, batch_, t_);
    Tensor& tgt = Slot(inputs, "targets", ir::DType::kS32, batch_, t_);
    for (int64_t b = 0; b < batch_; ++b) {
      const int32_t* w = &c_->held_out[(i * batch_ + b) * t_];
      std::copy(w, w + t_, &tok.s32[b * t_]);
      std::copy(w + 1, w + 1 + t_, &tgt.s32[b * t_]);
    }
  }
  std::string Describe() const override {
    return Str(c_->name, " characters, held out ", c_->held_out_names, " (", batches_, " batches of ", batch_, " x ",
               t_, ")");
  }

 private:
  std::shared_ptr<const CharCorpus> c_;
  int64_t t_, batch_, batches_;
};

// ---- Masked LM ----

struct MlmCorpus {
  std::string name;
  int64_t vocab;
  std::vector<int32_t> train, held_out;  // word ids, packed
  std::string held_out_names;
};

// Example `index` as a BERT pre-training pair drawn from `key`. The chunk stream[index * W, index * W + W)
// (W = T - 3 words) is cut after len_a words, len_a uniform in [max(1, W/4), W - max(1, W/4)]: A is the
// part before the cut. With probability 0.5 B is the rest of the chunk, the words that follow A
// (next_sentence 1); else B is as many words from a random place of the stream at least W words away
// from that continuation (0; a stream too short for one is a next pair). Layout [CLS] A [SEP] B [SEP],
// segments 0 up to the first [SEP], 1 after it. Then BERT's masking of the W word positions (never
// [CLS] or [SEP]): each is selected with probability 0.15 (at least one); a selected one becomes [MASK]
// with probability 0.8, a random word with 0.1, stays with 0.1.
void PairExample(const std::vector<int32_t>& stream, int64_t index, int64_t t, int64_t vocab, uint64_t key,
                 int32_t* tok, int32_t* seg, int32_t* tgt, float* w, int32_t* next) {
  const int64_t words = t - 3, n = static_cast<int64_t>(stream.size());
  SplitMix64 rng(key);
  bool is_next = rng.UniformDouble() < 0.5;
  const int64_t margin = std::max<int64_t>(1, words / 4);
  const int64_t len_a = margin + rng.Below(words - 2 * margin + 1), len_b = words - len_a;
  const int64_t a_start = index * words, follow = a_start + len_a;
  int64_t b_start = follow;
  if (!is_next) {
    // Uniform over the starts [0, n - len_b] outside (follow - W, follow + W).
    const int64_t last = n - len_b;
    const int64_t lo = std::max<int64_t>(0, follow - words + 1), hi = std::min(last, follow + words - 1);
    const int64_t allowed = last + 1 - (hi - lo + 1);
    if (allowed > 0) {
      const int64_t r = rng.Below(allowed);
      b_start = r < lo ? r : r + (hi - lo + 1);
    } else {
      is_next = true;
    }
  }
  *next = is_next ? 1 : 0;
  const int64_t sep_a = 1 + len_a;
  tok[0] = WordTokenizer::kCls;
  std::copy(&stream[a_start], &stream[a_start] + len_a, tok + 1);
  tok[sep_a] = WordTokenizer::kSep;
  std::copy(&stream[b_start], &stream[b_start] + len_b, tok + sep_a + 1);
  tok[t - 1] = WordTokenizer::kSep;
  std::copy(tok, tok + t, tgt);
  for (int64_t j = 0; j < t; ++j) seg[j] = j <= sep_a ? 0 : 1;
  std::fill(w, w + t, 0.0f);
  auto is_word = [&](int64_t j) { return j != 0 && j != sep_a && j != t - 1; };
  int64_t selected = 0;
  for (int64_t j = 1; j < t - 1; ++j) {
    if (is_word(j) && rng.UniformDouble() < 0.15) {
      w[j] = 1.0f;
      ++selected;
    }
  }
  if (selected == 0) {  // every example predicts something: the k-th word position
    const int64_t k = rng.Below(words);
    w[k < len_a ? 1 + k : 2 + k] = 1.0f;
  }
  for (int64_t j = 1; j < t - 1; ++j) {
    if (w[j] == 0.0f) continue;
    const double r = rng.UniformDouble();
    if (r < 0.8) {
      tok[j] = WordTokenizer::kMask;
    } else if (r < 0.9) {
      tok[j] = static_cast<int32_t>(WordTokenizer::kNumSpecial + rng.Below(vocab - WordTokenizer::kNumSpecial));
    }
  }
}

// The five inputs of a batch of pairs.
struct PairSlots {
  Tensor *tok, *seg, *tgt, *w, *next;
  PairSlots(TensorMap* inputs, int64_t b, int64_t t)
      : tok(&Slot(inputs, "tokens", ir::DType::kS32, b, t)), seg(&Slot(inputs, "segments", ir::DType::kS32, b, t)),
        tgt(&Slot(inputs, "targets", ir::DType::kS32, b, t)), w(&Slot(inputs, "mask_weights", ir::DType::kF32, b, t)),
        next(&(*inputs)["next_sentence"]) {
    next->type = {ir::DType::kS32, {b}};
    next->s32.resize(b);
    next->f32.clear();
  }
  void Fill(const std::vector<int32_t>& stream, int64_t row, int64_t index, int64_t t, int64_t vocab, uint64_t key) {
    PairExample(stream, index, t, vocab, key, &tok->s32[row * t], &seg->s32[row * t], &tgt->s32[row * t],
                &w->f32[row * t], &next->s32[row]);
  }
};

uint64_t TrainKey(uint64_t seed, int64_t epoch, int64_t index) {
  return Mix(Mix(seed, static_cast<uint64_t>(epoch)), static_cast<uint64_t>(index));
}
uint64_t EvalKey(uint64_t seed, int64_t index) {
  return Mix(Mix(seed ^ 0x6576616c6d61736bull /* "evalmask" */, ~0ull), static_cast<uint64_t>(index));
}

class MlmSource : public BatchSource {
 public:
  MlmSource(std::shared_ptr<const MlmCorpus> c, const TextDataOptions& o)
      : c_(std::move(c)), t_(o.context), batch_(o.batch), seed_(o.seed),
        n_(static_cast<int64_t>(c_->train.size()) / (o.context - 3)), order_(n_, o.batch, o.shuffle, o.seed) {}
  void Next(TensorMap* inputs) override {
    PairSlots slots(inputs, batch_, t_);
    const int64_t* idx = order_.Next();
    for (int64_t b = 0; b < batch_; ++b)
      slots.Fill(c_->train, b, idx[b], t_, c_->vocab, TrainKey(seed_, order_.epoch(), idx[b]));
  }
  int64_t epoch() const override { return order_.epoch(); }
  int64_t position() const override { return order_.position(); }
  void Seek(int64_t epoch, int64_t position) override { order_.Seek(epoch, position, "masked LM data"); }
  int64_t batches_per_epoch() const override { return order_.batches_per_epoch(); }
  std::string Describe() const override {
    return Str(c_->name, " words, masked LM + next sentence train (", c_->train.size(), " tokens, ", n_,
               " sentence pairs of ", t_,
               ", vocabulary ", c_->vocab, "; held out: ", c_->held_out_names, ")");
  }

 private:
  std::shared_ptr<const MlmCorpus> c_;
  int64_t t_, batch_;
  uint64_t seed_;
  int64_t n_;
  ExampleOrder order_;
};

class MlmEval : public EvalSet {
 public:
  MlmEval(std::shared_ptr<const MlmCorpus> c, const TextDataOptions& o)
      : c_(std::move(c)), t_(o.context), batch_(o.eval_batch), seed_(o.seed) {
    batches_ = static_cast<int64_t>(c_->held_out.size()) / (t_ - 3) / batch_;
    if (batches_ == 0)
      throw Error(Str("text data: the held-out text of ", c_->name, " (", c_->held_out.size(),
                      " words) is too short for one eval batch of ", batch_, " sequences of ", t_));
    if (o.max_eval_batches > 0) batches_ = std::min(batches_, o.max_eval_batches);
  }
  int64_t num_batches() const override { return batches_; }
  void Batch(int64_t i, TensorMap* inputs) const override {
    if (i < 0 || i >= batches_) throw Error(Str("masked LM eval: batch ", i, " out of range [0, ", batches_, ")"));
    PairSlots slots(inputs, batch_, t_);
    for (int64_t b = 0; b < batch_; ++b) {
      const int64_t e = i * batch_ + b;
      slots.Fill(c_->held_out, b, e, t_, c_->vocab, EvalKey(seed_, e));
    }
  }
  std::string Describe() const override {
    return Str(c_->name, " words, masked LM + next sentence held out ", c_->held_out_names, " (", batches_, " batches of ", batch_,
               " x ", t_, ")");
  }

 private:
  std::shared_ptr<const MlmCorpus> c_;
  int64_t t_, batch_;
  uint64_t seed_;
  int64_t batches_;
};

std::string ReadFile(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(Str("cannot open ", what, " ", path, ": ", std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw Error(Str("cannot read ", what, " ", path));
  return ss.str();
}

bool OnPath(const std::string& program) {
  if (program.find('/') != std::string::npos) return access(program.c_str(), X_OK) == 0;
  const char* path = getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    if (!dir.empty() && access((dir + "/" + program).c_str(), X_OK) == 0) return true;
  }
  return false;
}

// The cached books (verses one per line, books separated by an empty line), or {} when the file is
// missing or not 66 books (then it is rebuilt).
std::vector<TextDocument> ReadKjvCache(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  std::ostringstream ss;
  ss << in.rdbuf();
  const std::string s = ss.str();
  std::vector<TextDocument> books;
  size_t begin = 0;
  while (begin < s.size()) {
    size_t end = s.find("\n\n", begin);
    if (end == std::string::npos) end = s.size(); else end += 1;
    books.push_back({"", s.substr(begin, end - begin)});
    begin = end + 1;
  }
  if (books.size() != kKjvBooks || books.back().text.empty() || books.back().text.back() != '\n') return {};
  return books;
}

}  // namespace

// ---- Corpora ----

std::string TextCorpus::TrainText() const {
  std::string s;
  for (size_t i = 0; i < documents.size(); ++i) {
    if (!held_out[i]) s += documents[i].text;
  }
  return s;
}

std::string TextCorpus::HeldOutText() const {
  std::string s;
  for (size_t i = 0; i < documents.size(); ++i) {
    if (held_out[i]) s += documents[i].text;
  }
  return s;
}

std::vector<std::string> TextCorpus::HeldOutNames() const {
  std::vector<std::string> names;
  for (size_t i = 0; i < documents.size(); ++i) {
    if (held_out[i]) names.push_back(documents[i].name);
  }
  return names;
}

const std::vector<std::string>& KjvHeldOutBooks() {
  // `bible`'s abbreviations: Ruth, Ecclesiastes, Lamentations, Jonah, Mark, 1 Corinthians, James, Revelation.
  static const std::vector<std::string> books = {"Ruth", "Eccl", "Lam", "Jonah", "Mark", "1Cor", "Jas", "Rev"};
  return books;
}

std::vector<TextDocument> ParseBibleOutput(const std::string& raw) {
  std::vector<TextDocument> books;
  std::istringstream in(raw);
  std::string line;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    // "<book><chapter>:<verse> <text>", the book an optional digit and letters ("1Cor").
    size_t i = 0;
    if (i < line.size() && std::isdigit(static_cast<unsigned char>(line[i]))) ++i;
    const size_t letters = i;
    while (i < line.size() && std::isalpha(static_cast<unsigned char>(line[i]))) ++i;
    const std::string book = line.substr(0, i);
    const size_t colon = line.find(':', i);
    const size_t space = line.find(' ', i);
    bool ok = i > letters && colon != std::string::npos && space != std::string::npos && colon < space &&
              colon > i && space > colon + 1 && space + 1 < line.size();
    for (size_t k = i; ok && k < space; ++k)
      ok = k == colon || std::isdigit(static_cast<unsigned char>(line[k]));
    if (!ok)
      throw Error(Str("bible output line ", line_no, " is not '<Book><chapter>:<verse> <text>': '",
                      line.substr(0, 80), "'"));
    if (books.empty() || books.back().name != book) books.push_back({book, ""});
    books.back().text += line.substr(space + 1) + "\n";
  }
  return books;
}

std::string KjvCachePath() {
  const char* xdg = getenv("XDG_CACHE_HOME");
  if (xdg && *xdg) return std::string(xdg) + "/shardstep/kjv.txt";
  const char* home = getenv("HOME");
  if (home && *home) return std::string(home) + "/.cache/shardstep/kjv.txt";
  return "";
}

TextCorpus LoadKjv(const std::string& bible_program) {
  // The names come from `bible` itself; the cache stores only text, so take them from a fixed table.
  static const std::array<const char*, kKjvBooks> kNames = {
      "Ge",   "Exo",  "Lev",  "Num",  "Deu",   "Josh", "Jdgs",  "Ruth", "1Sm",  "2Sm",  "1Ki",  "2Ki",
      "1Chr", "2Chr", "Ezra", "Neh",  "Est",   "Job",  "Psa",   "Prv",  "Eccl", "SSol", "Isa",  "Jer",
      "Lam",  "Eze",  "Dan",  "Hos",  "Joel",  "Amos", "Obad",  "Jonah", "Mic", "Nahum", "Hab", "Zep",
      "Hag",  "Zec",  "Mal",  "Mat",  "Mark",  "Luke", "John",  "Acts", "Rom",  "1Cor", "2Cor", "Gal",
      "Eph",  "Phi",  "Col",  "1Th",  "2Th",   "1Tim", "2Tim",  "Titus", "Phmn", "Heb", "Jas",  "1Pet",
      "2Pet", "1Jn",  "2Jn",  "3Jn",  "Jude",  "Rev"};
  const std::string cache = KjvCachePath();
  std::vector<TextDocument> books = cache.empty() ? std::vector<TextDocument>{} : ReadKjvCache(cache);
  if (books.empty()) {
    if (!OnPath(bible_program))
      throw Error(Str("the King James Bible corpus needs the Debian package ", kBibleKjvPackage, " (`",
                      bible_program, "` was not found): apt-get install ", kBibleKjvPackage,
                      ", or give a plain text file instead"));
    const std::string cmd = "'" + bible_program + "' -f 'gen1:1-rev22:21' 2>/dev/null";
    FILE* p = popen(cmd.c_str(), "r");
    if (!p) throw Error(Str("cannot run ", bible_program, ": ", std::strerror(errno)));
    std::string raw;
    char buf[1 << 16];
    size_t got;
    while ((got = fread(buf, 1, sizeof buf, p)) > 0) raw.append(buf, got);
    const int status = pclose(p);
    if (status != 0 || raw.empty())
      throw Error(Str("`", bible_program, " -f 'gen1:1-rev22:21'` failed (exit status ",
                      WIFEXITED(status) ? WEXITSTATUS(status) : -1, "); is the package ", kBibleKjvPackage,
                      " (with bible-kjv-text) installed?"));
    books = ParseBibleOutput(raw);
    if (books.size() != kKjvBooks)
      throw Error(Str("`", bible_program, "` printed ", books.size(), " books, expected ", kKjvBooks));
    for (int i = 0; i < kKjvBooks; ++i) {
      if (books[i].name != kNames[i])
        throw Error(Str("`", bible_program, "` printed book ", i + 1, " as '", books[i].name, "', expected '",
                        kNames[i], "'"));
    }
    if (!cache.empty()) {
      std::string text;
      for (size_t i = 0; i < books.size(); ++i) text += (i ? "\n" : "") + books[i].text;
      try {
        std::error_code ec;
        fs::create_directories(fs::path(cache).parent_path(), ec);
        WriteFileAtomically(cache, {{text.data(), text.size()}}, "the KJV text cache");
      } catch (const Error&) {
        // A read-only cache directory only costs re-running `bible` next time.
      }
    }
  }
  TextCorpus c;
  c.name = "kjv";
  const auto& held = KjvHeldOutBooks();
  for (int i = 0; i < kKjvBooks; ++i) {
    c.documents.push_back({kNames[i], std::move(books[i].text)});
    c.held_out.push_back(std::find(held.begin(), held.end(), kNames[i]) != held.end());
  }
  return c;
}

TextCorpus LoadTextFile(const std::string& path) {
  const std::string s = ReadFile(path, "text file");
  TextCorpus c;
  c.name = path;
  size_t begin = 0;
  while (begin < s.size()) {
    size_t end = s.find('\n', begin);
    end = end == std::string::npos ? s.size() : end + 1;
    std::string line = s.substr(begin, end - begin);
    if (line.back() != '\n') line += '\n';
    c.documents.push_back({Str(path, ":", c.documents.size() + 1), std::move(line)});
    begin = end;
  }
  if (c.documents.size() < 2)
    throw Error(Str("text file ", path, " has ", c.documents.size(),
                    " line(s); it needs at least 2 to hold the last ones out for evaluation"));
  // Hold out the last lines: the smallest tail with at least 5% of the bytes.
  const double target = kFileHeldOutFraction * static_cast<double>(s.size());
  c.held_out.assign(c.documents.size(), false);
  double tail = 0;
  for (size_t i = c.documents.size() - 1; i > 0; --i) {
    c.held_out[i] = true;
    tail += static_cast<double>(c.documents[i].text.size());
    if (tail >= target) break;
  }
  return c;
}

TextCorpus LoadTextCorpus(const std::string& file) { return file.empty() ? LoadKjv() : LoadTextFile(file); }

// ---- Tokenizer ----

std::vector<std::string> WordTokenizer::Split(const std::string& text) {
  std::vector<std::string> out;
  std::string word;
  for (char ch : text) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (std::isalnum(c)) {
      word += static_cast<char>(std::tolower(c));
      continue;
    }
    if (!word.empty()) out.push_back(std::move(word)), word.clear();
    if (!std::isspace(c)) out.emplace_back(1, ch);
  }
  if (!word.empty()) out.push_back(std::move(word));
  return out;
}

WordTokenizer::WordTokenizer(const std::string& training_text, int64_t vocab_size) {
  if (vocab_size == 0) vocab_size = kDefaultVocabSize;
  if (vocab_size <= kNumSpecial)
    throw Error(Str("text data: --vocab ", vocab_size, " must be larger than the ", kNumSpecial,
                    " special tokens ([PAD] [UNK] [CLS] [SEP] [MASK])"));
  std::map<std::string, int64_t> counts;  // ordered: ties below fall back to byte order
  for (std::string& w : Split(training_text)) ++counts[std::move(w)];
  std::vector<std::pair<std::string, int64_t>> sorted(counts.begin(), counts.end());
  std::stable_sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  words_ = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"};
  for (const auto& [w, n] : sorted) {
    if (static_cast<int64_t>(words_.size()) >= vocab_size) break;
    words_.push_back(w);
  }
  for (size_t i = 0; i < words_.size(); ++i) ids_[words_[i]] = static_cast<int32_t>(i);
}

int32_t WordTokenizer::id(const std::string& word) const {
  auto it = ids_.find(word);
  return it == ids_.end() ? kUnk : it->second;
}

std::vector<int32_t> WordTokenizer::Encode(const std::string& text) const {
  std::vector<int32_t> ids;
  for (const std::string& w : Split(text)) ids.push_back(id(w));
  return ids;
}

// ---- Factories ----

TextData MakeCharLmData(const TextDataOptions& o) {
  CheckOptions(o);
  if (o.vocab_size != 0)
    throw Error(Str("text data: --vocab ", o.vocab_size,
                    " is for the masked LM's word vocabulary; the character LM uses every character of the corpus"));
  const TextCorpus corpus = LoadTextCorpus(o.file);
  auto c = std::make_shared<CharCorpus>();
  c->name = corpus.name;
  c->held_out_names = Join(corpus.HeldOutNames());
  if (corpus.name != "kjv" && corpus.HeldOutNames().size() > 3)
    c->held_out_names = Str("its last ", corpus.HeldOutNames().size(), " lines");
  std::array<bool, 256> seen{};
  for (const TextDocument& d : corpus.documents) {
    for (char ch : d.text) seen[static_cast<unsigned char>(ch)] = true;
  }
  int32_t vocab = 0;
  for (int i = 0; i < 256; ++i) c->id[i] = seen[i] ? vocab++ : -1;
  for (size_t i = 0; i < corpus.documents.size(); ++i) {
    auto& dst = corpus.held_out[i] ? c->held_out : c->train;
    for (char ch : corpus.documents[i].text) dst.push_back(c->id[static_cast<unsigned char>(ch)]);
  }
  const int64_t windows = (static_cast<int64_t>(c->train.size()) - 1) / o.context;
  if (o.batch > windows)
    throw Error(Str("text data: --batch ", o.batch, " is more than the ", windows, " training windows of ", o.context,
                    " characters in ", c->name));
  TextData out;
  out.eval = std::make_unique<CharLmEval>(c, o);
  out.train = std::make_unique<CharLmSource>(c, o);
  out.vocab = vocab;
  return out;
}

TextData MakeMaskedLmData(const TextDataOptions& o) {
  CheckOptions(o);
  if (o.context < 5)
    throw Error(Str("text data: --context ", o.context, " is too short for [CLS] A [SEP] B [SEP] (at least 5)"));
  if (o.vocab_size < 0) throw Error(Str("text data: --vocab ", o.vocab_size, " must be >= 0 (0 = default)"));
  const TextCorpus corpus = LoadTextCorpus(o.file);
  const WordTokenizer tok(corpus.TrainText(), o.vocab_size);
  auto c = std::make_shared<MlmCorpus>();
  c->name = corpus.name;
  c->vocab = tok.size();
  if (c->vocab <= WordTokenizer::kNumSpecial)
    throw Error(Str("text data: ", corpus.name, " has no words to build a vocabulary from"));
  c->held_out_names = Join(corpus.HeldOutNames());
  if (corpus.name != "kjv" && corpus.HeldOutNames().size() > 3)
    c->held_out_names = Str("its last ", corpus.HeldOutNames().size(), " lines");
  for (size_t i = 0; i < corpus.documents.size(); ++i) {
    std::vector<int32_t> ids = tok.Encode(corpus.documents[i].text);
    auto& dst = corpus.held_out[i] ? c->held_out : c->train;
    dst.insert(dst.end(), ids.begin(), ids.end());
  }
  const int64_t sequences = static_cast<int64_t>(c->train.size()) / (o.context - 3);
  if (o.batch > sequences)
    throw Error(Str("text data: --batch ", o.batch, " is more than the ", sequences, " training sequences of ",
                    o.context, " tokens in ", c->name));
  TextData out;
  out.eval = std::make_unique<MlmEval>(c, o);
  out.train = std::make_unique<MlmSource>(c, o);
  out.vocab = c->vocab;
  return out;
}

}  // namespace shardstep::runtime
