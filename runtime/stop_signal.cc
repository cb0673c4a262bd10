#include "runtime/stop_signal.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <mutex>
#include <thread>

#include "ir/error.h"

namespace shardstep::runtime {
namespace {

volatile std::sig_atomic_t g_stop_signal = 0;
std::atomic<bool> g_armed{false};

static_assert(std::atomic<bool>::is_always_lock_free);  // stored in a signal handler
extern "C" void RecordStopSignal(int signal_number) {
  g_stop_signal = signal_number;
  g_armed = false;
}

sigset_t StopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

// Ends the process by `sig`'s default action: only this thread lets it through.
[[noreturn]] void DieBy(int sig) {
  signal(sig, SIG_DFL);
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, sig);
  pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
  kill(getpid(), sig);
  for (;;) pause();  // the pending signal is delivered to this thread, which never returns from it
}

void Watch() {
  const sigset_t set = StopSignals();
  for (;;) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;
    if (g_armed.exchange(false)) {
      g_stop_signal = sig;
      signal(sig, SIG_DFL);  // as the handler's SA_RESETHAND: the next one of this kind kills
    } else {
      DieBy(sig);
    }
  }
}

}  // namespace

void StartStopSignalWatcher() {
  const sigset_t set = StopSignals();
  if (pthread_sigmask(SIG_BLOCK, &set, nullptr) != 0) throw Error("cannot block SIGTERM and SIGINT");
  static std::once_flag started;
  std::call_once(started, [] { std::thread(Watch).detach(); });  // sigwait: the mask above is inherited
}

void InstallStopSignalHandlers() {
  StartStopSignalWatcher();
  g_stop_signal = 0;
  g_armed = true;
  // For threads that started before the watcher and still let the signals through: the flag only.
  struct sigaction action;
  std::memset(&action, 0, sizeof action);
  action.sa_handler = RecordStopSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESETHAND | SA_RESTART;  // one-shot; interrupted reads and writes resume
  for (int s : {SIGTERM, SIGINT})
    if (sigaction(s, &action, nullptr) != 0) throw Error(Str("cannot install the ", SignalName(s), " handler"));
}

int StopSignalReceived() { return g_stop_signal; }

std::string SignalName(int signal_number) {
  switch (signal_number) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    default: return Str("signal ", signal_number);
  }
}

}  // namespace shardstep::runtime
