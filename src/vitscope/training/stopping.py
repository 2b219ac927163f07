"""Why a run stops early: a signal, or a loss that is no longer finite.

A first SIGINT or SIGTERM asks the loop to stop: it saves a checkpoint at the next step and leaves, and an
evaluation under way is abandoned rather than finished (a caption split's beam search can take minutes,
past a scheduler's grace period). A second signal leaves at once.
"""

from __future__ import annotations

import signal
from pathlib import Path

from vitscope.errors import VitscopeError
from vitscope.training.checkpointing import Checkpoint
from vitscope.training.config import TrainConfig


class NonFiniteLoss(VitscopeError, RuntimeError):
    """The loss became NaN or infinite; the message says which step, what was kept and what to try."""


class Abandon(Exception):
    """Raised by the signal handler inside an evaluation, which the loop then abandons."""


class Stopper:
    """The first SIGINT/SIGTERM names itself in `signal`: the loop saves a checkpoint at the next step and
    exits, and an evaluation under way (`abortable`) is abandoned at once. A second raises KeyboardInterrupt
    wherever the run is: every checkpoint write is atomic, so the last committed one survives."""

    def __init__(self, *, can_abandon: bool):
        self.signal: str | None = None
        self.can_abandon = can_abandon  # under DDP the ranks finish an evaluation together
        self.abortable = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        if self.abortable and self.can_abandon:
            self.abortable = False
            raise Abandon

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)



def non_finite(value: float, step: int, epoch: int, cfg: TrainConfig, run_dir: Path, last: Checkpoint | None) -> str:
    again = (f"a lower --lr (now {cfg.lr}), --clip-grad or --amp fp32; --resume would meet the same loss, so train "
             f"again: vitscope train --config {run_dir / 'config.json'} --lr LOWER")
    if last is None:
        return (f"loss became {value} at step {step} (epoch {epoch + 1}) before the run's first checkpoint, so "
                f"nothing was kept. Try {again} --out {run_dir} --overwrite")
    return (f"loss became {value} at step {step} (epoch {epoch + 1}); the run stopped, and {run_dir} keeps its last "
            f"good checkpoint, {last.describe()}. Try {again} --out NEW_DIR")
