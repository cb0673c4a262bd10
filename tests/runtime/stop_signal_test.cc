// runtime/stop_signal.h and TrainOptions::stop_requested: SIGTERM / SIGINT only set a flag (taken by a watcher
// thread, one-shot: the next one kills as usual); the training loop asks before every step and ends the run as an
// error naming the signal and the last step done, logging run_stop aborted in the MLPerf log.
#include <catch2/catch.hpp>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <sstream>

#include "dsl/dsl.h"
#include "models/models.h"
#include "runtime/dataset.h"
#include "runtime/executor.h"
#include "runtime/image_data.h"
#include "runtime/mllog.h"
#include "runtime/sharding.h"
#include "runtime/stop_signal.h"
#include "runtime/trainer.h"

using namespace shardstep;
using namespace shardstep::runtime;
using Catch::Matchers::Contains;

namespace {
// The signal is sent to the process and taken by the watcher thread (or a thread that lets it through).
int SendAndWait(int sig) {
  REQUIRE(kill(getpid(), sig) == 0);  // the process lives on: the watcher only records it
  for (int i = 0; i < 500 && StopSignalReceived() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return StopSignalReceived();
}
}  // namespace

TEST_CASE("a stop signal sets the flag once; the next one falls back to the default") {
  InstallStopSignalHandlers();
  CHECK(StopSignalReceived() == 0);
  sigset_t mask;
  REQUIRE(pthread_sigmask(SIG_BLOCK, nullptr, &mask) == 0);
  CHECK(sigismember(&mask, SIGTERM) == 1);  // this thread (and those it starts) never takes one
  CHECK(sigismember(&mask, SIGINT) == 1);
  CHECK(SendAndWait(SIGTERM) == SIGTERM);
  struct sigaction now;
  REQUIRE(sigaction(SIGTERM, nullptr, &now) == 0);
  CHECK(now.sa_handler == SIG_DFL);  // a second SIGTERM would kill
  InstallStopSignalHandlers();       // re-arms and clears
  CHECK(StopSignalReceived() == 0);
  CHECK(SendAndWait(SIGINT) == SIGINT);
  CHECK(SignalName(SIGTERM) == "SIGTERM");
  CHECK(SignalName(SIGINT) == "SIGINT");
  signal(SIGTERM, SIG_DFL);
  signal(SIGINT, SIG_DFL);
}

TEST_CASE("the training loop stops between steps when asked, with run_stop aborted naming the signal") {
  const Dataset all = SyntheticClassification(100, 1, 28, 28, 10, /*seed=*/4);
  auto data = std::make_shared<Dataset>(TakeExamples(all, 0, 80));
  dsl::Model m("mlp", /*seed=*/2);
  models::ModelOptions mo;
  mo.batch = 16;
  mo.hidden = {8};
  const dsl::Program p =
      m.train(models::DefineMlp(m, mo)).optimizer(ir::OptimizerConfig().kind(ir::OptimizerKind::kSgd).lr(1e-2)).build();
  auto exec = MakeInterpreterExecutor(p.step, InitLogicalState(p.step));
  ImageBatchSource source(data, 16, true, 11, ir::Shape{784}, "synthetic");
  std::ostringstream log_text, progress;
  MlLog mllog(&log_text);
  TrainOptions o;
  o.steps = 20;
  o.batch = 16;
  o.mllog = &mllog;
  int asked = 0;
  o.stop_requested = [&] { return ++asked > 3 ? SIGTERM : 0; };  // the signal arrives during step 3
  CHECK_THROWS_WITH(Train(*exec, p.forward, source, nullptr, kClassificationTask, o, progress),
                    Contains("stopped by SIGTERM after step 3"));
  CHECK(asked == 4);
  const std::string text = log_text.str();
  INFO(text);
  const std::string last = text.substr(text.rfind(":::MLLOG"));
  CHECK_THAT(last, Contains("\"run_stop\"") && Contains("\"aborted\"") && Contains("stopped by SIGTERM after step 3"));
}
