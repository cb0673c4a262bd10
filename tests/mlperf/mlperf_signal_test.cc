// bench/mlperf: a run stopped by SIGTERM or SIGINT ends as an aborted run. The handler only sets a flag
// (runtime/stop_signal.h); the loop sees it between steps, closes the open block, logs run_stop with
// status aborted and the signal as the reason, flushes the log, and the binary exits 128 + the signal.
// The log still complies with the rules (CheckMlLog): the signal is sent after the first evaluation,
// once the second block has started.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "runtime/mllog_check.h"
#include "tests/mlperf/mlperf_util.h"
#include "tests/test_util.h"

using namespace mlperf_test;

namespace {

// Starts mlperf_transformer --smoke (a budget it never spends, an unreachable target) logging to `log`,
// waits for its second block_start, sends `sig`, and returns the exit status (-1: not a normal exit).
int StopMidRun(const std::string& log, const std::string& output, int sig) {
  const std::string binary = std::string(SS_BINARY_DIR) + "/bench/mlperf_transformer";
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int fd = open(output.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    execl(binary.c_str(), binary.c_str(), "--smoke", "--max-steps", "1000000", "--eval-every", "2", "--eval-batches", "1",
          "--target", "0.01", "--no-update-timing", "--out-dir", "", "--log", log.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  bool started = false;
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (waitpid(pid, &status, WNOHANG) == pid) {  // ended on its own: a failure
      INFO(Slurp(output));
      FAIL("mlperf_transformer ended before the signal");
    }
    // Only whole lines: the binary may be in the middle of writing the last one.
    const std::string text = Slurp(log);
    if (Count(Records(text.substr(0, text.rfind('\n') + 1)), "block_start") >= 2) {
      started = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!started) kill(pid, SIGKILL);
  else kill(pid, sig);
  REQUIRE(waitpid(pid, &status, 0) == pid);
  INFO(Slurp(output));
  REQUIRE(started);
  if (WIFSIGNALED(status)) return -1000 - WTERMSIG(status);  // killed: -1000 - the signal
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

void CheckAbortedBy(const std::string& log, const std::string& name) {
  const std::string text = Slurp(log);
  INFO(text);
  for (const std::string& p : shardstep::runtime::CheckMlLog(text)) FAIL_CHECK(p);
  const auto rec = Records(text);
  REQUIRE(rec.size() > 2);
  CHECK(rec.back()["key"] == "run_stop");
  CHECK(rec.back()["metadata"]["status"] == "aborted");
  CHECK(rec.back()["metadata"]["error"].get<std::string>().find("stopped by " + name) != std::string::npos);
  // The block the signal interrupted is closed before run_stop; no evaluation follows it.
  CHECK(rec[rec.size() - 2]["key"] == "block_stop");
  CHECK(Count(rec, "block_start") == Count(rec, "block_stop"));
  CHECK(Count(rec, "eval_accuracy") >= 1);
}

}  // namespace

TEST_CASE("SIGTERM mid-run: run_stop aborted with the signal, a compliant log, exit 128 + 15") {
  shardstep::testing::TempDir dir;
  CHECK(StopMidRun(dir / "run.log", dir / "out.txt", SIGTERM) == 128 + SIGTERM);
  CheckAbortedBy(dir / "run.log", "SIGTERM");
}

TEST_CASE("SIGINT mid-run: the same, exit 128 + 2") {
  shardstep::testing::TempDir dir;
  CHECK(StopMidRun(dir / "run.log", dir / "out.txt", SIGINT) == 128 + SIGINT);
  CheckAbortedBy(dir / "run.log", "SIGINT");
}
