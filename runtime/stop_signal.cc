#include "runtime/stop_signal.h"

#include <csignal>
#include <cstring>

#include "ir/error.h"

namespace shardstep::runtime {
namespace {

volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void RecordStopSignal(int signal_number) { g_stop_signal = signal_number; }

}  // namespace

void InstallStopSignalHandlers() {
  g_stop_signal = 0;
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
