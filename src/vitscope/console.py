"""The `vitscope` command's entry point. It imports nothing heavy itself, so a Ctrl-C while torch loads is
one line and exit code 130, like a Ctrl-C at any later moment."""

from __future__ import annotations

import signal
import sys

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process ended by Ctrl-C


def main(argv: list[str] | None = None) -> int:
    interrupted = []

    def on_interrupt(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt

    # Python's own handler, remembered: an interrupt inside a library's import can surface as another error
    # (numpy, half imported, recursing), which is then the interrupt's doing, not a bug to show.
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_interrupt)
    try:
        from vitscope.cli.main import main as run

        return run(argv)
    except KeyboardInterrupt:
        pass
    except Exception:
        if not interrupted:
            raise
    print("vitscope: interrupted", file=sys.stderr)
    return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
