// Crash safety under kill -9 (issue 13): `shardstep train --save-every 5 --keep 2 --save final` is
// killed with SIGKILL at random moments — at a random time, while a periodic checkpoint is being
// written (right after its temporary file appears), and while the final --save is being written —
// in 12 seeded trials. After each kill every step-N.safetensors in the directory loads (checksum
// included) and equals, byte for byte, the file of an uninterrupted run at that step (never a partial
// file); the newest exists once one was reported; the --save path is absent, the previous file, or the
// complete new one. Then the run is resumed with --resume and must end with the uninterrupted run's
// per-step losses and final checkpoint, bitwise.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/checkpoint.h"
#include "runtime/checkpoint_dir.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;
using namespace shardstep;
using shardstep::testing::TempDir;

namespace {

using Clock = std::chrono::steady_clock;

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// Starts the shardstep binary with `args`, stdout and stderr to `log`.
pid_t Spawn(const std::vector<std::string>& args, const std::string& log) {
  const std::string bin = std::string(SS_BINARY_DIR) + "/shardstep";
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(bin.c_str()));
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    ::execv(bin.c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

// Waits for `pid`; its exit code, or 128 + the signal.
int Wait(pid_t pid) {
  int st = 0;
  REQUIRE(::waitpid(pid, &st, 0) == pid);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

std::vector<std::string> TrainArgs(const std::string& dir, int steps) {
  return {"train", "--dataset", "synthetic", "--model", "mlp", "--hidden", "64", "--batch", "64",
          "--eval-batch", "2000", "--log-every", "1000", "--steps", std::to_string(steps),
          "--save-every", "5", "--keep", "2", "--checkpoint-dir", dir + "/ck", "--save", dir + "/out/final.safetensors",
          "--metrics-out", dir + "/metrics.jsonl"};
}

// The "loss" of each step line of a metrics file, as written (9 significant digits: one float each).
std::vector<std::string> Losses(const std::string& metrics) {
  std::vector<std::string> out;
  std::ifstream in(metrics);
  std::string line;
  static const std::regex re(R"(^\{"step":(\d+),"loss":([^,]+),)");
  std::smatch m;
  while (std::getline(in, line)) {
    if (!std::regex_search(line, m, re)) continue;
    REQUIRE(std::stoul(m[1]) == out.size() + 1);  // every step once, in order
    out.push_back(m[2]);
  }
  return out;
}

// The highest step of the "checkpoint <dir>/step-N.safetensors" lines of a log (0: none).
int64_t LastReportedCheckpoint(const std::string& log) {
  static const std::regex re(R"(checkpoint \S*step-(\d+)\.safetensors)");
  int64_t last = 0;
  const std::string text = ReadBytes(log);
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it)
    last = std::max<int64_t>(last, std::stoll((*it)[1]));
  return last;
}

enum class When { kRandomTime, kPeriodicWrite, kFinalWrite };

}  // namespace

TEST_CASE("kill -9 at random moments never leaves a partial checkpoint, and the run resumes bitwise") {
  constexpr int kSteps = 60, kTrials = 12;
  TempDir root;

  // The uninterrupted run, keeping every periodic checkpoint to compare with.
  const std::string ref = root / "ref";
  fs::create_directories(ref + "/out");
  std::vector<std::string> ref_args = TrainArgs(ref, kSteps);
  for (size_t i = 0; i < ref_args.size(); ++i)
    if (ref_args[i] == "--keep") ref_args[i + 1] = "1000";
  const auto t0 = Clock::now();
  REQUIRE(Wait(Spawn(ref_args, ref + "/log")) == 0);
  const double ref_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const std::vector<std::string> ref_losses = Losses(ref + "/metrics.jsonl");
  REQUIRE(ref_losses.size() == kSteps);
  const std::string ref_final = ReadBytes(ref + "/out/final.safetensors");
  REQUIRE(!ref_final.empty());
  REQUIRE(runtime::ListPeriodicCheckpoints(ref + "/ck").size() == kSteps / 5);

  std::mt19937 rng(20261130);
  int mid_write = 0, resumed = 0, final_kept_old = 0, final_new = 0, final_absent = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    const When when = static_cast<When>(trial % 3);
    const std::string dir = root / ("trial" + std::to_string(trial));
    fs::create_directories(dir + "/ck");
    fs::create_directories(dir + "/out");
    const std::string final_path = dir + "/out/final.safetensors";
    // Half of the final-save trials start with an older complete file at the --save path.
    std::string previous;
    if (when == When::kFinalWrite && trial % 2 == 0) {
      runtime::SaveCheckpoint(final_path, {{"old", runtime::Tensor::F32({1}, {1.0f})}});
      previous = ReadBytes(final_path);
    }
    const int target = std::uniform_int_distribution<int>(1, kSteps / 5)(rng);  // which periodic write
    // After the temporary file appears: within the write (most of it takes a few ms, the fsync) or
    // up to 30 ms later (often after the rename: the kill lands between files or after the run).
    const int max_delay = trial % 4 < 2 ? 1500 : 30000;
    const auto delay = std::chrono::microseconds(std::uniform_int_distribution<int>(0, max_delay)(rng));
    const auto at = std::chrono::duration<double>(std::uniform_real_distribution<double>(0.05, 1.1)(rng) * ref_seconds);
    INFO("trial " << trial << " kind " << static_cast<int>(when) << " target write " << target << " delay "
                  << delay.count() << " us, time " << at.count() << " s");

    const int ino = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    REQUIRE(ino >= 0);
    REQUIRE(inotify_add_watch(ino, (dir + "/ck").c_str(), IN_CREATE) >= 0);
    REQUIRE(inotify_add_watch(ino, (dir + "/out").c_str(), IN_CREATE) >= 0);
    const pid_t pid = Spawn(TrainArgs(dir, kSteps), dir + "/log1");
    const auto start = Clock::now();
    int writes_seen = 0;
    bool kill_now = false, exited = false;
    int status = 0;
    while (!kill_now) {
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        exited = true;
        break;
      }
      if (when == When::kRandomTime) {
        kill_now = Clock::now() - start >= at;
        if (!kill_now) std::this_thread::sleep_for(std::chrono::microseconds(200));
        continue;
      }
      pollfd p{ino, POLLIN, 0};
      if (::poll(&p, 1, 2) <= 0) continue;
      alignas(inotify_event) char buf[4096];
      const ssize_t n = ::read(ino, buf, sizeof(buf));
      for (ssize_t off = 0; n > 0 && off < n;) {
        const auto* e = reinterpret_cast<const inotify_event*>(buf + off);
        const std::string name = e->len ? e->name : "";
        off += static_cast<ssize_t>(sizeof(inotify_event) + e->len);
        if (name.find(".tmp.") == std::string::npos) continue;
        const bool final_file = name.rfind("final.safetensors", 0) == 0;
        if (when == When::kFinalWrite && final_file) kill_now = true;
        if (when == When::kPeriodicWrite && !final_file && ++writes_seen == target) kill_now = true;
      }
      if (kill_now) std::this_thread::sleep_for(delay);
    }
    if (!exited) {
      ::kill(pid, SIGKILL);
      const int rc = Wait(pid);
      REQUIRE((rc == 128 + SIGKILL || rc == 0));  // 0: it finished just before the kill
    } else {
      REQUIRE(WEXITSTATUS(status) == 0);  // finished before the chosen moment
    }
    ::close(ino);

    // 1. Every periodic checkpoint present is complete and the uninterrupted run's file at its step.
    const std::vector<runtime::PeriodicCheckpointFile> files = runtime::ListPeriodicCheckpoints(dir + "/ck");
    CHECK(files.size() <= 3);  // --keep 2, plus the newest one before the older ones are removed
    for (const auto& f : files) {
      INFO(f.path);
      REQUIRE_NOTHROW(runtime::LoadCheckpoint(f.path));
      REQUIRE(ReadBytes(f.path) == ReadBytes(ref + "/ck/" + runtime::PeriodicCheckpointName(f.step)));
    }
    const int64_t reported = LastReportedCheckpoint(dir + "/log1");
    if (reported > 0) {
      REQUIRE(!files.empty());
      CHECK(files.back().step >= reported);
    }
    const bool left_temp = !runtime::ListTemporaryFiles(dir + "/ck").empty() ||
                           !runtime::ListTemporaryFiles(dir + "/out").empty();
    mid_write += left_temp;

    // 2. The --save path: absent, the previous file, or the complete new one.
    const std::string fin = ReadBytes(final_path);
    if (!fs::exists(final_path)) {
      CHECK(previous.empty());
      ++final_absent;
    } else if (!previous.empty() && fin == previous) {
      ++final_kept_old;
    } else {
      REQUIRE(fin == ref_final);
      REQUIRE_NOTHROW(runtime::LoadCheckpoint(final_path));
      ++final_new;
    }

    // 3. Resume (or start afresh when no checkpoint was written yet) and finish: bitwise the
    // uninterrupted run's losses and final state.
    std::vector<std::string> args = TrainArgs(dir, kSteps);
    if (!files.empty()) {
      args.push_back("--resume");
      args.push_back(dir + "/ck");
      ++resumed;
    }
    const int rc = Wait(Spawn(args, dir + "/log2"));
    INFO(ReadBytes(dir + "/log2"));
    REQUIRE(rc == 0);
    REQUIRE(Losses(dir + "/metrics.jsonl") == ref_losses);
    REQUIRE(ReadBytes(final_path) == ref_final);
    REQUIRE(runtime::ListTemporaryFiles(dir + "/ck").empty());  // leftovers of the killed writer removed
    REQUIRE(runtime::ListTemporaryFiles(dir + "/out").empty());
    fs::remove_all(dir);
  }
  std::cout << "kill -9: " << kTrials << " trials (reference run " << ref_seconds << " s); " << mid_write
            << " killed with a temporary file being written; " << resumed << " resumed from a checkpoint; --save path: "
            << final_new << " new, " << final_kept_old << " previous kept, " << final_absent << " absent\n";
}
