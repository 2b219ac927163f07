"""A run's progress: where it is (`Progress`, which its checkpoint saves), the clock that charges it its
training time, and how it shows as it goes (`Meter`: the bar while it trains; at each evaluation a line above
the bar and a row of metrics.jsonl).

Apart from the loop, which decides what happens at each step, and from checkpointing.py, which carries Progress
as one dict among the files it writes: what a run counts, how its time is measured and how the counts are shown
are read together here. The clock and the bar leave evaluations out, so that train_time_s, the images per second
and the bar's time left are the training's alone.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from vitscope.training.config import TrainConfig
from vitscope.training.task import Evaluation, Task


@dataclass
class Progress:
    """Where a run is: what a checkpoint saves besides the weights and the optimizer (the data position is
    the step: every epoch's order comes from (seed, epoch))."""

    step: int = 0
    best_metric: float = 0.0  # the best value of the task's Metric (accuracy, CIDEr-D, exact match) so far
    train_time_s: float = 0.0
    seen: int = 0
    # the running epoch's training loss and accuracy so far, so a resumed epoch reports the same numbers
    epoch_loss_sum: float = 0.0
    epoch_correct: int = 0
    epoch_count: int = 0
    train_cpu_s: float = 0.0  # the process's CPU seconds of training, all its threads

    def to_state(self) -> dict:
        return {"step": self.step, "best_metric": self.best_metric, "train_time_s": self.train_time_s,
                "seen": self.seen,
                "epoch_sums": [self.epoch_loss_sum, self.epoch_correct, self.epoch_count],
                "train_cpu_s": self.train_cpu_s}

    @classmethod
    def from_state(cls, s: dict) -> Progress:
        sums = s.get("epoch_sums")
        if not (isinstance(sums, (list, tuple)) and len(sums) == 3 and all(isinstance(x, (int, float)) for x in sums)):
            sums = [0.0, 0, 0]  # runs saved before these were kept start the epoch's sums at 0
        cpu = s.get("train_cpu_s")  # runs saved before it was kept count from 0
        return cls(int(s["step"]), float(s[best_metric_key(s)]), float(s["train_time_s"]), int(s["seen"]),
                   float(sums[0]), int(sums[1]), int(sums[2]), float(cpu) if isinstance(cpu, (int, float)) else 0.0)


def best_metric_key(state: dict) -> str:
    """Where a state holds the best metric: states saved before it was named for every task's metric call it
    best_acc (an accuracy, a CIDEr-D or an exact match all the same)."""
    return "best_acc" if "best_metric" not in state and "best_acc" in state else "best_metric"


class Meter:
    """The run's training clock and what it shows of its progress (the main process alone shows it)."""

    def __init__(self, at: Progress, task: Task, cfg: TrainConfig, run_dir: Path, *, total: int, steps_per_epoch: int,
                 show: bool, main: bool):
        self.at, self.task, self.cfg, self.run_dir, self.main = at, task, cfg, run_dir, main
        self.steps_per_epoch = steps_per_epoch
        self.bar = tqdm(total=total, initial=at.step, disable=not (show and main), unit="step", dynamic_ncols=True,
                        desc=f"train {task.label}")

    # -- the clock ------------------------------------------------------------------------------------------
    @staticmethod
    def clock() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def charge(self, start: tuple[float, float]) -> None:
        """Add the training time since `start` (a `clock()`) to the run's: wall seconds, and the process's CPU
        seconds (all its threads), which other jobs on a shared machine's cores change far less."""
        self.at.train_time_s += time.perf_counter() - start[0]
        self.at.train_cpu_s += time.process_time() - start[1]

    # -- what it shows --------------------------------------------------------------------------------------
    def show_step(self, epoch: int, i: int, start: tuple[float, float]) -> None:
        """Step `i` of `epoch` is done; the clock has run since `start` without being charged yet."""
        at = self.at
        elapsed = at.train_time_s + time.perf_counter() - start[0]
        if i % 10 == 0 or i == self.steps_per_epoch - 1:
            self.bar.set_postfix(epoch=epoch + 1, loss=f"{at.epoch_loss_sum / at.epoch_count:.3f}",
                                 acc=f"{at.epoch_correct / at.epoch_count:.3f}",
                                 img_s=f"{at.seen / max(elapsed, 1e-9):.0f}", refresh=False)
        self.bar.update(1)

    def after_evaluation(self) -> None:
        # The evaluation is not a step: without this the bar's first rate after it counted its seconds as
        # one step's (the quick preset's time left read 6 hours for a while); its clock shows training time.
        self.bar.unpause()

    def record(self, epoch: float, lr: float, ev: Evaluation) -> None:
        """Write the evaluation's metrics row (`epoch` is fractional inside an epoch: --eval-every-steps) and its
        line; the running epoch's training loss and accuracy are those so far."""
        at, metric = self.at, self.task.metric
        count = max(at.epoch_count, 1)
        row = {"epoch": epoch, "step": at.step, "lr": lr,
               "train_loss": at.epoch_loss_sum / count, "train_acc": at.epoch_correct / count,
               "test_loss": ev.loss, metric.key: ev.value, "train_time_s": round(at.train_time_s, 2),
               "train_cpu_s": round(at.train_cpu_s, 2),
               f"{self.task.unit}_per_s": round(at.seen / max(at.train_time_s, 1e-9), 1) if at.seen else None, **ev.row}
        if self.main:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            shown = (f"epoch {epoch}/{self.cfg.epochs}" if isinstance(epoch, int)
                     else f"epoch {epoch:.2f}, step {at.step}")
            self.bar.write(f"{shown}  train loss {row['train_loss']:.4f}  {self.cfg.eval_split} {metric.name} "
                           f"{metric.format(ev.value)}  ({at.train_time_s / 60:.1f} min)")

    def close(self) -> None:
        self.bar.close()
