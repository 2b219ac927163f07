"""The `vitscope` command's entry point. It imports nothing heavy itself, so a Ctrl-C while torch loads is
one line and exit code 130, like a Ctrl-C at any later moment; and it sets OpenMP's wait policy before torch
loads (`prepare_threads`)."""

from __future__ import annotations

import os
import signal
import sys

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process ended by Ctrl-C


# OpenMP's threads wait for each other at the end of every parallel region. By default they spin there; when
# another process holds one of the cores, a spinning thread burns the time slice its partner needs, and a
# training beside another job ran 7-55 times slower instead of about twice (benchmarks/beside_busy.py,
# docs/performance.md). Passive waiting sleeps instead. A user's own setting is kept.
WAIT_POLICY = {"OMP_WAIT_POLICY": "PASSIVE"}


def prepare_threads() -> None:
    """Before torch loads (OpenMP reads its settings once): wait passively, unless the environment says how."""
    if not any(k in os.environ for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")):
        os.environ.update(WAIT_POLICY)


def main(argv: list[str] | None = None) -> int:
    prepare_threads()
    interrupted = []

    def on_interrupt(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt

    # Python's own handler, remembered: an interrupt inside a library's import can surface as another error
    # (numpy, half imported, recursing), which is then the interrupt's doing, not a bug to show.
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_interrupt)
    try:
        # SIGINT waits while torch loads: an interrupt landing inside its C++ initialisation aborted the process
        # (SIGABRT, a stack dump) once in a few hundred tries; held back, it arrives as soon as the import is done
        # and ends the command with its one line like any other.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            from vitscope.cli.main import main as run
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        code = run(argv)
        if code == INTERRUPTED:  # the command caught the interrupt itself, and said so
            return _leave_interrupted()
        return code
    except KeyboardInterrupt:
        pass
    except Exception:
        if not interrupted:
            raise
    print("vitscope: interrupted", file=sys.stderr)
    return _leave_interrupted()


def _leave_interrupted() -> int:
    """Exit with 130 now. An interrupt that landed inside code a library runs through exec() (scipy does, while
    it loads) marks the interpreter, which would then end itself by SIGINT at exit (status -2) whatever this
    returns; everything a run holds was released as the interrupt unwound, so nothing is lost by leaving here."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
