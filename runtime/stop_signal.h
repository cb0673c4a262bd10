// A stop request by signal: SIGTERM (a job scheduler's `kill`, a timeout) or SIGINT (Ctrl-C) sets a flag
// that a training loop reads between steps, so the run ends as an aborted run — its MLPerf log closed
// with run_stop status aborted and flushed — instead of dying mid-line. The handler does nothing but one
// store to a volatile sig_atomic_t (async-signal-safe); all I/O happens in the loop. It is installed with
// SA_RESETHAND: a second signal of the same kind finds the default action and kills the process, so a
// run stuck in a long step (or in compilation) can still be stopped at once.
#pragma once

#include <string>

namespace shardstep::runtime {

// Installs the handler for SIGTERM and SIGINT (again after a signal was taken: re-arms it).
void InstallStopSignalHandlers();
// The signal received since the handlers were installed (SIGTERM or SIGINT), else 0.
int StopSignalReceived();
// "SIGTERM", "SIGINT", else "signal N".
std::string SignalName(int signal_number);

}  // namespace shardstep::runtime
