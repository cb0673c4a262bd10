// A stop request by signal: SIGTERM (a job scheduler's `kill`, a timeout) or SIGINT (Ctrl-C) sets a flag
// that a training loop reads between steps, so the run ends as an aborted run — its MLPerf log closed
// with run_stop status aborted and flushed — instead of dying mid-line. All I/O happens in the loop.
// A second signal of the same kind kills the process as the default action does, so a run stuck in a
// long step (or in compilation) can still be stopped at once.
//
// The signals are taken by one watcher thread (sigwait), never by a thread that computes: they are
// blocked in the thread that starts the watcher and so in every thread it creates later (TBB's workers,
// oneDNN's OpenMP threads, the batch prefetcher). Why: oneDNN 2.6's f32 GEMM kernels point rsp at a heap
// buffer, and a signal delivered during one writes its frame there and corrupts the heap (a crash at the
// next free; oneDNN issue 4845, fixed in later releases). A thread that existed before the watcher
// started may still take one: it runs a handler that only sets the flag (async-signal-safe).
#pragma once

#include <string>

namespace shardstep::runtime {

// Starts the watcher (once per process) and blocks SIGTERM and SIGINT in the calling thread. Until
// InstallStopSignalHandlers, a signal ends the process as its default action would. Call it first in
// main, before any other thread starts. Children started later (popen) inherit the blocked mask.
void StartStopSignalWatcher();
// Arms the stop request (again after a signal was taken: re-arms it and clears the flag). Starts the
// watcher if it is not running.
void InstallStopSignalHandlers();
// The signal received since the handlers were installed (SIGTERM or SIGINT), else 0.
int StopSignalReceived();
// "SIGTERM", "SIGINT", else "signal N".
std::string SignalName(int signal_number);

}  // namespace shardstep::runtime
